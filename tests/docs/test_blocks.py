"""The doc tests' own reading: markers, fences and continuation lines, and that a drifted line is caught."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from tests.docs.blocks import ROOT, blocks, shell_lines
from tests.docs.test_shell_lines import _parse, _parse_torchrun

PAGE = """# A page

<!-- not-run: needs eight GPUs -->
```python
fragment()
```

```python
x = 1
```

```bash
pack-shards a \\
    --out b   # comment
# a comment line
```
"""


def test_blocks_reads_markers_languages_and_lines(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(PAGE, encoding="utf-8")
    python = blocks("python", (page,))
    assert [(b.line, b.not_run) for b in python] == [(4, "needs eight GPUs"), (8, None)]
    assert python[1].body == "x = 1\n"
    assert shell_lines(blocks("bash", (page,))[0]) == ["pack-shards a --out b   # comment"]


def test_a_marker_must_sit_just_before_its_fence(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("<!-- not-run: far away -->\n\ntext\n\n```python\nx = 1\n```\n", encoding="utf-8")
    assert blocks("python", (page,))[0].not_run is None


def test_a_drifted_option_or_a_dash_m_train_line_fails():
    with pytest.raises(click.NoSuchOption):
        _parse("shards", ["verify", "data/shards/", "--no-such-option"])
    with pytest.raises(AssertionError, match="--no-python"):
        _parse_torchrun(["--nproc_per_node", "4", "-m", "train", "data/shards/"])


def test_the_docs_hold_blocks_of_both_kinds():
    assert blocks("python") and blocks("bash", (ROOT / "README.md",))
