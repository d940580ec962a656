"""The report in a real browser: headless Chromium renders it with no console error, no blocked request, the
script running, and a page that is not blank. Skipped where Chromium is missing, except under CI
(``SHARDCACHE_REQUIRE_BROWSER=1``, set by ``.ci/run``), where that is a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from shards.report.build import write_report

WINDOW = (1280, 2000)


@pytest.fixture(scope="session")
def browser() -> str:
    """Chromium's path; asked for first, so a machine without it skips before training the run."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        reason = "chromium is not installed (apt-get install chromium)"
        if os.environ.get("SHARDCACHE_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def open_in_browser(browser: str, page: Path, screenshot: Path, profile: Path) -> tuple[str, list[str]]:
    """Render ``page``: the DOM after scripts ran, and the console lines (errors, CSP refusals, logs)."""
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--hide-scrollbars",
               f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={screenshot}", "--dump-dom",
               page.resolve().as_uri()]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    return done.stdout, console


@pytest.mark.slow
def test_report_renders_in_chromium_without_errors(browser: str, trained_root: Path, dataset_dir: Path,
                                                   tmp_path: Path):
    page = write_report([trained_root / "run", dataset_dir], tmp_path / "report.html")
    dom, console = open_in_browser(browser, page, tmp_path / "shot.png", tmp_path / "profile")
    assert console == []
    assert 'data-script="ok"' in dom  # the table sorter ran to its end
    with Image.open(tmp_path / "shot.png") as shot:
        image = shot.convert("RGB")
    assert image.size == WINDOW
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 500  # text, charts and curves, not a blank or failed page
    header = image.crop((0, 0, WINDOW[0], 40)).getcolors(maxcolors=1 << 16)
    assert max(header)[1] == (29, 39, 51)  # the style sheet applied: the dark header band


@pytest.mark.slow
def test_the_browser_check_catches_errors_and_external_requests(browser: str, trained_root: Path, tmp_path: Path):
    """The control: the same check on a page with a script error and an external image must complain."""
    page = write_report([trained_root / "run"], tmp_path / "report.html", grid=False)
    html = page.read_text().replace("</body>", '<img src="https://example.invalid/x.png"><script>nope();</script>'
                                               "</body>")
    page.write_text(html)
    _, console = open_in_browser(browser, page, tmp_path / "shot.png", tmp_path / "profile")
    assert any("Uncaught ReferenceError" in line for line in console)
    assert any("example.invalid" in line and "Content Security Policy" in line for line in console)
