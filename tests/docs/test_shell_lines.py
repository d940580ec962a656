"""Every shell line of a ```bash block in README.md and docs/*.md names a real command with real options.

A line whose command is one of ours (a console script of pyproject.toml) is parsed by its click command
(``make_context`` with ``resilient_parsing=False``: unknown options, missing arguments and bad choices fail, nothing
runs); ``shards SUB`` is parsed by its subcommand. A ``torchrun`` line is parsed by torchrun's own parser, must start
the console script with ``--no-python`` (``-m train`` would import a user's own ``train.py`` from the working
directory), and the script's arguments are parsed in turn. ``scripts/...`` must be an executable file of the
checkout; ``export`` and ``cp`` are the shell's. Anything else fails: a doc that names a command we do not ship.
The README's pack and verify lines are also run for real on a tiny ImageFolder tree (RUN).
"""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest

from tests.docs.blocks import ROOT, Block, blocks, shell_lines
from tests.helpers import write_image_folder

SHELL_TOOLS = {"export", "cp"}
RUN = {"pack-shards", "shards verify"}  # the README's lines run for real, in its order (pack, then verify)
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]

LINES = [(block, line) for block in blocks("bash") if not block.not_run for line in shell_lines(block)]


def _command(name: str) -> click.Command:
    module, _, attr = SCRIPTS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def _parse(name: str, args: list[str]) -> None:
    """Parse ``name args`` as the console script would, down to the subcommand, without running it."""
    command = _command(name)
    with command.make_context(name, list(args), resilient_parsing=False) as ctx:
        if isinstance(command, click.Group):  # no group option stands before a subcommand in the docs
            sub_name, sub, rest = command.resolve_command(ctx, list(args))
            with sub.make_context(sub_name, rest, parent=ctx, resilient_parsing=False):
                pass


def _parse_torchrun(args: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    assert parsed.no_python, "torchrun without --no-python runs a file or -m module; start the console script"
    assert parsed.training_script in SCRIPTS, f"torchrun starts {parsed.training_script!r}, not a console script"
    _parse(parsed.training_script, parsed.training_script_args)


@pytest.mark.parametrize("block,line", LINES, ids=[f"{b.name}:{i}" for i, (b, _) in enumerate(LINES)])
def test_shell_line_parses(block: Block, line: str):
    tokens = shlex.split(line, comments=True)
    name, args = tokens[0], tokens[1:]
    if name in SHELL_TOOLS:
        return
    if name.startswith("scripts/"):
        assert os.access(ROOT / name, os.X_OK), f"{block.name}: {name} is not an executable file of the checkout"
    elif name == "torchrun":
        _parse_torchrun(args)
    else:
        assert name in SCRIPTS, f"{block.name}: {name!r} is neither a console script of pyproject.toml nor a shell tool"
        try:
            _parse(name, args)
        except click.ClickException as error:
            pytest.fail(f"{block.name}: {line!r}: {error.format_message()}")


def test_readme_has_no_python_dash_m_train():
    """``-m train`` resolves ``train`` from the working directory first: a user's ``train.py`` would run instead."""
    for page in (ROOT / "README.md", *(ROOT / "docs").glob("*.md")):
        assert "-m train " not in page.read_text(encoding="utf-8"), page.name


@pytest.mark.slow
def test_readme_pack_and_verify_lines_run(tmp_path: Path):
    """The README's own pack-shards and shards verify lines, verbatim, from a folder holding data/photos."""
    write_image_folder(tmp_path / "data" / "photos", ("cat", "dog"), per_class=6)
    readme = [line for block in blocks("bash", (ROOT / "README.md",)) for line in shell_lines(block)]
    ran = []
    for line in readme:
        tokens = shlex.split(line, comments=True)
        if tokens[0] in RUN or " ".join(tokens[:2]) in RUN:
            script = Path(sys.executable).parent / tokens[0]
            result = subprocess.run([str(script), *tokens[1:]], cwd=tmp_path, capture_output=True, text=True,
                                    timeout=120)
            assert result.returncode == 0, f"{line}: {result.stderr[-2000:]}"
            ran.append(tokens[0])
    assert ran == ["pack-shards", "shards"]
    assert (tmp_path / "data" / "shards" / "dataset.json").is_file()
