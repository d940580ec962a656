"""Every ```python block of README.md and docs/*.md runs, so a doc that drifts from the API fails CI.

Each page's blocks run in order in one namespace (a reader runs them one after another), in a temporary working
directory holding what the blocks name: ``data/photos/`` (an ImageFolder tree), ``data/shards/`` and ``shards/`` (it
packed), ``generic/`` and ``in-domain/`` (the same shards, two sources of a mixture), ``data/laion-tars/`` (its tars,
to adopt) and ``train.json`` (its wids index). Absolute example paths (``/data/...``, ``/idx/...``) are rooted there.
The reader's own objects a block uses without defining them are given: a tiny ``model`` and its ``optimizer``,
``epochs`` (2) and ``ckpt`` (a dict).

Before a block runs its text is changed, and only so (SUBSTITUTIONS): ``"cuda"`` becomes ``"cpu"`` (no GPU here),
``range(10)`` epochs become ``range(2)``, and ``batch_size=256`` becomes 8 (the tiny dataset holds 24 training
samples, so a 256 batch with drop_last would run no step). A block marked ``<!-- not-run: reason -->`` is skipped
(tests/docs/blocks.py); an unmarked block that raises fails here, naming the page and line.
"""

from __future__ import annotations

import shutil
import traceback
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from preprocess.pack.cli import pack_shards_command
from shards.cli.main import main as shards_main
from tests.docs.blocks import ROOT, Block, blocks
from tests.helpers import write_image_folder

pytestmark = pytest.mark.slow  # a page's blocks stream, adopt and train for a second or more

SUBSTITUTIONS = (('"cuda"', '"cpu"'), ("range(10)", "range(2)"), ("batch_size=256", "batch_size=8"),
                 ('"/data/', '"data/'), ('"/idx/', '"idx/'))

PYTHON_BLOCKS = blocks("python")
PAGES = sorted({block.page for block in PYTHON_BLOCKS})


def _invoke(command, args: list[str]) -> None:
    result = CliRunner().invoke(command, args, catch_exceptions=False)
    assert result.exit_code == 0, f"{args}: {result.output}"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The working directory the blocks run in (see the module docstring)."""
    root = tmp_path_factory.mktemp("docs-world")
    photos = write_image_folder(root / "data" / "photos", ("cat", "dog", "bird"), per_class=10, size=(264, 32))
    _invoke(pack_shards_command, [str(photos), "--out", str(root / "shards"), "--val-fraction", "0.2",
                                  "--shard-samples", "8", "--workers", "0", "--quiet"])
    for copy in ("data/shards", "generic", "in-domain"):
        shutil.copytree(root / "shards", root / copy)
    (root / "data" / "laion-tars").mkdir()
    for tar in (root / "shards").glob("*.tar"):
        shutil.copy(tar, root / "data" / "laion-tars" / tar.name)
    _invoke(shards_main, ["export-index", str(root / "shards"), "--out", str(root / "train.json"), "--quiet"])
    return root


def _reader_objects() -> dict:
    model = torch.nn.Linear(8, 3)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "epochs": 2, "ckpt": {}}


def _source(block: Block) -> str:
    text = block.body
    for old, new in SUBSTITUTIONS:
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_python_blocks_of_the_page_run(page: Path, world: Path, monkeypatch, tmp_path: Path):
    run_dir = tmp_path / "cwd"
    shutil.copytree(world, run_dir, symlinks=True)  # a block may write (a checkpoint, an index): not into the next page
    monkeypatch.chdir(run_dir)
    namespace = {"__name__": "__doc_block__", **_reader_objects()}
    ran = 0
    for block in (b for b in PYTHON_BLOCKS if b.page == page):
        if block.not_run:
            continue
        try:
            exec(compile(_source(block), block.name, "exec"), namespace)
        except Exception:
            pytest.fail(f"{block.name} does not run (mark a deliberate fragment <!-- not-run: reason -->):\n"
                        f"{traceback.format_exc(limit=-3)}")
        ran += 1
    assert ran or all(b.not_run for b in PYTHON_BLOCKS if b.page == page)


def test_every_python_block_runs_or_says_why_not():
    """A marker needs a reason, and most blocks run: markers stay for the few fragments that cannot."""
    assert PYTHON_BLOCKS, "no python blocks found: the fence pattern drifted"
    marked = [b for b in PYTHON_BLOCKS if b.not_run is not None]
    assert all(b.not_run.strip() for b in marked)
    assert len(marked) <= len(PYTHON_BLOCKS) // 3, [b.name for b in marked]
