"""The fenced code blocks of README.md and docs/*.md, as the doc tests read them.

A block is a fence opened by a line of three backticks and a language (```python, ```bash). The last non-blank line
before the fence may mark it ``<!-- not-run: reason -->``: a fragment that is deliberately not runnable (it needs
eight GPUs or an S3 endpoint), which the tests then skip, naming the reason. Every other block is run or parsed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

_FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.M | re.S)
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<reason>.+?)\s*-->$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    not_run: str | None  # the marker's reason, or None when the block must run

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(lang: str, pages=PAGES) -> list[Block]:
    """Every ``lang`` block of ``pages``, in page order."""
    found = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            if match.group("lang") != lang:
                continue
            before = text[:match.start()].rstrip().splitlines()
            marker = _NOT_RUN.match(before[-1].strip()) if before else None
            found.append(Block(page, text.count("\n", 0, match.start()) + 1, lang, match.group("body"),
                               marker.group("reason") if marker else None))
    return found


def shell_lines(block: Block) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines left out."""
    joined = re.sub(r"\s*\\\n\s*", " ", block.body)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
