"""``--help`` reads by what a user is deciding: every long command prints its options under titled sections, in a
fixed order, each option under exactly one title, and never as one flat "Options:" list."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

from preprocess.features.cli import precompute_features_command
from preprocess.pack.cli import pack_shards_command
from shards.cli.main import main as shards_main
from train.cli import train_command

TITLES = {
    "train-from-shards": ("Examples", "Most used", "Data", "Model", "Optimisation", "Loader", "Cache and storage", "Run"),
    "pack-shards": ("Examples", "Most used", "Source", "Validation", "Output and shards", "Tables (--table)", "Parallel jobs",
                    "Object storage", "Run"),
    "precompute-features": ("Examples", "Most used", "Input", "Backbone", "Transform and views", "Output", "Loader", "Parallel jobs",
                            "Object storage", "Run"),
    "shards verify": ("Checks", "Object storage", "Run"),
    "shards inspect": ("Batch and grid", "Mixture and subset", "Object storage", "Run"),
    "shards plan": ("Layout", "Node cache", "Link and prices", "Object storage", "Run"),
    "shards export-index": ("Index", "Object storage", "Run"),
}
COMMANDS = {"train-from-shards": (train_command, []), "pack-shards": (pack_shards_command, []),
            "precompute-features": (precompute_features_command, []),
            "shards verify": (shards_main, ["verify"]), "shards inspect": (shards_main, ["inspect"]),
            "shards plan": (shards_main, ["plan"]), "shards export-index": (shards_main, ["export-index"])}
FLAG = re.compile(r"(?<![\w-])--?[A-Za-z0-9][\w-]*")


def help_text(name: str) -> str:
    command, args = COMMANDS[name]
    result = CliRunner().invoke(command, [*args, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return result.output


def sections_of(text: str) -> dict[str, list[set[str]]]:
    """Title -> the flags of each option row under it (a row: two spaces, then the option's flags)."""
    sections: dict[str, list[set[str]]] = {}
    title = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":") and not line.startswith("Usage"):
            title = line[:-1]
            assert title not in sections, f"title {title!r} printed twice"
            sections[title] = []
        elif title is not None and re.match(r"  -", line):
            sections[title].append(set(FLAG.findall(re.split(r"\s{2,}", line.strip())[0])))
    return sections


def visible_options(name: str) -> dict[str, set[str]]:
    command, args = COMMANDS[name]
    if args:
        command = command.commands[args[0]]
    params = command.get_params(click.Context(command))  # with --help
    return {p.name: {*p.opts, *p.secondary_opts} for p in params if isinstance(p, click.Option) and not p.hidden}


@pytest.mark.parametrize("name", sorted(TITLES))
def test_help_prints_the_titles_in_order_and_no_flat_list(name):
    text = help_text(name)
    assert "Options:" not in text
    assert tuple(sections_of(text)) == TITLES[name]


@pytest.mark.parametrize("name", sorted(TITLES))
def test_every_option_is_under_exactly_one_title(name):
    rows = [(title, flags) for title, rows in sections_of(help_text(name)).items() for flags in rows]
    options = visible_options(name)
    for option, flags in options.items():
        under = [title for title, row in rows if row & flags]
        assert len(under) == 1, f"{name}: {sorted(flags)} printed under {under}"
    known = set().union(*options.values())
    assert all(row <= known for _, row in rows), "a row names a flag the command does not have"
    assert len(rows) == len(options)


def test_options_go_where_a_user_looks_for_them():
    train = sections_of(help_text("train-from-shards"))
    assert {"--lr"} in train["Most used"] and {"--workers"} in train["Most used"]  # first, whatever their group
    assert {"--momentum"} in train["Optimisation"] and {"--run-mode"} in train["Loader"]
    assert {"--cache-dir"} in train["Cache and storage"] and {"--s3-profile"} in train["Cache and storage"]
    assert {"--quiet", "-q"} in train["Run"]
    pack = sections_of(help_text("pack-shards"))
    assert {"--verify"} in pack["Validation"] and {"--target"} in pack["Tables (--table)"]
    features = sections_of(help_text("precompute-features"))
    assert {"--crop"} in features["Transform and views"] and {"--amp"} in features["Backbone"]


def test_every_long_shards_subcommand_prints_sections():
    long = [name for name, command in shards_main.commands.items()
            if sum(isinstance(p, click.Option) for p in command.params) > 8]
    assert sorted(long) == ["export-index", "inspect", "plan", "verify"]
    for name in long:
        assert "Options:" not in help_text(f"shards {name}")
