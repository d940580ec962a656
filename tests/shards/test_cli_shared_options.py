"""Options that several commands take are declared once (``shards.cli.common``): the same spelling parses alike and
defaults alike on every command that has it."""

from __future__ import annotations

import click
import pytest

from preprocess.adopt.cli import index_command
from preprocess.features.cli import precompute_features_command
from preprocess.pack.cli import pack_shards_command
from shards.cli.main import main
from train.cli import train_command

COMMANDS = {"pack-shards": pack_shards_command, "precompute-features": precompute_features_command,
            "train-from-shards": train_command, "shards index": index_command,
            **{f"shards {name}": main.commands[name] for name in main.commands}}
SHARED = ("--seed", "--device", "--overwrite", "--source", "--stage-dir", "--break-lease", "--cache-limit",
          "--cache-eviction", "--cache-prefetch", "--cache-local", "--quiet", "--workers")


def declarations(flag: str) -> dict[str, click.Option]:
    return {name: param for name, command in COMMANDS.items() for param in command.params
            if isinstance(param, click.Option) and flag in param.opts}


@pytest.mark.parametrize("flag", SHARED)
def test_a_shared_option_defaults_alike_everywhere(flag):
    found = declarations(flag)
    assert len(found) >= 2, f"{flag} is on {sorted(found)} only"
    assert len({(param.default, param.is_flag, param.multiple) for param in found.values()}) == 1, found


@pytest.mark.parametrize("flag", ["--device", "--cache-limit", "--cache-eviction", "--cache-prefetch", "--source",
                                  "--stage-dir"])
def test_a_shared_option_parses_with_one_type(flag):
    types = {name: (type(param.type), getattr(param.type, "choices", None), param.metavar)
             for name, param in declarations(flag).items()}
    assert len(set(types.values())) == 1, types


def test_the_staging_options_differ_only_in_what_is_staged():
    pack = {p.name: p.help for p in pack_shards_command.params if p.name in ("stage_dir", "break_lease")}
    features = {p.name: p.help for p in precompute_features_command.params if p.name in ("stage_dir", "break_lease")}
    assert pack["break_lease"] == features["break_lease"]
    assert pack["stage_dir"].replace("the shards are packed in", "features are computed in") == features["stage_dir"]
