"""Where the writers may write, and what ``--overwrite`` may delete, tried from the command line as a user would.

- A run folder is local: ``train-from-shards --out`` with any URL is one line and exit 2, naming the fix, and no
  ``./s3:/b/p`` folder appears.
- ``--overwrite`` removes only what the output being replaced names (its manifest, what that lists, the stage's own
  records), never a user's file that merely looks like ours; a file it would have to write over is refused first.
  The same for ``pack-shards --table``, which without ``--overwrite`` deletes and replaces nothing (a killed run of
  the same table is resumed), and for publishing to ``s3://``, where only what the old remote manifest names is
  deleted and an object no publish wrote is never replaced.
- ``shards report --out`` never replaces a manifest, a run's files or a page of the user's own.
- ``pack-shards --out`` inside the source folder is refused before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from preprocess.features.cli import precompute_features_command
from preprocess.pack.cli import pack_shards_command
from shards.cli.main import main as shards_command
from shards.errors import InputError
from tests.helpers import make_shard_dataset, write_image_folder
from tests.s3.conftest import bucket, s3_env, s3_server  # noqa: F401 (the s3 tests' server and bucket, here too)
from train.cli import train_command
from tests.train.configs import train_config


def invoke(command, *args) -> object:
    return CliRunner().invoke(command, [str(a) for a in args])


def one_error_line(result) -> str:
    """The single ``error:`` line of a refused command (exit 2, nothing on stdout)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_image_folder(tmp_path / "src", ["cat", "dog"], 3, size=(24, 16))


def pack(source: Path, out: Path, *options) -> object:
    return invoke(pack_shards_command, source, "--out", out, "--quiet", *options)


# -- 1. a run folder is local -------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["s3://b/p", "gs://b/p", "http://host/p", "file:///tmp/p", "pipe:cat > x"])
def test_train_out_url_is_one_line_naming_the_fix(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(invoke(train_command, tmp_path / "features", "--out", url, "--device", "cpu", "-q"))
    assert url in line and "not supported" in line and "local" in line and "then copy" in line
    assert list(tmp_path.iterdir()) == []  # no ./s3:/b/p, nothing at all
    with pytest.raises(InputError, match="then copy"):
        train_config(str(tmp_path), url)


# -- 2. --overwrite removes only what the replaced output names ---------------------------------------------------
def test_pack_overwrite_keeps_a_users_shard_lookalikes(src, tmp_path):
    out = tmp_path / "out"
    assert pack(src, out, "--shard-samples", "2").exit_code == 0
    old_shards = {p.name for p in out.glob("train-*.tar")}
    assert old_shards == {"train-000000.tar", "train-000001.tar", "train-000002.tar"}
    mine = {"train-000099.tar": b"my own tar", "train-000099.tar.idx": b"its index",
            "source-index-0042.jsonl": b"{}\n", "dataset.json.bak": b"a copy", "x.tar.node1.1.0badc0de.tmp": b"x"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    result = pack(src, out, "--shard-samples", "6", "--overwrite")
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.glob("train-*.tar")} == {"train-000000.tar", "train-000099.tar"}  # 1, 2 removed
    assert all((out / name).read_bytes() == data for name, data in mine.items())
    manifest = json.loads((out / "dataset.json").read_text())
    assert [s["path"] for s in manifest["splits"]["train"]["shards"]] == ["train-000000.tar"]


def test_pack_overwrite_refuses_to_write_over_a_file_nothing_there_names(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-000000.tar").write_bytes(b"a tar of my own, no dataset.json beside it")
    (out / "notes.txt").write_text("mine")
    before = listing(out)
    line = one_error_line(pack(src, out, "--overwrite"))
    assert "train-000000.tar" in line and "move them away" in line
    assert listing(out) == before and not (out / ".pack").exists()  # refused before even a lock file


def test_pack_overwrite_never_follows_names_out_of_the_folder(src, tmp_path):
    out = tmp_path / "out"
    assert pack(src, out).exit_code == 0
    victim = tmp_path / "victim.tar"
    victim.write_bytes(b"outside OUT")
    (out / "sub").mkdir()
    (out / "sub" / "train-000000.tar").write_bytes(b"in a subfolder")
    plan = json.loads((out / ".pack" / "plan.json").read_text())
    plan["shards"] += [{"name": "../victim.tar", "split": "train"}, {"name": "sub/train-000000.tar", "split": "train"}]
    (out / ".pack" / "plan.json").write_text(json.dumps(plan))
    assert pack(src, out, "--shard-samples", "2", "--overwrite").exit_code == 0
    assert victim.read_bytes() == b"outside OUT" and (out / "sub" / "train-000000.tar").is_file()


@pytest.mark.slow  # two featurize runs through the CLI
def test_precompute_overwrite_keeps_a_users_feature_lookalikes(tmp_path):
    data = tmp_path / "data"
    make_shard_dataset(data, shard_sizes={"train": [3, 2]})
    out = tmp_path / "feat"
    options = ["--backbone", "resnet18", "--weights", "none", "--resize", "40", "--crop", "32", "--batch-size", "4",
               "--workers", "0", "--device", "cpu", "-q"]
    assert invoke(precompute_features_command, data, "--out", out, *options).exit_code == 0
    (out / "train-000099.pt").write_bytes(b"my own features")
    (out / "notes.txt").write_text("mine")
    result = invoke(precompute_features_command, data, "--out", out, *options, "--dtype", "float32", "--overwrite")
    assert result.exit_code == 0, result.output
    assert (out / "train-000099.pt").read_bytes() == b"my own features" and (out / "notes.txt").is_file()
    assert json.loads((out / "features.json").read_text())["dtype"] == "float32"
    # A folder that holds no features but a file the run would write: refused, untouched.
    other = tmp_path / "other"
    other.mkdir()
    (other / "train-000001.pt").write_bytes(b"mine")
    line = one_error_line(invoke(precompute_features_command, data, "--out", other, *options, "--overwrite"))
    assert "train-000001.pt" in line and listing(other) == {"train-000001.pt": b"mine"}


@pytest.mark.slow
def test_train_overwrite_replaces_a_run_but_never_a_users_model(tmp_path):
    from tests.train.conftest import write_feature_folder

    features = write_feature_folder(tmp_path / "cache", shard_sizes={"train": [40], "val": [20]}, classes=("a", "b"))
    base = [features, "--epochs", "1", "--batch-size", "8", "--device", "cpu", "--no-report", "-q"]
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"a model of my own")
    line = one_error_line(invoke(train_command, *base, "--out", folder, "--overwrite"))
    assert "model.pt" in line and (folder / "model.pt").read_bytes() == b"a model of my own"
    run = tmp_path / "run"
    assert invoke(train_command, *base, "--out", run).exit_code == 0
    (run / "notes.txt").write_text("mine")
    assert invoke(train_command, *base, "--out", run, "--lr", "0.5", "--overwrite").exit_code == 0
    assert (run / "notes.txt").read_text() == "mine"
    assert json.loads((run / "config.json").read_text())["optim"]["lr"] == 0.5


# -- 3. shards report --out never replaces an artifact ------------------------------------------------------------
def test_report_out_refuses_manifests_run_files_and_pages_of_your_own(src, tmp_path):
    data = tmp_path / "data"
    assert pack(src, data).exit_code == 0
    manifest = (data / "dataset.json").read_bytes()
    for target in (data / "dataset.json", data / "train-000000.tar", data / ".pack" / "plan.json",
                   tmp_path / "run" / "config.json", tmp_path / "run" / "metrics.jsonl", tmp_path / "new.json"):
        line = one_error_line(invoke(shards_command, "report", data, "--out", target, "--no-grid"))
        assert ".html" in line and target.name in line
    assert (data / "dataset.json").read_bytes() == manifest and not (tmp_path / "run").exists()
    page = tmp_path / "index.html"
    page.write_text("<html><body>my own page</body></html>")
    line = one_error_line(invoke(shards_command, "report", data, "--out", page, "--no-grid"))
    assert "not a shardcache report" in line and page.read_text() == "<html><body>my own page</body></html>"
    (data / "report.html").write_text("<html>my notes on this dataset</html>")  # the default --out, not ours
    one_error_line(invoke(shards_command, "report", data, "--no-grid"))
    (data / "report.html").unlink()
    for _ in range(2):  # a report it wrote is replaced, again and again
        assert invoke(shards_command, "report", data, "--no-grid", "-q").exit_code == 0


# -- 4. --out inside the source folder ----------------------------------------------------------------------------
@pytest.mark.parametrize("inside", [".", "shards", "cat/shards"])
def test_pack_out_inside_the_source_is_refused_up_front(src, inside):
    before = listing(src)
    out = (src / inside).resolve()
    line = one_error_line(pack(src, out))
    assert "source folder" in line and str(out) in line
    assert listing(src) == before and (inside == "." or not out.exists())


def test_pack_out_in_a_hidden_folder_of_the_source_or_beside_a_list_is_fine(src, tmp_path):
    hidden = src / ".shards"  # never scanned: packing it twice works
    assert pack(src, hidden).exit_code == 0 and pack(src, hidden).exit_code == 0
    listed = tmp_path / "list.csv"
    listed.write_text("path,label\nsrc/cat/img_0000.jpg,cat\nsrc/dog/img_0000.jpg,dog\n")
    assert pack(listed, tmp_path / "out").exit_code == 0  # a list scans no folder


# -- 5. pack-shards --table: the same rule as image packing -------------------------------------------------------
@pytest.fixture
def table_csv(tmp_path: Path) -> Path:
    rows = "".join(f"{i % 7}.5,{(i * 3) % 11}.25,{'ab'[i % 2]}\n" for i in range(40))
    path = tmp_path / "table.csv"
    path.write_text("x1,x2,label\n" + rows)
    return path


def pack_table(source: Path, out: Path, *options) -> object:
    return invoke(pack_shards_command, source, "--table", "--target", "label", "--out", out, "--quiet", *options)


def test_table_keeps_a_users_shard_lookalike_without_and_with_overwrite(table_csv, tmp_path):
    out = tmp_path / "feat"
    out.mkdir()
    (out / "train-000007.pt").write_bytes(b"my own features")
    before = listing(out)
    line = one_error_line(pack_table(table_csv, out))  # once deleted unasked: every entry looked like ours
    assert "--overwrite" in line and listing(out) == before and not (out / ".pack").exists()
    result = pack_table(table_csv, out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert (out / "train-000007.pt").read_bytes() == b"my own features"
    assert {p.name for p in out.glob("*.pt")} == {"train-000000.pt", "val-000000.pt", "train-000007.pt"}
    # Replacing our own output removes what its features.json names, and the lookalike still stays.
    (out / "notes.txt").write_text("mine")
    assert pack_table(table_csv, out, "--shard-samples", "10", "--overwrite").exit_code == 0
    assert {p.name for p in out.glob("*.pt")} == {"train-000000.pt", "train-000001.pt", "train-000002.pt",
                                                  "train-000003.pt", "val-000000.pt", "train-000007.pt"}
    assert (out / "train-000007.pt").read_bytes() == b"my own features" and (out / "notes.txt").read_text() == "mine"
    # A run that would write train-000007.pt itself is refused, even with --overwrite: nothing there names it.
    for options in ((), ("--overwrite",)):
        before = listing(out)
        line = one_error_line(pack_table(table_csv, out, "--shard-samples", "4", *options))
        assert listing(out) == before
    assert "train-000007.pt" in line and "move them away" in line


def test_table_resumes_its_own_killed_run_and_overwrites_only_its_files(table_csv, tmp_path, monkeypatch):
    import shards.formats.features as features_module
    from preprocess.pack.table.pack import pack_table as pack_table_api
    from preprocess.pack.table.config import TableConfig

    out = tmp_path / "feat"
    real = features_module.write_feature_shard
    written: list[str] = []

    def dies_after_one(path, shard, storage):
        if written:
            raise KeyboardInterrupt  # the job is killed after its first shard
        written.append(Path(path).name)
        return real(path, shard, storage)

    monkeypatch.setattr(features_module, "write_feature_shard", dies_after_one)
    with pytest.raises(KeyboardInterrupt):
        pack_table_api(TableConfig(source=str(table_csv), out=str(out), target="label", max_samples=10))
    monkeypatch.undo()
    assert not (out / "features.json").exists() and (out / written[0]).is_file()
    (out / "train-000099.pt").write_bytes(b"mine")
    # Another config may not touch the killed run's files without --overwrite ...
    before = listing(out)
    assert "--overwrite" in one_error_line(pack_table(table_csv, out, "--seed", "3"))
    assert listing(out) == before
    # ... the same config resumes it ...
    assert pack_table(table_csv, out, "--shard-samples", "10").exit_code == 0
    assert json.loads((out / "features.json").read_text())["config"]["max_samples"] == 10
    # ... and --overwrite removes what the records and features.json name, never the lookalike.
    assert pack_table(table_csv, out, "--seed", "3", "--overwrite").exit_code == 0
    assert {p.name for p in out.glob("*.pt")} == {"train-000000.pt", "val-000000.pt", "train-000099.pt"}
    assert (out / "train-000099.pt").read_bytes() == b"mine"


# -- 6. publishing to s3:// deletes only what the old remote manifest names ---------------------------------------
def objects(bucket, folder: str) -> dict[str, bytes]:  # noqa: F811
    listed = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=f"{bucket.prefix}/{folder}/")
    return {item["Key"].rsplit("/", 1)[-1]: bucket.client.get_object(Bucket=bucket.name, Key=item["Key"])["Body"]
            .read() for item in listed.get("Contents", [])}


@pytest.mark.s3
@pytest.mark.slow
def test_s3_overwrite_deletes_only_what_the_old_manifest_names(src, bucket, tmp_path):  # noqa: F811
    assert pack(src, bucket.url("ds"), "--stage-dir", tmp_path / "stage", "--shard-samples", "2").exit_code == 0
    old = json.loads(objects(bucket, "ds")["dataset.json"])
    assert [s["path"] for s in old["splits"]["train"]["shards"]] == ["train-000000.tar", "train-000001.tar",
                                                                    "train-000002.tar"]
    mine = {"train-000099.tar": b"my own tar", "train-000099.tar.idx": b"its index",
            "source-index-0042.jsonl": b"{}\n"}
    for name, data in mine.items():
        bucket.put(f"ds/{name}", data)
    result = pack(src, bucket.url("ds"), "--stage-dir", tmp_path / "stage2", "--shard-samples", "6", "--overwrite")
    assert result.exit_code == 0, result.output
    after = objects(bucket, "ds")
    assert not {"train-000001.tar", "train-000002.tar", "train-000001.tar.idx"} & set(after)  # the old dataset's
    assert all(after[name] == data for name, data in mine.items())  # merely named like ours: kept
    assert json.loads(after["dataset.json"])["packing"]["max_samples"] == 6


@pytest.mark.s3
@pytest.mark.slow
def test_s3_publish_never_replaces_an_object_of_the_users(src, bucket, tmp_path):  # noqa: F811
    bucket.put("ds/train-000000.tar", b"a tar of my own, no manifest beside it")
    for options in ((), ("--overwrite",)):
        line = one_error_line(pack(src, bucket.url("ds"), "--stage-dir", tmp_path / "stage", *options))
        assert "train-000000.tar" in line and "move them away" in line
        assert objects(bucket, "ds") == {"train-000000.tar": b"a tar of my own, no manifest beside it"}
