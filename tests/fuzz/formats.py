"""Format-aware mutations: inputs that get past the first check (a checksum, a magic number) to the code behind it.

Blind bit flips rarely survive a tar header checksum or reach an ``.npy`` header's fields, and cannot make an HDF5
or ``.pt`` file that declares a billion rows in a few bytes. These strategies build such files on purpose: tar
header fields rewritten with their checksum fixed and PAX/GNU records inserted, ``.npy`` headers from their parts,
feature and image shards written by h5py or ``torch.save`` with wrong types, shapes and huge unallocated datasets.
"""

from __future__ import annotations

import io
import tarfile
from typing import Any

import numpy as np
from hypothesis import strategies as st

from tests.fuzz.mutate import Draw, mutate_bytes
from tests.helpers import pax_record

BLOCK = 512

# -- tar ------------------------------------------------------------------------------------------------------------
TAR_FIELDS = (("size", 124, 136), ("name", 0, 100), ("typeflag", 156, 157), ("prefix", 345, 500),
              ("mode", 100, 108), ("mtime", 136, 148), ("linkname", 157, 257), ("magic", 257, 263),
              ("version", 263, 265), ("uid", 108, 116), ("uname", 265, 297), ("devmajor", 329, 337))
TAR_VALUES = (b"77777777777", b"0", b"", b"\x80" + b"\xff" * 11, b"\xff" * 12, b"9", b" ", b"-1", b"00000001000",
              b"00000000000", b"x", b"1", b"2", b"5", b"L", b"K", b"g", b"S", b"\x00", b"../../etc/passwd",
              b"a/b/c.jpg", b"key.cls", b".jpg", b"noext", b"\xff\xfe", b"ustar\x00", b"ustar  \x00", b"/" * 99)


def header_offsets(data: bytes) -> list[int]:
    """Where the member headers of a valid tar start."""
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return [member.offset for member in archive.getmembers()]


def fix_checksum(data: bytearray, at: int) -> None:
    header = data[at:at + BLOCK]
    if len(header) < BLOCK:
        return
    header[148:156] = b" " * 8
    data[at + 148:at + 156] = b"%06o\x00 " % (sum(header) & 0o777777)


def _fit(value: bytes, width: int) -> bytes:
    return value[:width].ljust(width, b"\x00")


def extended_member(kind: bytes, payload: bytes) -> bytes:
    """A pax (``x``) or GNU long-name (``L``) member carrying ``payload``, checksum correct."""
    header = bytearray(BLOCK)
    header[0:100] = _fit(b"././@PaxHeader" if kind == b"x" else b"././@LongLink", 100)
    header[100:108] = b"0000644\x00"
    header[124:136] = b"%011o\x00" % len(payload)
    header[136:148] = b"00000000000\x00"
    header[156:157] = kind
    header[257:265] = b"ustar\x0000"
    fix_checksum(header, 0)
    return bytes(header) + payload + b"\x00" * (-len(payload) % BLOCK)


def mutate_tar(draw: Draw, seed: bytes) -> bytes:
    """Header fields rewritten (checksum fixed, mostly), an extended header inserted, or blind byte edits."""
    offsets = header_offsets(seed)
    mode = draw(st.sampled_from(("field", "field", "extended", "bytes")), label="tar-mode")
    if mode == "bytes":
        return mutate_bytes(draw, seed, hot=BLOCK)
    data = bytearray(seed)
    at = draw(st.sampled_from(offsets), label="member")
    if mode == "extended":
        kind = draw(st.sampled_from((b"x", b"L")))
        if kind == b"x":
            records = draw(st.lists(st.sampled_from((
                (b"size", b"99999999999"), (b"path", b"other.jpg"), (b"size", b"0"), (b"size", b"-5"),
                (b"path", b""), (b"path", b"\xff\xfe"), (b"size", b"12x"), (b"linkpath", b"/etc/passwd"),
                (b"size", b"9" * 400), (b"path", b"a" * 5000))), min_size=1, max_size=3))
            payload = b"".join(pax_record(k, v) for k, v in records)
            if draw(st.booleans()):
                payload = draw(st.sampled_from((b"99999 path=x\n", b"5 a=b\n", b"abc", b"10 path\n", b"0 =\n")))
        else:
            payload = draw(st.sampled_from((b"x" * 200 + b".jpg\x00", b"", b"\xff\xfe.jpg", b"a.jpg\x00" * 1000)))
        data[at:at] = extended_member(kind, payload)
        return bytes(data)
    for _ in range(draw(st.integers(1, 3), label="fields")):
        _, lo, hi = draw(st.sampled_from(TAR_FIELDS), label="field")
        value = draw(st.sampled_from(TAR_VALUES), label="value")
        data[at + lo:at + hi] = _fit(value, hi - lo)
        if draw(st.sampled_from((True, True, True, False)), label="fix-checksum"):
            fix_checksum(data, at)
    return bytes(data)


# -- .npy -----------------------------------------------------------------------------------------------------------
NPY_DESCR = ("<i8", "|S4", "<i4", "|b1", "<f8", "O", ">i8", "<U4", "V8", "|S0", "|S999999999", "<M8[s]", "<c16",
             [("a", "<i8")], "int64", "<i8x", "")
NPY_SHAPES: tuple[Any, ...] = ((4,), (), (2, 2), (0,), (10 ** 12,), (-1,), (4, 0), (1 << 63,), [4], 4, None, "(4,)")
NPY_RAW_HEADERS = (
    "{'descr': '<i8', 'fortran_order': False, 'shape': (4,), 'x': __import__('os')}",
    "{'descr': '<i8', 'fortran_order': False, 'shape': (" + "-" * 60000 + "1,), }",
    "{'descr': '<i8', 'fortran_order': False, 'shape': " + "(" * 100 + ")" * 100 + ", }",
    "{'descr': '<i8', 'fortran_order': False, 'shape': (4,), 'shape': (5,)}",
    "{'descr': '<i8', 'fortran_order': False}",
    "[1, 2, 3]",
    "{'descr': '<i8', 'fortran_order': False, 'shape': (4,), }" + "\x00" * 10,
    "not python at all",
    "{'descr': '<i8', 'fortran_order': False, 'shape': (" + "9" * 5000 + ",), }",
)


def npy_bytes(version: tuple[int, int], header: str, data: bytes, declared: int | None = None) -> bytes:
    """An ``.npy`` file from its parts; ``declared``: a header length other than the true one."""
    text = header.encode("latin1", "replace")
    long = version[0] >= 2
    prefix = 6 + 2 + (4 if long else 2)
    text += b" " * (-(prefix + len(text) + 1) % 64) + b"\n"
    length = len(text) if declared is None else declared
    size = length.to_bytes(4 if long else 2, "little", signed=False) if 0 <= length < (1 << (32 if long else 16)) \
        else b"\xff" * (4 if long else 2)
    return b"\x93NUMPY" + bytes(version) + size + text + data


def mutate_npy(draw: Draw, seed: bytes) -> bytes:
    """A column file whose header is built from wrong parts (dtype, shape, order, version, length) or edited blind."""
    mode = draw(st.sampled_from(("header", "header", "raw", "bytes")), label="npy-mode")
    if mode == "bytes":
        return mutate_bytes(draw, seed, hot=128)
    header_len = int.from_bytes(seed[8:10], "little")
    data = seed[10 + header_len:]
    if draw(st.booleans()):
        data = draw(st.sampled_from((b"", data[:-1], data + b"\x00" * 8, data * 2)))
    version = draw(st.sampled_from(((1, 0), (2, 0), (3, 0), (0, 0), (255, 255))))
    if mode == "raw":
        header = draw(st.sampled_from(NPY_RAW_HEADERS))
    else:
        fields = {"descr": draw(st.sampled_from(NPY_DESCR)),
                  "fortran_order": draw(st.sampled_from((False, True, 0, "x"))),
                  "shape": draw(st.sampled_from(NPY_SHAPES))}
        if draw(st.booleans()):
            del fields[draw(st.sampled_from(sorted(fields)))]
        header = repr(fields)
    declared = draw(st.sampled_from((None, None, 0, 1, 0xFFFF, 1 << 31)))
    return npy_bytes(version, header, data, declared)


# -- HDF5 -----------------------------------------------------------------------------------------------------------
HUGE_ROWS = 1 << 30  # declared rows of an unallocated dataset: a few bytes on disk, GBs if read whole


def _h5_dataset(f: Any, name: str, draw: Draw, good: Any) -> None:
    """Write ``name`` as ``good`` or as one of the ways it can be wrong."""
    import h5py

    kind = draw(st.sampled_from(("good", "good", "huge", "dtype", "shape", "missing", "group", "strings",
                                 "empty", "scalar", "compressed-huge", "link")), label=f"h5-{name}")
    if kind == "good":
        array = np.asarray(good)
        f.create_dataset(name, data=good, dtype=h5py.string_dtype() if array.dtype.kind == "O" else array.dtype)
    elif kind == "huge":
        shape = (HUGE_ROWS,) + tuple(np.shape(good)[1:])
        f.create_dataset(name, shape=shape, dtype=np.asarray(good).dtype if np.asarray(good).dtype.kind != "O"
                         else h5py.string_dtype(), chunks=True)
    elif kind == "compressed-huge":
        shape = (HUGE_ROWS // 64,) + tuple(np.shape(good)[1:])
        f.create_dataset(name, shape=shape, dtype="i8" if np.asarray(good).dtype.kind in "iuf" else "S1",
                         chunks=True, compression="gzip", fillvalue=1 if np.asarray(good).dtype.kind in "iuf"
                         else b"a")
    elif kind == "dtype":
        f.create_dataset(name, data=draw(st.sampled_from((
            np.zeros(np.shape(good)[:1], dtype="f4"), np.zeros(np.shape(good)[:1], dtype="u1"),
            np.array([b"x"] * max(1, len(good))), np.zeros(np.shape(good)[:1], dtype=[("a", "i4"), ("b", "f4")]),
            np.full(np.shape(good)[:1], -1, dtype="i8"), np.full(np.shape(good)[:1], 2 ** 62, dtype="i8")))))
    elif kind == "shape":
        f.create_dataset(name, data=np.zeros(draw(st.sampled_from(((2, 2, 2), (1,), (0,), (7,), (3, 0)))),
                                             dtype=np.asarray(good).dtype if np.asarray(good).dtype.kind != "O"
                                             else "i8"))
    elif kind == "group":
        f.create_group(name)
    elif kind == "strings":
        f.create_dataset(name, data=np.array([b"\xff\xfe", b"\xc3", b"x" * 1000][: max(1, len(good))] * 3,
                                             dtype=h5py.string_dtype(encoding="utf-8")))
    elif kind == "empty":
        f.create_dataset(name, shape=None, dtype="i8")
    elif kind == "scalar":
        f.create_dataset(name, data=7)
    elif kind == "link":
        f[name] = draw(st.sampled_from((h5py.SoftLink("/nowhere"), h5py.ExternalLink("/etc/passwd", "/x"),
                                        h5py.SoftLink(f"/{name}"))))


def _h5_version(f: Any, draw: Draw, good: Any) -> None:
    """The layout ``version`` attribute: mostly right (so the datasets behind it are reached), else missing, another
    number, or a variable-length string (whose value a reader must never read)."""
    import h5py

    kind = draw(st.sampled_from(("good", "good", "good", "missing", "other", "string")), label="h5-version")
    if kind == "good":
        f.attrs["version"] = good
    elif kind == "other":
        f.attrs["version"] = draw(st.sampled_from((1, 3, -1, 2 ** 40)))
    elif kind == "string":
        f.attrs.create("version", "2", dtype=h5py.string_dtype())


def h5_file(draw: Draw, datasets: dict[str, Any], version: Any = None) -> bytes:
    """An HDF5 file of ``datasets``, each written right or wrong (see ``_h5_dataset``), with the seed's layout
    ``version`` (when it had one) written right or wrong."""
    import h5py

    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        if version is not None:
            _h5_version(f, draw, version)
        for name, good in datasets.items():
            _h5_dataset(f, name, draw, good)
        if draw(st.booleans(), label="h5-old-keys"):  # the old layout's variable-length keys beside the new
            f.create_dataset("keys", data=np.array(["k"] * 3, dtype=object), dtype=h5py.string_dtype())
    return buffer.getvalue()


def read_h5(data: bytes) -> tuple[dict[str, Any], Any]:
    """The datasets of a valid seed file, as arrays (strings as Python bytes arrays), and its layout version."""
    import h5py

    with h5py.File(io.BytesIO(data), "r") as f:
        return {name: f[name][...] for name in f}, f.attrs.get("version")


def mutate_h5(draw: Draw, seed: bytes) -> bytes:
    """The seed's datasets rewritten (some wrong) by h5py, or its bytes edited blind."""
    if draw(st.booleans(), label="h5-structured"):
        return h5_file(draw, *read_h5(seed))
    return mutate_bytes(draw, seed, hot=4096)


# -- .pt feature shards ---------------------------------------------------------------------------------------------
def _pt_value(draw: Draw, name: str, good: Any) -> Any:
    import torch

    kind = draw(st.sampled_from(("good", "good", "expanded", "dtype", "shape", "type", "deep", "many", "missing")),
                label=f"pt-{name}")
    if kind == "good":
        return good
    if kind == "expanded":  # one stored element seen as a billion: a few bytes on disk
        if isinstance(good, torch.Tensor):
            return torch.zeros(1, dtype=good.dtype).expand(HUGE_ROWS, *good.shape[1:])
        return ["k"] * 20_000
    if kind == "dtype" and isinstance(good, torch.Tensor):
        return good.to(draw(st.sampled_from((torch.float64, torch.int8, torch.bool, torch.complex64, torch.uint8))))
    if kind == "shape":
        return torch.zeros(draw(st.sampled_from(((0,), (3, 0), (2, 3, 4), (), (1,), (3, 400)))))
    if kind == "type":
        return draw(st.sampled_from((None, 3, "text", [1, 2, 3], {"a": 1}, [None] * 3, 1.5, b"bytes")))
    if kind == "deep":
        value: Any = 1
        for _ in range(draw(st.sampled_from((100, 900)))):
            value = [value]
        return value
    if kind == "many":
        return [f"key{i}" for i in range(20_000)]
    return _MISSING


_MISSING = object()


def mutate_pt(draw: Draw, seed: bytes) -> bytes:
    """The seed's entries re-saved with ``torch.save`` (some wrong, some declaring huge shapes), or blind edits."""
    import torch

    mode = draw(st.sampled_from(("structured", "structured", "bytes")), label="pt-mode")
    if mode == "bytes":
        return mutate_bytes(draw, seed, hot=256)
    good = torch.load(io.BytesIO(seed), weights_only=True)
    obj = {}
    for name in ("features", "labels", "keys", "views", "targets"):
        value = _pt_value(draw, name, good.get(name))
        if value is not _MISSING and (value is not None or name in good):
            obj[name] = value
    top = draw(st.sampled_from(("dict", "dict", "dict", "list", "tensor")), label="pt-top")
    buffer = io.BytesIO()
    torch.save(obj if top == "dict" else list(obj.values()) if top == "list" else torch.zeros(2), buffer)
    return buffer.getvalue()
