"""A downloaded dataset is untrusted: its manifests name shards, they never choose commands, hosts or outside files.

Written as an attacker would: each test edits a valid ``dataset.json`` / ``features.json`` the way a malicious
download could, then checks the library, ``shards verify`` and ``train-from-shards --dry-run`` refuse it with one
line naming the manifest and the bad path, before anything is run or read.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import shards
from shards.check.features_verify import verify_feature_folder
from shards.check.verify import verify_dataset
from shards.cli.main import main as shards_cli
from shards.errors import ManifestError
from shards.door.locations import check_shard_path, shard_location
from shards.manifest import load_dataset_manifest, load_feature_manifest, load_manifest
from tests.helpers import make_shard_dataset, serve_folder
from tests.shards.stream_helpers import write_feature_dataset
from train.cli import train_command


def poison(folder: Path, path: str, *, index: int = 0, manifest: str = "dataset.json", **fields) -> Path:
    """Rewrite shard ``index`` of the train split to ``path`` (and any other shard fields given)."""
    file = folder / manifest
    data = json.loads(file.read_text())
    data["splits"]["train"]["shards"][index].update(path=path, **fields)
    file.write_text(json.dumps(data))
    return file


def one_line_error(result, exit_code: int, *fragments: str) -> str:
    assert result.exit_code == exit_code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def verify_cli(*args):
    return CliRunner().invoke(shards_cli, ["verify", *map(str, args)])


def dry_run_cli(data: Path, out: Path):
    return CliRunner().invoke(train_command, [str(data), "--out", str(out), "--dry-run", "--quiet", "--device",
                                              "cpu", "--batch-size", "2"])


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    make_shard_dataset(folder, shard_sizes={"train": [3, 3], "val": [2]}, size=(16, 16))
    return folder


# -- pipe: and other schemes --------------------------------------------------------------------------------------
def test_a_pipe_command_in_the_manifest_is_never_run(dataset: Path, tmp_path: Path):
    pwned = tmp_path / "PWNED"
    poison(dataset, f"pipe:touch {pwned}; cat {dataset / 'train-000000.tar'}")
    with pytest.raises(ManifestError, match=r"dataset\.json: shard path 'pipe:touch") as caught:
        list(shards.open_dataset(dataset, sampling=shards.Sampling(shuffle=False)))
    assert "\n" not in str(caught.value)
    one_line_error(verify_cli(dataset), 2, "dataset.json", "pipe:touch")
    one_line_error(dry_run_cli(dataset, tmp_path / "run"), 2, "dataset.json", "pipe:touch")
    with pytest.raises(ManifestError):
        load_manifest(dataset, url_origins=["http://127.0.0.1:1"])  # no opt-in ever makes pipe: acceptable
    assert not pwned.exists()


@pytest.mark.parametrize("name", [
    "pipe:cat x.tar", "file:///etc/passwd", "s3://bucket/x.tar", "gs://bucket/x.tar", "C:x.tar",
    "http://127.0.0.1:1/x.tar",
])
def test_schemes_in_a_local_manifest_are_refused(dataset: Path, name: str):
    poison(dataset, name)
    with pytest.raises(ManifestError, match=r"dataset\.json: shard path"):
        shards.open_dataset(dataset)


def test_the_caller_may_still_choose_pipe(dataset: Path, tmp_path: Path):
    opened = shards.open_dataset(dataset, sampling=shards.Sampling(shuffle=False))
    marker = tmp_path / "ran"
    opened.locations = [f"pipe:touch {marker}; cat {location}" for location in opened.locations]
    assert len(list(opened)) == 6 and marker.exists()


# -- paths that leave the folder ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, why", [
    ("../outside/x.tar", "'..' part"),
    ("sub/../../outside/x.tar", "'..' part"),
    ("/etc/passwd", "is absolute"),
    ("./train-000000.tar", "'.' or '..' part"),
    ("sub//x.tar", "empty"),
    ("..\\outside\\x.tar", "backslash"),
    ("train\x00.tar", "control characters"),
    ("train\n.tar", "control characters"),
    ("", "1 to 1024 characters"),
])
def test_paths_outside_the_folder_are_refused_at_load(dataset: Path, tmp_path: Path, name: str, why: str):
    (tmp_path / "outside").mkdir()
    shutil.copy(dataset / "train-000000.tar", tmp_path / "outside" / "x.tar")  # readable, if it were followed
    manifest = poison(dataset, name)
    with pytest.raises(ManifestError, match=re.escape(why)) as caught:
        load_dataset_manifest(dataset)
    message = str(caught.value)
    assert message.startswith(f"{manifest}: shard path {name!r}") and "\n" not in message
    one_line_error(verify_cli(dataset), 2, str(manifest), why)
    one_line_error(dry_run_cli(dataset, tmp_path / "run"), 2, str(manifest))
    with pytest.raises(ManifestError):
        shards.open_dataset(dataset)


def test_etc_passwd_is_a_manifest_error_not_a_raw_value_error(dataset: Path):
    poison(dataset, "/etc/passwd")
    with pytest.raises(ManifestError, match="is absolute"):
        list(shards.open_dataset(dataset))
    with pytest.raises(ManifestError):
        verify_dataset(dataset)


def test_shard_names_in_subfolders_are_fine():
    assert check_shard_path("train/part-0/000001.tar") == "train/part-0/000001.tar"


# -- symlinks -----------------------------------------------------------------------------------------------------
def symlink_out(dataset: Path, tmp_path: Path) -> Path:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(dataset / "train-000000.tar", outside / "x.tar")
    (dataset / "train-000000.tar").symlink_to(outside / "x.tar")
    return outside / "x.tar"


def test_a_shard_symlinked_outside_the_folder_is_refused(dataset: Path, tmp_path: Path):
    target = symlink_out(dataset, tmp_path)
    with pytest.raises(ManifestError, match="outside the dataset folder") as caught:
        shards.open_dataset(dataset)
    assert str(target) in str(caught.value) and "hard-link" in str(caught.value)
    report = verify_dataset(dataset)
    assert not report.ok and any("train-000000.tar" in p and "outside the dataset folder" in p
                                 for p in report.problems)
    assert report.samples_read == 5  # the other train shard and val: the symlinked one was never opened
    one_line_error(dry_run_cli(dataset, tmp_path / "run"), 2, "train-000000.tar", "outside the dataset folder")
    result = CliRunner().invoke(shards_cli, ["inspect", str(dataset), "--batch", "--split", "train", "--quiet"])
    one_line_error(result, 2, "outside the dataset folder")


def test_precompute_features_refuses_a_symlink_out(dataset: Path, tmp_path: Path):
    from preprocess.features.loader import shard_jobs

    symlink_out(dataset, tmp_path)
    with pytest.raises(ManifestError, match="outside the dataset folder"):
        shard_jobs(load_dataset_manifest(dataset), dataset, None)


def test_symlinks_inside_the_folder_and_a_symlinked_folder_are_fine(dataset: Path, tmp_path: Path):
    (dataset / "store").mkdir()
    shutil.move(dataset / "train-000000.tar", dataset / "store" / "train-000000.tar")
    (dataset / "train-000000.tar").symlink_to(Path("store") / "train-000000.tar")
    (tmp_path / "link").symlink_to(dataset)
    assert len(list(shards.open_dataset(tmp_path / "link", sampling=shards.Sampling(shuffle=False)))) == 6
    assert verify_dataset(tmp_path / "link").ok


# -- URLs in a remote manifest ------------------------------------------------------------------------------------
@pytest.fixture
def served(tmp_path: Path):
    folder = tmp_path / "served"
    make_shard_dataset(folder, shard_sizes={"train": [3, 3]}, size=(16, 16))
    with serve_folder(folder) as url:
        yield folder, int(url.rsplit(":", 1)[1])


def test_a_remote_manifest_may_name_shards_on_its_own_host_only(served):
    folder, port = served
    url = f"http://127.0.0.1:{port}"
    poison(folder, f"{url}/train-000000.tar")
    keys = [key for _, _, key in shards.open_dataset(url, return_keys=True, sampling=shards.Sampling(shuffle=False))]
    assert keys == [f"train_{i:05d}" for i in range(6)]

    poison(folder, f"http://localhost:{port}/train-000000.tar")  # the same server, but another origin
    with pytest.raises(ManifestError, match=r"dataset\.json: shard path .*not on the manifest's own origin"):
        shards.open_dataset(url)
    poison(folder, f"https://127.0.0.1:{port}/train-000000.tar")  # another scheme
    with pytest.raises(ManifestError, match="origin"):
        shards.open_dataset(url)


def test_another_origin_only_with_the_callers_opt_in(served):
    folder, port = served
    poison(folder, f"http://localhost:{port}/train-000000.tar")
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ManifestError, match="origin"):
        shards.open_dataset(url)
    allowed = shards.open_dataset(url, return_keys=True,
                                  remote=shards.Remote(url_origins=(f"http://localhost:{port}",)),
                                  sampling=shards.Sampling(shuffle=False))
    assert [key for _, _, key in allowed] == [f"train_{i:05d}" for i in range(6)]


def test_a_remote_manifest_cannot_name_a_pipe_or_leave_its_base(served, tmp_path: Path):
    folder, port = served
    pwned = tmp_path / "PWNED"
    poison(folder, f"pipe:touch {pwned}")
    with pytest.raises(ManifestError, match="pipe:touch"):
        list(shards.open_dataset(f"http://127.0.0.1:{port}/"))
    poison(folder, "../secret.tar")
    with pytest.raises(ManifestError, match=r"'\.\.' part"):
        shards.open_dataset(f"http://127.0.0.1:{port}/")
    assert not pwned.exists()


def test_remote_names_are_quoted_into_the_base_url():
    assert shard_location("http://h/data/", "a?b#c.tar") == "http://h/data/a%3Fb%23c.tar"
    with pytest.raises(ManifestError, match="pipe:"):
        shard_location("pipe:cat ", "train-000000.tar")


# -- features.json ------------------------------------------------------------------------------------------------
@pytest.fixture
def features(tmp_path: Path) -> Path:
    folder = tmp_path / "feats"
    write_feature_dataset(folder, [3, 2])
    return folder


@pytest.mark.parametrize("field, value, why", [
    ("path", "../data/x.pt", "'..' part"),
    ("path", "/etc/passwd", "is absolute"),
    ("path", "pipe:cat x.pt", "not a relative file name"),
    ("source", "../../etc/passwd", "'..' part"),
    ("source", "pipe:touch x", "not a relative file name"),
])
def test_bad_paths_in_features_json_are_refused(features: Path, tmp_path: Path, field: str, value: str, why: str):
    file = features / "features.json"
    data = json.loads(file.read_text())
    data["splits"]["train"]["shards"][0][field] = value
    file.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=re.escape(why)) as caught:
        load_feature_manifest(features)
    assert str(caught.value).startswith(f"{file}: shard path {value!r}")
    one_line_error(verify_cli(features), 2, "features.json", why)
    one_line_error(dry_run_cli(features, tmp_path / "run"), 2, "features.json", why)


@pytest.mark.parametrize("value", ["pipe:touch PWNED", "http://127.0.0.1:1/data", "/data\n/x"])
def test_dataset_dir_must_be_a_local_folder(features: Path, value: str):
    file = features / "features.json"
    data = json.loads(file.read_text())
    data["dataset_dir"] = value
    file.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="dataset_dir"):
        load_feature_manifest(features)


def test_a_feature_shard_symlinked_outside_is_reported_not_read(features: Path, tmp_path: Path):
    (tmp_path / "elsewhere").mkdir()
    shutil.move(features / "train-000000.pt", tmp_path / "elsewhere" / "x.pt")
    (features / "train-000000.pt").symlink_to(tmp_path / "elsewhere" / "x.pt")
    problems = verify_feature_folder(features, full=True)
    assert any("train-000000.pt" in p and "outside the dataset folder" in p for p in problems)
    with pytest.raises(ManifestError, match="outside the dataset folder"):
        shards.open_dataset(features)


def test_dataset_dir_leads_only_to_a_checked_dataset_json(features: Path, dataset: Path, tmp_path: Path):
    """``dataset_dir`` may point anywhere local, but only that folder's dataset.json is read, checked like any
    manifest: a poisoned one there runs nothing, and is reported by ``shards verify`` and ``train-from-shards``."""
    pwned = tmp_path / "PWNED"
    poison(dataset, f"pipe:touch {pwned}")
    file = features / "features.json"
    data = json.loads(file.read_text())
    data["dataset_dir"] = str(dataset)
    file.write_text(json.dumps(data))
    problems = verify_feature_folder(features, full=True)
    assert len(problems) == 1 and "source dataset unreadable" in problems[0] and "pipe:touch" in problems[0]
    assert verify_cli(features).exit_code == 1
    dry_run_cli(features, tmp_path / "run")
    assert not pwned.exists()
