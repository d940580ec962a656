"""Hostile Parquet files, Arrow IPC streams and ``save_to_disk`` folders given to pack-shards (issue 33, round 3).

Whatever such a source holds, the scan and the packer end in one ``ShardcacheError`` line naming the file (exit 2
from the CLI), never a traceback, an abort inside pyarrow or memory that the file's bytes do not account for:
schema metadata nested deep, JSON files of the wrong shape, corrupt record batch buffers, decompression bombs and
duplicate ``ClassLabel`` names.
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
import pyarrow.ipc  # noqa: E402,F401

from preprocess.pack.sources.parquet import scan_table_source  # noqa: E402
from preprocess.pack.sources.scan import scan_source  # noqa: E402
from shards.errors import InputError, ManifestError  # noqa: E402
from tests.helpers import class_image  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # a regression must fail the test, not hang the suite
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
MIB = 1 << 20


def hf_metadata(features: dict) -> dict:
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def class_label(names) -> dict:
    return {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": list(names)}}


def image_table(rows: int = 4) -> "pa.Table":
    return pa.table({"image": pa.array([{"bytes": class_image(i % 2, i, size=(12, 10)), "path": None}
                                        for i in range(rows)], IMAGE),
                     "label": pa.array([i % 2 for i in range(rows)], pa.int64())})


def arrow_stream(table: "pa.Table", **options) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as writer:
        writer.write_table(table)
    return sink.getvalue()


def save_to_disk_folder(folder: Path, stream: bytes, state: str = "{}") -> Path:
    """A one-split ``save_to_disk`` folder: ``state.json`` and one Arrow IPC stream file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data-00000-of-00001.arrow").write_bytes(stream)
    (folder / "state.json").write_text(state)
    return folder


def run_python(code: str, *, memory_limit: int | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: an abort is a negative return code, not a dead pytest; ``memory_limit``
    caps its address space, so a regression fails the test instead of taking the machine's memory."""
    limit = "" if memory_limit is None else (
        f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory_limit}, {memory_limit}))\n")
    return subprocess.run([sys.executable, "-c", limit + code], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=ROOT)


def pack_cli(source: Path, out: Path, **kwargs) -> subprocess.CompletedProcess:
    code = ("from preprocess.pack.cli import pack_shards_command\n"
            f"pack_shards_command([{str(source)!r}, '-o', {str(out)!r}, '--quiet'])")
    return run_python(code, **kwargs)


def assert_one_error_line(result: subprocess.CompletedProcess, *parts: str, exit_code: int = 2) -> str:
    assert result.returncode == exit_code, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    for part in parts:
        assert part in errors[0], errors[0]
    return errors[0]


# 1. Schema metadata nested deep, or of the wrong shape.

@pytest.mark.slow  # over half a second in the quick loop
def test_huggingface_metadata_nested_100000_deep_is_one_line_exit_2(tmp_path):
    deep = b"[" * 100_000 + b"]" * 100_000
    pq.write_table(image_table().replace_schema_metadata({b"huggingface": deep}), tmp_path / "deep.parquet")
    with pytest.raises(InputError, match=r"deep\.parquet: schema metadata 'huggingface': nested deeper than"):
        scan_source(tmp_path / "deep.parquet")
    assert_one_error_line(pack_cli(tmp_path / "deep.parquet", tmp_path / "out"), "deep.parquet: ", "nested deeper")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("metadata, message", [
    (b"[1, 2]", "schema metadata 'huggingface' is [1, 2]: expected an object"),
    (b"{\"info\": 7}", "schema metadata 'huggingface': info is 7: expected an object"),
    (json.dumps({"info": {"features": class_label([1, 2])}}).encode(),
     "info.features.label.names[0] is 1: expected a string"),
    (json.dumps({"info": {"features": {"label": {"_type": "ClassLabel", "names": "cat"}}}}).encode(),
     "info.features.label.names is 'cat': expected a list"),
])
def test_huggingface_metadata_of_the_wrong_shape_names_file_and_field(tmp_path, metadata, message):
    pq.write_table(image_table().replace_schema_metadata({b"huggingface": metadata}), tmp_path / "x.parquet")
    with pytest.raises(InputError) as caught:
        scan_source(tmp_path / "x.parquet")
    assert str(caught.value).startswith(f"{tmp_path / 'x.parquet'}: ") and message in str(caught.value)


# 2. save_to_disk JSON files that are JSON but not of the expected shape.

@pytest.mark.parametrize("name, text, message", [
    ("dataset_dict.json", "[\"train\"]", "the file is ['train']: expected an object"),
    ("dataset_dict.json", "7", "the file is 7: expected an object"),
    ("dataset_dict.json", "\"train\"", "the file is 'train': expected an object"),
    ("dataset_dict.json", "{\"splits\": \"train\"}", "splits is 'train': expected a list"),
    ("dataset_dict.json", "{}", "splits is missing"),
    ("state.json", "[]", "the file is []: expected an object"),
    ("state.json", "{\"_data_files\": \"data-00000-of-00001.arrow\"}", "_data_files is 'data-00000-of-00001.arrow'"),
    ("state.json", "{\"_data_files\": [7]}", "_data_files[0] is 7: expected an object"),
    ("state.json", "{\"_data_files\": [{\"filename\": 7}]}", "_data_files[0].filename is 7: expected a string"),
    ("dataset_info.json", "[]", "the file is []: expected an object"),
    ("dataset_info.json", "{\"features\": [1]}", "features is [1]: expected an object"),
    ("dataset_info.json", "{\"features\": {\"label\": {\"names\": [\"a\", null]}}}",
     "features.label.names[1] is None: expected a string"),
])
def test_save_to_disk_json_of_the_wrong_shape_is_one_error_naming_file_and_field(tmp_path, name, text, message):
    root = tmp_path / "hf"
    split = save_to_disk_folder(root / "train" if name == "dataset_dict.json" else root,
                                arrow_stream(image_table()))
    if name == "dataset_dict.json":
        (split / "state.json").unlink()
    (root / name).write_text(text)
    with pytest.raises(ManifestError) as caught:
        scan_source(root)
    assert str(caught.value).startswith(f"{root / name}: ") and message in str(caught.value), str(caught.value)


@pytest.mark.slow  # over half a second in the quick loop
def test_a_state_json_that_is_a_list_is_exit_2_through_the_cli(tmp_path):
    root = save_to_disk_folder(tmp_path / "hf", arrow_stream(image_table()), state="[1, 2, 3]")
    assert_one_error_line(pack_cli(root, tmp_path / "out"), "state.json: the file is [1, 2, 3]: expected an object")


# 3. Record batches with corrupt buffers or absurd declared lengths: validated before use, never an abort.

def _corrupt_offsets(stream: bytes, value: int) -> bytes:
    """The stream with the 4th offset of the image bytes column set to ``value``."""
    cells = [bytes([i]) * 100 for i in range(7)]
    at = stream.index(struct.pack("<4i", 0, 100, 200, 300))
    assert all(cell in stream for cell in cells)
    return stream[:at + 12] + struct.pack("<i", value) + stream[at + 16:]


def _absurd_lengths(stream: bytes, rows: int) -> bytes:
    """The stream with every int64 equal to ``rows`` in the record batch's metadata (its length and its field
    nodes' lengths) set to 2**40."""
    start = stream.index(b"\xff\xff\xff\xff", 8)  # the second message: the record batch
    (meta_len,) = struct.unpack_from("<i", stream, start + 4)
    meta = stream[start + 8:start + 8 + meta_len].replace(struct.pack("<q", rows), struct.pack("<q", 1 << 40))
    return stream[:start + 8] + meta + stream[start + 8 + meta_len:]


@pytest.mark.parametrize("case", ["offset past the buffer", "negative offset", "offsets going back",
                                  "absurd declared lengths"])
@pytest.mark.slow
def test_a_corrupt_record_batch_is_one_line_never_an_abort(tmp_path, case):
    rows = 7
    table = pa.table({"image": pa.array([{"bytes": bytes([i]) * 100, "path": None} for i in range(rows)], IMAGE),
                      "label": pa.array([i % 2 for i in range(rows)], pa.int64())})
    stream = arrow_stream(table)
    stream = {"offset past the buffer": lambda: _corrupt_offsets(stream, 0x7FFFFF00),
              "negative offset": lambda: _corrupt_offsets(stream, -5000),
              "offsets going back": lambda: _corrupt_offsets(stream, 10),
              "absurd declared lengths": lambda: _absurd_lengths(stream, rows)}[case]()
    root = save_to_disk_folder(tmp_path / "hf", stream)
    result = pack_cli(root, tmp_path / "out")
    assert result.returncode >= 0, f"killed by signal {-result.returncode}: {result.stderr[-2000:]}"
    assert_one_error_line(result, "data-00000-of-00001.arrow: ")


# 4. Decompression bombs: a row group's size and each cell bounded before decoding.

# The peak is the process's own high-water mark (VmHWM): ``ru_maxrss`` survives ``exec`` and would report pytest's.
PEAK_CODE = """
import pyarrow as pa
from preprocess.pack.sources.scan import scan_source
from shards.errors import ShardcacheError
try:
    scan = scan_source({source!r})
    print("packed", len(scan.samples))
except ShardcacheError as exc:
    print("error", exc)
status = open("/proc/self/status").read()
print("peak", int(status.split("VmHWM:")[1].split()[0]) * 1024, pa.default_memory_pool().max_memory())
"""


def scan_peak(source: Path) -> tuple[str, int]:
    """What scanning ``source`` in a fresh interpreter printed, and its peak resident memory in bytes. The
    address space is capped at 2 GiB: a bomb that gets decoded fails there rather than take the machine."""
    result = run_python(PEAK_CODE.format(source=str(source)), memory_limit=2 << 30)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    peak_rss, peak_arrow = map(int, lines[-1].split()[1:])
    return "\n".join(lines[:-1]), max(peak_rss, peak_arrow)


@pytest.mark.slow
def test_a_dictionary_encoded_bomb_is_refused_without_decoding_it(tmp_path):
    # One 50 MiB cell stored once in the dictionary and indexed by 100 rows: a 3 KB file that decodes to 5 GB.
    cell = pa.array([bytes(50 * MIB)], pa.binary())
    images = pa.DictionaryArray.from_arrays(pa.array([0] * 100, pa.int32()), cell)
    table = pa.table({"image": images, "label": pa.array([0] * 100, pa.int64())})
    # store_schema=False: the file says ``binary``, as a hostile writer would; the bytes are dictionary-encoded.
    pq.write_table(table, tmp_path / "bomb.parquet", compression="zstd", store_schema=False)
    assert (tmp_path / "bomb.parquet").stat().st_size < 15_000
    said, peak = scan_peak(tmp_path / "bomb.parquet")
    assert said.startswith("error ") and "bomb.parquet: row group 0" in said and "--max-bytes" in said, said
    assert peak < 600 * MIB, f"peak memory {peak >> 20} MiB for a file of a few KB"


@pytest.mark.slow
def test_a_highly_compressed_row_group_is_refused_by_its_declared_size_before_decoding(tmp_path):
    # 12 cells of 32 MiB of zeros (384 MiB), plain-encoded and zstd-compressed: a file of a few KB.
    zeros = pa.py_buffer(bytes(12 * 32 * MIB))  # calloc'd: compressing it does not make it resident
    offsets = pa.array([i * 32 * MIB for i in range(13)], pa.int32()).buffers()[1]
    images = pa.Array.from_buffers(pa.binary(), 12, [None, offsets, zeros])
    table = pa.table({"image": images, "label": pa.array([0] * 12, pa.int64())})
    pq.write_table(table, tmp_path / "zeros.parquet", compression="zstd", use_dictionary=False)
    assert (tmp_path / "zeros.parquet").stat().st_size < 100_000
    said, peak = scan_peak(tmp_path / "zeros.parquet")
    assert said.startswith("error ") and "zeros.parquet: row group 0" in said and "--max-bytes" in said, said
    assert peak < 300 * MIB, f"peak memory {peak >> 20} MiB: the row group was decoded"


@pytest.mark.slow  # over half a second in the quick loop
def test_a_compressed_arrow_stream_is_refused_before_decompressing(tmp_path):
    zeros = pa.py_buffer(bytes(12 * 32 * MIB))
    offsets = pa.array([i * 32 * MIB for i in range(13)], pa.int32()).buffers()[1]
    images = pa.Array.from_buffers(pa.binary(), 12, [None, offsets, zeros])
    stream = arrow_stream(pa.table({"image": images, "label": pa.array([0] * 12, pa.int64())}), compression="zstd")
    root = save_to_disk_folder(tmp_path / "hf", stream)
    assert len(stream) < 100_000
    said, peak = scan_peak(root)
    assert said.startswith("error ") and "data-00000-of-00001.arrow: record batch 0" in said, said
    assert peak < 300 * MIB, f"peak memory {peak >> 20} MiB: the batch was decompressed"


def test_row_groups_and_cells_are_bounded_by_max_bytes(tmp_path):
    cells = [bytes([i]) * 300_000 for i in range(6)]
    table = pa.table({"image": pa.array(cells, pa.binary()), "label": pa.array([0] * 6, pa.int64())})
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=3, compression="none")
    with pytest.raises(InputError, match=r"x\.parquet: row group 0 .*more than --max-bytes \(800\.0 KiB\)"):
        scan_table_source(tmp_path / "x.parquet", "parquet", "image", "label", max_bytes=800 << 10)
    classes, samples, skipped, _ = scan_table_source(tmp_path / "x.parquet", "parquet", "image", "label",
                                                     max_bytes=1 << 20)
    assert len(samples) == 6 and not skipped


def test_pack_shards_max_bytes_reaches_the_container_scans(tmp_path):
    """The limit a row group is judged by is the command's own ``--max-bytes``, not a default beside it."""
    from click.testing import CliRunner

    from preprocess.pack.cli import pack_shards_command

    cells = [bytes([i]) * 300_000 for i in range(6)]
    table = pa.table({"image": pa.array(cells, pa.binary()), "label": pa.array([0] * 6, pa.int64())})
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=3, compression="none")
    result = CliRunner().invoke(pack_shards_command, [str(tmp_path / "x.parquet"), "-o", str(tmp_path / "out"),
                                                      "--max-bytes", "800K", "--quiet"])
    assert result.exit_code == 2 and "more than --max-bytes (800.0 KiB)" in result.output, result.output


def test_a_normal_file_scans_as_before(tmp_path):
    table = image_table(6).replace_schema_metadata(hf_metadata(class_label(["b", "a"])))
    pq.write_table(table, tmp_path / "ok.parquet", row_group_size=2)
    scan = scan_source(tmp_path / "ok.parquet")
    assert scan.classes == ("a", "b") and len(scan.samples) == 6 and not scan.skipped
    assert scan.members.container == "parquet"


# 5. Duplicate ClassLabel names.

@pytest.mark.parametrize("where", ["schema", "dataset_info.json"])
def test_duplicate_classlabel_names_are_an_error_not_a_merge(tmp_path, where):
    names = ["cat", "dog", "cat"]
    if where == "schema":
        table = image_table().replace_schema_metadata(hf_metadata(class_label(names)))
        pq.write_table(table, tmp_path / "dup.parquet")
        source, named = tmp_path / "dup.parquet", tmp_path / "dup.parquet"
    else:
        source = save_to_disk_folder(tmp_path / "hf", arrow_stream(image_table()))
        (source / "dataset_info.json").write_text(json.dumps({"features": class_label(names)}))
        named = source / "dataset_info.json"
    with pytest.raises(InputError) as caught:
        scan_source(source)
    assert str(caught.value).startswith(f"{named}: ") and "ClassLabel name 'cat' appears twice" in str(caught.value)


# 6. Whatever pyarrow raises on a hostile file is one error naming it.

def test_a_column_name_that_is_not_utf8_is_one_error(tmp_path):
    stream = arrow_stream(image_table().rename_columns(["image", "labex"]))
    root = save_to_disk_folder(tmp_path / "hf", stream.replace(b"labex", b"lab\xffx"))
    with pytest.raises(InputError, match=r"data-00000-of-00001\.arrow: not a readable Arrow IPC stream file "
                                         r"\(UnicodeDecodeError: "):
        scan_source(root)


@pytest.mark.slow  # over half a second in the quick loop
def test_two_columns_of_one_name_are_one_error_exit_2(tmp_path):
    table = image_table()
    table = pa.Table.from_arrays([*table.columns, table.column("label")], names=["image", "label", "label"])
    pq.write_table(table, tmp_path / "twice.parquet")
    result = pack_cli(tmp_path / "twice.parquet", tmp_path / "out")
    assert_one_error_line(result, "twice.parquet: column 'label' appears twice")
