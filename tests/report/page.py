"""Reading a report back the way a browser would: tags, tables, links and text, for tests that check the page."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
# Inline SVG elements that may close themselves in hand-written markup; the report writes them with end tags.
SELF_CLOSING_OK = {"rect", "line", "circle", "path"}


@dataclass
class Page:
    tags: list[str] = field(default_factory=list)
    unbalanced: list[str] = field(default_factory=list)
    tables: list[list[list[str]]] = field(default_factory=list)
    references: list[str] = field(default_factory=list)  # every src and href
    ids: list[str] = field(default_factory=list)
    scripts: list[str] = field(default_factory=list)
    styles: list[str] = field(default_factory=list)  # the style sheet and every style attribute
    event_handlers: list[str] = field(default_factory=list)  # onload=, onerror=, ...: script in attributes
    text: str = ""

    def table(self, *header: str) -> list[list[str]]:
        """The body rows of the first table whose header row starts with ``header``."""
        for rows in self.tables:
            if rows and tuple(rows[0][:len(header)]) == header:
                return rows[1:]
        raise AssertionError(f"no table with header {header}; headers: {[t[0] for t in self.tables if t]}")


    def key_values(self, first_key: str) -> dict[str, str]:
        """A two-column name/value table, found by its first name."""
        for rows in self.tables:
            if rows and rows[0][:1] == [first_key]:
                return {row[0]: row[1] for row in rows if len(row) >= 2}
        raise AssertionError(f"no name/value table starting with {first_key!r}")


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self.stack: list[str] = []
        self.table_stack: list[list[list[str]]] = []
        self.cell: list[str] | None = None
        self.in_script = False
        self.in_style = False
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.page.tags.append(tag)
        attributes = dict(attrs)
        for name in ("src", "href"):
            if name in attributes:
                self.page.references.append(attributes[name] or "")
        self.page.event_handlers += [f"{tag} {name}" for name in attributes if name.startswith("on")]
        if attributes.get("style"):
            self.page.styles.append(attributes["style"] or "")
        if "id" in attributes:
            self.page.ids.append(attributes["id"] or "")
        if tag in VOID:
            return
        self.stack.append(tag)
        if tag == "table":
            self.table_stack.append([])
        elif tag == "tr" and self.table_stack:
            self.table_stack[-1].append([])
        elif tag in ("td", "th"):
            self.cell = []
        elif tag == "script":
            self.in_script = True
        elif tag == "style":
            self.in_style = True

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            if tag not in SELF_CLOSING_OK:
                self.page.unbalanced.append(f"<{tag}/>")
            self.stack.pop()

    def handle_endtag(self, tag):
        if tag in VOID:
            self.page.unbalanced.append(f"</{tag}>")
            return
        if not self.stack or self.stack[-1] != tag:
            self.page.unbalanced.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()
        if tag in ("td", "th") and self.cell is not None and self.table_stack and self.table_stack[-1]:
            self.table_stack[-1][-1].append(" ".join("".join(self.cell).split()))
            self.cell = None
        elif tag == "table":
            self.page.tables.append(self.table_stack.pop())
        elif tag == "script":
            self.in_script = False
        elif tag == "style":
            self.in_style = False

    def handle_data(self, data):
        if self.in_script:
            self.page.scripts.append(data)
            return
        if self.in_style:
            self.page.styles.append(data)
            return
        if self.cell is not None:
            self.cell.append(data)
        self.text.append(data)


def parse(html: str) -> Page:
    parser = _Parser()
    parser.feed(html)
    parser.close()
    page = parser.page
    page.unbalanced += [f"<{tag}> never closed" for tag in parser.stack]
    page.text = " ".join("".join(parser.text).split())
    return page


_DATA_URI = re.compile(r"data:[a-z+/.-]+;base64,[A-Za-z0-9+/=]+")


def http_mentions(html: str) -> list[str]:
    """``http(s)://`` anywhere outside embedded data URIs: a report of a trusted folder names no URL at all
    (inline SVG needs no namespace URI in HTML)."""
    return re.findall(r"https?://[^\s\"'<>)]*", _DATA_URI.sub("", html))


def external_references(html: str) -> list[str]:
    """What the page would fetch or follow outside itself: a src or href that is neither a data: URI nor an
    #anchor, and a CSS url() in the style sheet or a style attribute (text that merely mentions a URL is not one)."""
    page = parse(html)
    found = [ref for ref in page.references if not ref.startswith(("data:", "#"))]
    for css in page.styles:
        found += [u for u in re.findall(r"url\(\s*['\"]?([^'\")]*)", css) if not u.startswith(("data:", "#"))]
    return found


def tiles(html: str) -> dict[str, str]:
    """The headline tiles, label -> value (the first section's win when labels repeat)."""
    import html as html_module

    found = re.findall(r'<div class="tile[^"]*"><div class="value">(.*?)</div><div class="label">(.*?)</div></div>',
                       html)
    out: dict[str, str] = {}
    for value, label in found:
        out.setdefault(html_module.unescape(label), html_module.unescape(value))
    return out
