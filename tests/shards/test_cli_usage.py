"""Option errors of every console script are one ``error:`` line with exit 2, as its input errors are (click
printed three lines: the usage, "Try --help", the error); --help and --version still exit 0."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from preprocess.features.cli import precompute_features_command
from preprocess.pack.cli import pack_shards_command
from shards.cli.main import main as shards_command
from train.cli import train_command


@pytest.mark.parametrize("command,args,message", [
    (pack_shards_command, ["src", "--max-bytes", "1X"],
     "error: Invalid value for '--max-bytes': '1X' is not a size like 268435456, 256M or 1G (see 'pack-shards --help')"),
    (train_command, ["--bogus"], "error: No such option '--bogus'"),
    (precompute_features_command, ["data", "--batch-size", "many"], "error: Invalid value for '--batch-size'"),
    (shards_command, ["verfy"], "error: No such command 'verfy'. Did you mean 'verify'? (see 'shards --help')"),
])
def test_a_usage_error_is_one_line_with_exit_2(command, args, message):
    result = CliRunner().invoke(command, args, prog_name="shards" if command is shards_command else command.name)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr


@pytest.mark.parametrize("args", [["--help"], ["--version"]])
def test_help_and_version_still_exit_0(args):
    result = CliRunner().invoke(shards_command, args, prog_name="shards")
    assert result.exit_code == 0 and result.stdout
