"""One vocabulary across the console scripts: an option name means one thing everywhere, one --workers rule, one
--device rule, --version on each, "did you mean", light --help, options that do not apply refused, the grown
source named, and a Python call per stage taking the commands' options (issue 43, items 6 and 8)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import preprocess
import train
from preprocess.features.cli import precompute_features_command
from preprocess.pack.cli import pack_shards_command
from shards.cli import common
from shards.cli.main import main as shards_main
from shards.errors import InputError
from shards.suggest import did_you_mean
from tests.helpers import colour_shards, write_image_folder
from train.cli import train_command

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"pack-shards": pack_shards_command, "precompute-features": precompute_features_command,
            "train-from-shards": train_command, "shards": shards_main}


def test_the_commands_are_the_console_scripts():
    text = (ROOT / "pyproject.toml").read_text()
    for name in COMMANDS:
        assert f'\n{name} = "' in text


@pytest.mark.slow  # one interpreter start, ~0.5 s on a quiet machine
def test_help_imports_no_torch():
    # What makes --help slow is torch (4-6 s cold): no command may import it before its body runs.
    code = ("import sys\n"
            "from preprocess.pack.cli import pack_shards_command as a\n"
            "from preprocess.features.cli import precompute_features_command as b\n"
            "from train.cli import train_command as c\n"
            "from shards.cli.main import main as d\n"
            "for command in (a, b, c, d):\n"
            "    try:\n"
            "        command.main(['--help'], standalone_mode=False)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_version(name):
    result = CliRunner().invoke(COMMANDS[name], ["--version"])
    assert result.exit_code == 0 and "0." in result.output and "shardcache" in result.output


def test_pack_counts_samples_per_shard_with_shard_samples(tmp_path: Path):
    # --max-samples is a subset size (train-from-shards, shards inspect); pack's per-shard count has its own name.
    source = write_image_folder(tmp_path / "src", ["a", "b"], 3)
    old = CliRunner().invoke(pack_shards_command, [str(source), "--out", str(tmp_path / "x"), "--max-samples", "2"])
    assert old.exit_code == 2 and "No such option" in old.output
    result = CliRunner().invoke(pack_shards_command, [str(source), "--out", str(tmp_path / "out"), "--shard-samples",
                                                      "2", "--verify", "header", "--workers", "0", "--quiet"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["shards"] == 3


@pytest.mark.parametrize("cpus, expected", [(1, 0), (2, 1), (4, 3), (64, 8)])
def test_one_workers_rule(monkeypatch, cpus, expected):
    monkeypatch.setattr("shards.jobs.parallel.usable_cpus", lambda: cpus)
    assert common.default_workers() == expected


@pytest.mark.parametrize("command, args", [(pack_shards_command, []), (precompute_features_command, []),
                                           (train_command, []), (shards_main, ["verify"]), (shards_main, ["plan"])])
def test_every_workers_help_states_the_rule(command, args):
    text = " ".join(CliRunner().invoke(command, [*args, "--help"]).output.split())
    assert common.WORKERS_RULE in text


def test_the_workers_option_resolves_the_default(monkeypatch):
    monkeypatch.setattr("shards.jobs.parallel.usable_cpus", lambda: 3)
    seen = {}

    @click.command()
    @common.workers_option("Things")
    def command(workers):
        seen["workers"] = workers

    assert CliRunner().invoke(command, []).exit_code == 0 and seen["workers"] == 2
    assert CliRunner().invoke(command, ["--workers", "0"]).exit_code == 0 and seen["workers"] == 0


@pytest.mark.parametrize("command", [precompute_features_command, train_command])
def test_device_names_parse_alike(command):
    for name in ("auto", "cpu", "cuda", "cuda:1"):
        assert command.make_context("x", ["--out", "o", "--device", name]).params["device"] == name
    with pytest.raises(click.BadParameter, match="cuda:N"):
        command.make_context("x", ["--out", "o", "--device", "gpu1"])


def test_train_config_takes_a_gpu_index(tmp_path: Path):
    assert train.train_config("data", out=tmp_path / "run", device="cuda:1").run.device == "cuda:1"
    with pytest.raises(InputError, match="run.device"):
        train.train_config("data", out=tmp_path / "run", device="gpu")


def test_did_you_mean():
    assert did_you_mean("resnet5", ["resnet50", "vgg16", "vit_b_16"]) == "; did you mean 'resnet50'?"
    assert did_you_mean("zzz", ["resnet50"], more="; see --help") == "; see --help"


@pytest.mark.slow  # imports torchvision
def test_a_mistyped_model_gets_a_suggestion_not_a_list():
    from train.model.models import check_image_model

    with pytest.raises(InputError) as caught:
        check_image_model("resnet5O")
    assert "did you mean 'resnet50'" in str(caught.value) and len(str(caught.value)) < 200


def test_a_mistyped_command_gets_a_suggestion():
    result = CliRunner().invoke(shards_main, ["verfy", "x"])
    assert result.exit_code == 2 and "Did you mean 'verify'?" in result.output
    plugin = CliRunner().invoke(shards_main, ["indx"])  # a command another package registers (shards index)
    assert plugin.exit_code == 2 and "Did you mean 'index'?" in plugin.output


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_most_used_options_come_first_with_examples(command):
    if command == "shards":
        return  # a group: its commands are listed, not options
    text = CliRunner().invoke(COMMANDS[command], ["--help"]).output
    assert text.index("Examples:") < text.index("Most used:")
    assert text.split("Most used:")[1].lstrip().startswith(("-o, --out", "--out"))
    assert text.count(f"\n  {command} ") == 2


def test_the_s3_block_is_one_list():
    for command in (pack_shards_command, precompute_features_command, train_command):
        names = {p.name for p in command.params}
        assert set(common.S3_OPTION_NAMES) <= names
        assert len({command.section_of(n) for n in common.S3_OPTION_NAMES}) == 1


def test_feature_dtype_names_match_featurize():
    from preprocess.features.config import AMP_MODES, DTYPES
    from preprocess.features.vocabulary import AMP_NAMES, DTYPE_NAMES

    assert set(DTYPE_NAMES) == set(DTYPES) and set(AMP_NAMES) == set(AMP_MODES)


def _run_train(*args):
    return CliRunner().invoke(train_command, [*map(str, args), "--quiet", "--device", "cpu"])


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_image_options_on_features_are_refused(tmp_path: Path):
    from tests.train.conftest import write_feature_folder

    folder = write_feature_folder(tmp_path / "cache", shard_sizes={"train": [8], "val": [4]}, classes=("a", "b"))
    line = _one_error_line(_run_train(folder, "--out", tmp_path / "run", "--model", "resnet50",
                                      "--image-size", "96"))
    assert "--model resnet50, --image-size 96 apply to image shards" in line and "cached features" in line
    assert not (tmp_path / "run").exists()


def test_head_options_on_images_are_refused(tmp_path: Path):
    line = _one_error_line(_run_train(colour_shards(tmp_path / "images"), "--out", tmp_path / "run", "--head", "mlp"))
    assert "--head mlp applies to cached features" in line and "image shards" in line


def test_a_grown_source_is_named_with_append(tmp_path: Path):
    source = write_image_folder(tmp_path / "src", ["a", "b"], 4)
    args = [str(source), "--out", str(tmp_path / "out"), "--verify", "header", "--workers", "0", "--quiet"]
    assert CliRunner().invoke(pack_shards_command, args).exit_code == 0
    write_image_folder(tmp_path / "more", ["a"], 7)
    for i in (4, 5, 6):
        (tmp_path / "more" / "a" / f"img_{i:04d}.jpg").rename(source / "a" / f"img_{i:04d}.jpg")
    (source / "b" / "img_0000.jpg").unlink()
    line = _one_error_line(CliRunner().invoke(pack_shards_command, args))
    assert "already holds a different dataset" in line
    assert "3 new, 1 removed file(s)" in line and "--append" in line and "--overwrite" in line


def test_changed_options_are_named(tmp_path: Path):
    source = write_image_folder(tmp_path / "src", ["a", "b"], 2)
    args = [str(source), "--out", str(tmp_path / "out"), "--verify", "header", "--quiet"]
    assert CliRunner().invoke(pack_shards_command, args).exit_code == 0
    line = _one_error_line(CliRunner().invoke(pack_shards_command, [*args, "--shard-samples", "1"]))
    assert "packing options (max_samples)" in line and "--overwrite" in line


def _defaults(function) -> dict:
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("command, function, renamed", [
    (train_command, "train.api.train_config",
     {"out_dir": "out", "data_options": "data", "subset_classes": "classes", "subset_keys": "keys",
      "subset_where": "where", "subset_max": "max_samples"}),
    (pack_shards_command, "preprocess.pack.api.pack_shards", {"append_new": "append"}),
])
def test_python_calls_default_as_the_commands(command, function, renamed):
    # The Python call takes the command's options by name, with the command's defaults.
    module, name = function.rsplit(".", 1)
    defaults = _defaults(getattr(__import__(module, fromlist=[name]), name))
    checked = 0
    for param in command.params:
        python = renamed.get(param.name, param.name)
        # --workers and the task split are resolved from the machine and the scheduler, not defaulted.
        if python in defaults and not param.multiple and param.name not in ("workers", "task_index", "num_tasks"):
            default = param.get_default(click.Context(command), call=True)
            unset = default is getattr(click.core, "UNSET", None)  # click 8.2+: an option given no default
            if unset or default is None:
                default = False if unset and getattr(param, "is_flag", False) else None
            else:
                default = param.type_cast_value(click.Context(command), default)
            assert defaults[python] == default, param.name
            checked += 1
    assert checked > 10


def test_pack_shards_from_python(tmp_path: Path):
    source = write_image_folder(tmp_path / "src", ["a", "b"], 3)
    summary = preprocess.pack_shards(source, tmp_path / "out", shard_samples=4, verify="header", workers=0)
    assert summary["samples"] == 6 and (tmp_path / "out" / "dataset.json").is_file()


@pytest.mark.slow  # builds and runs a backbone, then trains
def test_precompute_and_train_from_python(tmp_path: Path):
    data = colour_shards(tmp_path / "images")
    summary = preprocess.precompute_features(data, tmp_path / "feat", weights="none", backbone="mobilenet_v3_small",
                                             device="cpu", workers=0, batch_size=16, quiet=True, dtype="float32")
    assert summary["config_hash"] and (tmp_path / "feat" / "features.json").is_file()
    result = train.train_from_shards(tmp_path / "feat", out=tmp_path / "run", epochs=1, batch_size=16,
                                     device="cpu", quiet=True, no_report=True)
    assert 0.0 <= result["val_top1"] <= 1.0 and Path(result["run_dir"]) == tmp_path / "run"
