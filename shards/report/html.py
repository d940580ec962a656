"""The page around the report's sections: escaping, the skeleton with its CSS and tiny script, tables and tiles.

Manifests, configs and metrics are untrusted input, so nothing reaches the page unescaped by accident: every helper
here escapes what it is given unless it is ``Markup`` (text this package built itself and already escaped). The
page must open from a shared file system in any browser with no network, so it carries its own CSS and images and
its only script sorts tables.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from shards.units import human_bytes


class Markup(str):
    """Text that is already safe HTML; anything else is escaped on the way into the page."""

    def __add__(self, other: object) -> "Markup":
        return Markup(str.__add__(self, esc(other)))


def esc(value: object) -> Markup:
    return value if isinstance(value, Markup) else Markup(html.escape(str(value), quote=True))


def join(parts: Iterable[object], sep: str = "") -> Markup:
    return Markup(sep.join(esc(part) for part in parts))


def tag(name: str, content: object = "", **attrs: object) -> Markup:
    """``<name attrs>content</name>``; ``class_`` stands for ``class``; None and False attributes are left out."""
    rendered = "".join(f' {key.rstrip("_").replace("_", "-")}="{esc(value)}"' for key, value in attrs.items()
                       if value is not None and value is not False)
    return Markup(f"<{name}{rendered}>{esc(content)}</{name}>")


def void(name: str, **attrs: object) -> Markup:
    """An element without content or end tag (``img``, ``br``), attributes as in ``tag``."""
    return Markup(tag(name, **attrs)[: -len(f"</{name}>")])


def number(value: Any) -> float | None:
    """A finite number from untrusted JSON, else None (strings, booleans, NaN and nested values are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def pct(value: Any, digits: int = 2) -> str:
    value = number(value)
    return "n/a" if value is None else f"{100 * value:.{digits}f}%"


def fixed(value: Any, digits: int = 4) -> str:
    value = number(value)
    return "n/a" if value is None else f"{value:.{digits}f}"


def count(value: Any) -> str:
    value = number(value)
    return "n/a" if value is None else f"{value:,.0f}"


def size(value: Any) -> str:
    value = number(value)
    return "n/a" if value is None else human_bytes(value)


def seconds(value: Any) -> str:
    value = number(value)
    if value is None:
        return "n/a"
    return f"{value:.3f} s" if value < 10 else f"{value:,.1f} s"


def rate(value: Any) -> str:
    value = number(value)
    return "n/a" if value is None else f"{value:.3g}"


@dataclass(frozen=True)
class Cell:
    """A table cell: its text, and a number to sort by (numeric cells are right-aligned)."""

    text: object
    sort: float | None = None
    mono: bool = False


def num_cell(value: Any, formatter=count) -> Cell:
    parsed = number(value)
    return Cell(formatter(value), -math.inf if parsed is None else parsed)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], *, sortable: bool = True,
          scroll: bool = False, caption: str | None = None) -> Markup:
    """A table whose cells are ``Cell`` or plain values; ``sortable`` lets a click on a header sort it."""
    rows = [list(row) for row in rows]
    numeric = [bool(rows) and all(isinstance(row[i], Cell) and row[i].sort is not None for row in rows if i < len(row))
               for i in range(len(headers))]
    head = join(tag("th", h, scope="col", class_="num" if numeric[i] else None,
                    title="click to sort" if sortable else None) for i, h in enumerate(headers))
    body = []
    for row in rows:
        cells = []
        for cell in row:
            cell = cell if isinstance(cell, Cell) else Cell(cell)
            classes = " ".join(c for c in ("num" if cell.sort is not None else "",
                                           "mono" if cell.mono else "") if c) or None
            data_v = None if cell.sort is None else repr(cell.sort) if math.isfinite(cell.sort) else "-Infinity"
            cells.append(tag("td", cell.text, class_=classes, data_v=data_v))
        body.append(tag("tr", join(cells)))
    markup = tag("table", join([tag("caption", caption) if caption else "", tag("thead", tag("tr", head)),
                                tag("tbody", join(body))]), class_="sortable" if sortable else None)
    return tag("div", markup, class_="scroll") if scroll else markup


def key_values(items: Iterable[tuple[str, object]]) -> Markup:
    """A two-column table of names and values; values that are not text are shown as compact JSON."""
    rows = []
    for key, value in items:
        shown = value if isinstance(value, (str, Markup)) else json.dumps(value, sort_keys=True, default=str)
        rows.append(tag("tr", tag("th", key, scope="row") + tag("td", shown)))
    return tag("table", tag("tbody", join(rows)), class_="kv")


def key_value_grid(items: Iterable[tuple[str, object]]) -> Markup:
    """Many short name/value pairs (a config) in as many columns as the page allows."""
    cells = []
    for key, value in items:
        shown = value if isinstance(value, (str, Markup)) else json.dumps(value, sort_keys=True, default=str)
        cells.append(tag("div", tag("span", key, class_="k") + tag("span", shown, class_="v mono")))
    return tag("div", join(cells), class_="kvgrid")


def tiles(items: Iterable[tuple[str, str, str | None]]) -> Markup:
    """Headline numbers: (label, value, tone) where tone is None, "good" or "warn"."""
    return tag("div", join(tag("div", tag("div", value, class_="value") + tag("div", label, class_="label"),
                                class_=f"tile {tone}" if tone else "tile") for label, value, tone in items),
               class_="tiles")


def note(text: object, tone: str = "info") -> Markup:
    return tag("p", text, class_=f"note {tone}")


def figure(content: Markup, caption: str | None = None) -> Markup:
    return tag("figure", content + (tag("figcaption", caption) if caption else ""))


def image_data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


@dataclass(frozen=True)
class Section:
    """One folder's part of the page. ``anchor`` is the id other sections link to."""

    anchor: str
    kind: str  # "dataset", "features" or "run"
    path: str
    title: str
    body: Markup

    def render(self) -> Markup:
        header = tag("div", tag("span", self.kind, class_=f"badge {self.kind}") + tag("h2", self.title)
                     + tag("div", self.path, class_="path mono"), class_="section-head")
        return tag("section", header + self.body, id=self.anchor, class_="card")


def subsection(title: str, content: Markup) -> Markup:
    return tag("div", tag("h3", title) + content, class_="sub")


# In every page's head: how ``shards report`` knows a file it may replace (shards.report.build.check_report_out).
GENERATOR_META = '<meta name="generator" content="shardcache report">'


def page(title: str, sections: Sequence[Section], generated: str, tool: str) -> str:
    """The whole HTML document: self-contained, no external resource of any kind."""
    nav = join(tag("a", tag("span", s.kind, class_=f"badge {s.kind}") + " " + s.title, href=f"#{s.anchor}")
               for s in sections)
    body = (tag("header", tag("h1", title) + tag("div", f"generated {generated} by {tool}", class_="meta")
                + tag("nav", nav))
            + tag("main", join(s.render() for s in sections))
            + tag("footer", "Self-contained: no network, no external files. Click a table header to sort."))
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n" + GENERATOR_META + "\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
            "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">\n"
            f"<title>{esc(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n{body}\n"
            f"<script>{SCRIPT}</script>\n</body>\n</html>\n")


CSS = """
:root { --ink: #1d2733; --muted: #5f6b7a; --line: #e3e7ed; --bg: #f4f6f9; --card: #fff; --accent: #3563c9; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--ink); line-height: 1.45;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
header { background: #1d2733; color: #fff; padding: 22px 32px 16px; }
header h1 { margin: 0; font-size: 22px; font-weight: 650; }
header .meta { color: #b8c2cf; font-size: 12px; margin-top: 2px; }
nav { display: flex; flex-wrap: wrap; gap: 8px; margin-top: 12px; }
nav a { color: #fff; text-decoration: none; background: rgba(255,255,255,.1); border-radius: 6px;
  padding: 4px 10px; font-size: 13px; max-width: 420px; overflow: hidden; text-overflow: ellipsis;
  white-space: nowrap; }
nav a:hover { background: rgba(255,255,255,.2); }
main { max-width: 1180px; margin: 0 auto; padding: 20px 24px 8px; }
footer { max-width: 1180px; margin: 0 auto; padding: 8px 24px 28px; color: var(--muted); font-size: 12px; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 10px; padding: 18px 22px;
  margin-bottom: 22px; box-shadow: 0 1px 2px rgba(20,30,50,.05); }
.section-head { display: flex; flex-wrap: wrap; align-items: baseline; gap: 4px 12px;
  border-bottom: 1px solid var(--line); padding-bottom: 10px; margin-bottom: 6px; }
.section-head h2 { margin: 0; font-size: 19px; font-weight: 650; overflow-wrap: anywhere; }
.section-head .path { flex-basis: 100%; color: var(--muted); font-size: 12px; overflow-wrap: anywhere; }
.badge { display: inline-block; font-size: 11px; font-weight: 700; letter-spacing: .04em; text-transform: uppercase;
  border-radius: 4px; padding: 2px 7px; color: #fff; vertical-align: 2px; }
.badge.dataset { background: #2f7d5b; } .badge.features { background: #8a5a12; } .badge.run { background: #3563c9; }
.sub { margin-top: 18px; }
h3 { font-size: 15px; margin: 0 0 8px; font-weight: 650; }
h4 { font-size: 13px; margin: 10px 0 6px; font-weight: 600; color: var(--muted); }
.tiles { display: grid; grid-template-columns: repeat(auto-fill, minmax(138px, 1fr)); gap: 10px; margin: 12px 0 4px; }
.tile { border: 1px solid var(--line); border-radius: 8px; padding: 10px 12px; background: #fafbfc; }
.tile .value { font-size: 21px; font-weight: 650; font-variant-numeric: tabular-nums; overflow-wrap: anywhere; }
.tile .label { color: var(--muted); font-size: 12px; }
.tile.good { border-color: #b5dcc6; background: #f1faf4; } .tile.warn { border-color: #f0c48a; background: #fff7ea; }
.tile.bad { border-color: #eeb0aa; background: #fdf1f0; }
.grid2 { display: grid; grid-template-columns: repeat(auto-fit, minmax(440px, 1fr)); gap: 18px; align-items: start; }
figure { margin: 0; }
figure svg, figure img { max-width: 100%; height: auto; display: block; }
figcaption { color: var(--muted); font-size: 12px; margin-top: 4px; }
table { border-collapse: collapse; min-width: min(100%, 720px); font-size: 13px; font-variant-numeric: tabular-nums; }
.scroll table, table.kv { width: 100%; }
th, td { text-align: left; padding: 4px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
thead th { position: sticky; top: 0; background: #eef1f5; font-weight: 600; white-space: nowrap; }
table.sortable thead th { cursor: pointer; user-select: none; }
table.sortable thead th[aria-sort="ascending"]::after { content: " \\25B2"; font-size: 10px; }
table.sortable thead th[aria-sort="descending"]::after { content: " \\25BC"; font-size: 10px; }
tbody tr:nth-child(even) { background: #fafbfc; }
td.num, th.num { text-align: right; white-space: nowrap; }
td, th { overflow-wrap: anywhere; }
.mono, td.mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px; }
table.kv th { width: 28%; color: var(--muted); font-weight: 500; background: none; position: static; }
table.kv td { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px; }
.kvgrid { display: grid; grid-template-columns: repeat(auto-fill, minmax(270px, 1fr)); gap: 0 18px; }
.kvgrid div { display: flex; justify-content: space-between; align-items: baseline; gap: 10px; padding: 3px 2px;
  border-bottom: 1px solid var(--line); min-width: 0; }
.kvgrid .k { color: var(--muted); } .kvgrid .v { text-align: right; overflow-wrap: anywhere; min-width: 0; }
.scroll { max-height: 380px; overflow: auto; border: 1px solid var(--line); border-radius: 6px; }
.scroll table { border: none; }
details { margin-top: 8px; } summary { cursor: pointer; color: var(--accent); font-weight: 550; }
.note { border-left: 4px solid #9fb3d9; background: #f3f6fc; padding: 8px 12px; border-radius: 4px; margin: 8px 0; }
.note.warn { border-color: #e39b3b; background: #fff7ea; } .note.bad { border-color: #d2553f; background: #fdf1f0; }
.note.good { border-color: #4aa36f; background: #f1faf4; }
.note ul { margin: 4px 0 0; padding-left: 20px; }
.samples { display: grid; grid-template-columns: repeat(auto-fill, minmax(112px, 1fr)); gap: 10px; }
.samples figure { background: #fafbfc; border: 1px solid var(--line); border-radius: 6px; padding: 6px;
  text-align: center; }
.samples img { width: 100%; height: 96px; object-fit: contain; margin: 0 auto; }
.samples figcaption { color: var(--ink); font-size: 12px; white-space: nowrap; overflow: hidden;
  text-overflow: ellipsis; }
a { color: var(--accent); }
"""

SCRIPT = """
(function () {
  function key(cell) {
    var v = cell.getAttribute('data-v');
    return v === null ? cell.textContent.toLowerCase() : parseFloat(v);
  }
  document.querySelectorAll('table.sortable thead th').forEach(function (th) {
    th.addEventListener('click', function () {
      var table = th.closest('table'), body = table.tBodies[0], index = th.cellIndex;
      var ascending = th.getAttribute('aria-sort') !== 'ascending';
      table.querySelectorAll('thead th').forEach(function (other) { other.removeAttribute('aria-sort'); });
      th.setAttribute('aria-sort', ascending ? 'ascending' : 'descending');
      var rows = Array.prototype.slice.call(body.rows);
      rows.sort(function (a, b) {
        var x = key(a.cells[index]), y = key(b.cells[index]);
        return (x < y ? -1 : x > y ? 1 : 0) * (ascending ? 1 : -1);
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
  document.body.setAttribute('data-script', 'ok');  // the sorters are attached: visible to a test or in devtools
})();
"""
