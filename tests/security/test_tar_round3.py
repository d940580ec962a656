"""Hardening round 3 (issue 33), tar shards and tar sources: every file is opened through the one door.

- A FIFO, socket, directory, symlink loop or a link to ``/dev/zero`` in place of a tar shard, its byte-index
  sidecar or an HDF5 shard is one error line naming the file, never a hang or a traceback (hang-prone reads run in
  a fresh interpreter with a timeout, so a regression fails instead of stalling the suite).
- A sidecar swapped for a sparse 3 GiB file is refused by its size, never read.
- A PAX ``size`` record wins over the ustar size field, as in ``tarfile`` and GNU tar.
- A huge member (a sparse 3 GiB one, or one over 8 GiB that only a PAX record can declare) is skipped by the size
  its header declares, never read.
- A tar of 200,000 empty members packs in memory proportional to what is kept, not to the members seen.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from preprocess.pack.sources.members import SourceFields
from preprocess.pack.packer import PackConfig, pack_manifest
from preprocess.pack.sources.scan import scan_source
from shards.errors import CorruptDataError, InputError
from shards.formats.tar import iter_tar_shard
from shards.formats.tarheader import ByteSource, read_member
from shards.formats.tarseek import tar_sample_offsets
from tests.helpers import class_image, pax_record, write_image_folder

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"fifo": "FIFO", "socket": "socket", "directory": "directory", "loop": "symbolic links",
         "dev-zero": "character device"}
GIB = 1 << 30


def make_special(path: Path, kind: str) -> None:
    """Put a file of ``kind`` (a key of ``KINDS``) at ``path``, replacing what is there."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        os.mknod(path, 0o600 | 0o140000)  # S_IFSOCK: no privilege needed, unlike a device
    elif kind == "directory":
        path.mkdir()
    elif kind == "loop":
        path.symlink_to(path.name)  # a link to itself
    else:
        path.symlink_to("/dev/zero")


def run_bounded(code: str, *args: object, timeout: float = 60) -> str:
    """``code`` in a fresh interpreter (args in ``sys.argv[1:]``), killed after ``timeout`` s: its stdout and stderr.
    A hang raises ``TimeoutExpired``, so the test fails instead of stalling the suite."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    return result.stdout + result.stderr


# What a reader raised, as one line: "<type>: <message>", or "read <n>" when nothing was raised.
_REPORT = """
import sys
from shards.errors import ShardcacheError
def report(read):
    try:
        print("read", len(list(read())))
    except ShardcacheError as exc:
        print(f"{type(exc).__name__}: {exc}")
"""


def pack_images(folder: Path) -> Path:
    """A small packed dataset (tar shards with their sidecars and columns): 3 shards of 4 samples."""
    write_image_folder(folder / "src", ["ant", "bee", "cat"], 4, size=(16, 12))
    pack_manifest(PackConfig(source=str(folder / "src"), out=str(folder / "ds"), max_samples=4, val_fraction=0,
                             quiet=True))
    return folder / "ds"


# -- special files in place of a shard, a sidecar, an HDF5 shard ---------------------------------------------------
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_special_file_read_as_a_tar_shard_is_one_error_naming_it(tmp_path, kind):
    path = tmp_path / "train-000000.tar"
    make_special(path, kind)
    out = run_bounded(_REPORT + """
from shards.formats.tar import iter_tar_shard
from shards.formats.tarseek import iter_tar_slice, tar_sample_offsets
report(lambda: iter_tar_shard(sys.argv[1]))
report(lambda: iter_tar_slice(sys.argv[1], 2, 5, offsets=[0, 512, 1024, 1536, 2048, 2560, 3072]))
report(lambda: tar_sample_offsets(sys.argv[1]))
""", path)
    lines = out.strip().splitlines()
    assert len(lines) == 3, out
    for line in lines:
        assert line.startswith(("InputError: ", "CorruptDataError: ")) and str(path) in line, out
        assert KINDS[kind] in line, out


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("victim", ["shard", "sidecar"])
@pytest.mark.slow
def test_verify_names_a_special_file_in_place_of_a_shard_or_its_sidecar(tmp_path, kind, victim):
    folder = pack_images(tmp_path)
    shard = json.loads((folder / "dataset.json").read_text())["splits"]["train"]["shards"][1]
    name = shard["path"] if victim == "shard" else shard["index"]
    make_special(folder / name, kind)
    out = run_bounded("""
import sys
from shards.check.verify import verify_dataset
for line in verify_dataset(sys.argv[1], quiet=True).problems:
    print(line)
""", folder)
    problems = out.strip().splitlines()
    # One line for the file (a link out of the folder is refused by the confinement rule before any look at it).
    expected = "outside the dataset folder" if kind == "dev-zero" else KINDS[kind]
    assert problems and name in problems[0].split(": ")[0] and expected in problems[0], out
    assert not any("Traceback" in line for line in problems), out
    assert all(shard["path"] in line for line in problems), out  # the other shards verify clean


@pytest.mark.slow  # starts a Python
def test_a_sparse_3_gib_file_in_place_of_a_sidecar_is_refused_by_its_size(tmp_path):
    folder = pack_images(tmp_path)
    shard = json.loads((folder / "dataset.json").read_text())["splits"]["train"]["shards"][0]
    with open(folder / shard["index"], "r+b") as handle:
        handle.truncate(3 * GIB)
    out = run_bounded("""
import resource, sys
from shards.check.verify import verify_dataset
for line in verify_dataset(sys.argv[1], quiet=True).problems:
    print(line)
print("peak", next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")))  # KiB; ru_maxrss survives exec
""", folder)
    *problems, peak = out.strip().splitlines()
    assert len(problems) == 1 and problems[0].startswith(shard["index"]) and "3221225472 bytes" in problems[0], out
    assert int(peak.split()[1]) < 1 << 20, out  # KiB: well under the 3 GiB a read would take


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.slow
def test_a_special_file_read_as_an_hdf5_shard_is_one_error_naming_it(tmp_path, kind):
    path = tmp_path / "train-000000.h5"
    make_special(path, kind)
    out = run_bounded(_REPORT + """
from shards.formats.hdf5 import iter_hdf5_shard, iter_hdf5_slice, shard_length
report(lambda: iter_hdf5_shard(sys.argv[1]))
report(lambda: iter_hdf5_slice(sys.argv[1], 0, 3))
report(lambda: [shard_length(sys.argv[1])])
""", path)
    lines = out.strip().splitlines()
    assert len(lines) == 3, out
    for line in lines:
        assert line.startswith(("InputError: ", "CorruptDataError: ")) and str(path) in line, out
        assert KINDS[kind] in line, out


# -- PAX size records -----------------------------------------------------------------------------------------------
def _reseal(header: bytearray) -> None:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)


def pax_tar(path: Path, samples: dict[str, dict[str, bytes]]) -> None:
    """A PAX-format tar whose every member carries a pax ``size`` record (as tarfile writes for > 8 GiB)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as archive:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.pax_headers = {"size": str(len(data))}
                archive.addfile(info, io.BytesIO(data))


def set_ustar_size(path: Path, member: str, size: int) -> None:
    """Change the ustar size field of ``member``'s header (the pax record still says the right size)."""
    data = bytearray(path.read_bytes())
    with tarfile.open(path) as archive:
        offset = archive.getmember(member).offset  # the pax header's; the ustar one follows the pax payload
    payload = int(data[offset + 124:offset + 136].rstrip(b"\0 "), 8)
    start = offset + 512 + -(-payload // 512) * 512
    header = bytearray(data[start:start + 512])
    assert header[:len(member)] == member.encode()
    header[124:136] = b"%011o\0" % size
    _reseal(header)
    data[start:start + 512] = header
    path.write_bytes(bytes(data))


def tarfile_view(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isreg()}


def our_view(path: Path) -> dict[str, bytes]:
    found = {}
    with open(path, "rb") as handle:
        source = ByteSource(handle, str(path), total=os.path.getsize(path), hashing=False)
        while (member := read_member(source)) is not None:
            found[member[0]] = source.read(member[1], key=member[0])
    return found


def _samples(n: int = 3) -> dict[str, dict[str, bytes]]:
    return {f"s{i}": {"jpg": class_image(i % 2, i, size=(16, 12)), "cls": str(i % 2).encode(),
                      "txt": b"caption %d" % i} for i in range(n)}


@pytest.mark.parametrize("ustar_size", [0, 7, 5000], ids=["zero", "short", "past-next-members"])
def test_a_pax_size_record_wins_over_the_ustar_size_field(tmp_path, ustar_size):
    path = tmp_path / "pax.tar"
    pax_tar(path, _samples())
    set_ustar_size(path, "s1.jpg", ustar_size)
    expected = tarfile_view(path)
    assert expected["s1.jpg"] == class_image(1, 1, size=(16, 12))  # tarfile believes the pax record
    assert our_view(path) == expected
    assert [(s.key, s.data, s.label) for s in iter_tar_shard(path)] == [
        (f"s{i}", expected[f"s{i}.jpg"], i % 2) for i in range(3)]
    scan = scan_source(str(path), fields=SourceFields(label_member="cls"))
    assert scan.skipped == () and len(scan.samples) == 3


def raw_member(name: str, data: bytes, kind: bytes = tarfile.REGTYPE) -> bytes:
    """One member's header (ustar), data and padding, as bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.type = len(data), kind
    return info.tobuf(tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512)


@pytest.mark.parametrize("value", [b"abc", b"-1", b"1e3", b"", b"9" * 40, b" 12", b"+5"])
def test_a_malformed_pax_size_record_is_a_corrupt_header_naming_the_shard(tmp_path, value):
    path = tmp_path / "pax.tar"
    image = class_image(0, 0, size=(16, 12))
    path.write_bytes(raw_member("PaxHeader/s0.jpg", pax_record(b"size", value), tarfile.XHDTYPE)
                     + raw_member("s0.jpg", image) + raw_member("s0.cls", b"0") + bytes(1024))
    with pytest.raises(CorruptDataError, match=r"pax\.tar( \[sample s0\])?: bad tar header at byte 0 \(pax size rec"):
        list(iter_tar_shard(path))
    with pytest.raises(InputError, match=r"no packable samples \(1 skipped: damaged tar.*pax size record"):
        scan_source(str(path), fields=SourceFields(label_member="cls"))  # the pack's scan: the tar's only sample


# -- huge members ---------------------------------------------------------------------------------------------------
def sparse_member_tar(path: Path, big_size: int, *, pax: bool) -> None:
    """A tar of sample ``big`` (a jpg member of ``big_size`` zero bytes, sparse on disk, and its .cls) between two
    normal samples. ``pax``: write its header as tarfile's PAX format does (the size in a pax record only, when it
    is 8 GiB or more)."""
    small = _samples(2)
    with open(path, "wb") as handle:
        def member(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            handle.write(info.tobuf(tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512))

        for ext, data in small["s0"].items():
            member(f"s0.{ext}", data)
        info = tarfile.TarInfo("big.jpg")
        info.size = big_size
        handle.write(info.tobuf(tarfile.PAX_FORMAT if pax else tarfile.GNU_FORMAT))
        handle.seek(big_size + -big_size % 512, os.SEEK_CUR)  # a hole: nothing written
        member("big.cls", b"1")
        for ext, data in small["s1"].items():
            member(f"s1.{ext}", data)
        handle.write(bytes(1024))


@pytest.mark.parametrize("big_size, pax", [(3 * GIB, False), (8 * GIB + 1000, True)], ids=["3GiB", "pax-8GiB"])
@pytest.mark.slow
def test_a_huge_member_is_skipped_by_its_declared_size_never_read(tmp_path, big_size, pax):
    path = tmp_path / "huge.tar"
    sparse_member_tar(path, big_size, pax=pax)
    with tarfile.open(path) as archive:  # what tarfile sees: the huge member, then the next sample
        assert [(m.name, m.size) for m in archive.getmembers()][3:5] == [("big.jpg", big_size), ("big.cls", 1)]
    assert len(tar_sample_offsets(path)) == 4  # s0, big, s1 and the end: our reader walks it the same way
    scan = scan_source(str(path), fields=SourceFields(label_member="cls"))
    assert sorted(s.rel_path for s in scan.samples) == ["huge.tar#s0", "huge.tar#s1"]
    assert [(s.rel_path, s.reason.split(":")[0]) for s in scan.skipped] == [("huge.tar#big", "too large")]
    # Packing it reads neither the huge member nor 3 GiB of anything: under a 1.5 GiB address-space limit.
    out = run_bounded("""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))
from preprocess.pack.sources.members import SourceFields
from preprocess.pack.packer import PackConfig, pack_manifest
manifest = pack_manifest(PackConfig(source=sys.argv[1], out=sys.argv[2], quiet=True, val_fraction=0,
                                    source_fields=SourceFields(label_member="cls")))
print(manifest.splits["train"].samples, [s.reason.split(":")[0] for s in manifest.source.skipped])
""", path, tmp_path / "out", timeout=120)
    assert "2 ['too large']" in out.splitlines(), out


# -- many members ---------------------------------------------------------------------------------------------------
def empty_members_tar(path: Path, empty: int, *, same_key: bool = False) -> None:
    """Two whole samples, then ``empty`` empty members (each its own sample without a label, or all one key)."""
    with open(path, "wb") as handle:
        def member(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            handle.write(info.tobuf(tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512))

        for key, members in _samples(2).items():
            for ext, data in members.items():
                member(f"{key}.{ext}", data)
        header = bytearray(tarfile.TarInfo("e0000000.jpg").tobuf(tarfile.USTAR_FORMAT))  # a name field to patch
        for i in range(empty):
            header[:12] = b"e.jpg".ljust(12, b"\0") if same_key else b"e%07d.jpg" % i
            _reseal(header)
            handle.write(header)
        handle.write(bytes(1024))


def _pack_peak(source: Path, out: Path) -> tuple[int, object]:
    tracemalloc.start()
    try:
        manifest = pack_manifest(PackConfig(source=str(source), out=str(out), quiet=True, val_fraction=0,
                                            source_fields=SourceFields(label_member="cls")))
        return tracemalloc.get_traced_memory()[1], manifest
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_a_tar_of_many_empty_members_packs_in_memory_proportional_to_what_it_keeps(tmp_path):
    empty_members_tar(tmp_path / "few.tar", 2_000)
    empty_members_tar(tmp_path / "many.tar", 200_000)
    few, _ = _pack_peak(tmp_path / "few.tar", tmp_path / "few")
    many, manifest = _pack_peak(tmp_path / "many.tar", tmp_path / "many")
    assert manifest.splits["train"].samples == 2
    per_member = (many - few) / 198_000
    assert per_member < 16, f"{per_member:.0f} bytes a skipped member ({few >> 10} KiB, then {many >> 10} KiB)"
    # The skipped samples are counted, and a bounded sample of them named with their reason.
    skipped = manifest.source.skipped
    assert len(skipped) <= 1_001
    assert [s.reason.split(" (")[0] for s in skipped if s.path == "many.tar"] == [
        "not listed one by one: 199,000 more samples skipped in this tar"]
    assert (tmp_path / "many" / "dataset.json").stat().st_size < 1 << 20


def test_a_sample_of_many_members_of_one_key_is_skipped_not_held(tmp_path):
    empty_members_tar(tmp_path / "one.tar", 20_000, same_key=True)
    scan = scan_source(str(tmp_path / "one.tar"), fields=SourceFields(label_member="cls"))
    assert len(scan.samples) == 2
    assert [(s.rel_path, s.reason.split(" (")[0]) for s in scan.skipped] == [("one.tar#e", "duplicate member e.jpg")]
