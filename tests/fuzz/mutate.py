"""Mutations of a valid artifact, drawn with Hypothesis: bytes (bit flips, interesting integers, truncation,
splices), JSON values (type swaps, deletions, deep nesting, huge numbers and sizes) and JSON Lines.

Every function takes ``draw`` (``st.data().draw``) and the seed, and returns new bytes; Hypothesis shrinks the draws,
so a failure shrinks towards one small edit near the start of the file. The simplest choice of each draw comes
first (Hypothesis shrinks a ``sampled_from`` towards its first element).
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any, Callable, Sequence

from hypothesis import strategies as st

Draw = Callable[[st.SearchStrategy], Any]

# Integers that break size and count fields: zero, negative, the edges of every width, huge.
INTERESTING_INTS = (0, 1, -1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 40, (1 << 63) - 1,
                    (1 << 64) - 1)
# Byte strings that break text fields: tar's octal fields, JSON and CSV syntax, encodings.
TOKENS = (b"\x00", b"\xff" * 8, b"77777777777\x00", b"99999999999 ", b"\x80\x00\x00\x00\x00\x00\x00\x01",
          b"-1", b"NaN", b"1e400", b"{", b"[", b'"', b"\n", b"\r\n", b",", b"\\", b"\xef\xbb\xbf", b"\xed\xa0\x80",
          b"\xc3", b"x" * 300)


def _position(draw: Draw, size: int, hot: int = 1024) -> int:
    """A byte position, more often in the first or last ``hot`` bytes (headers, magic numbers, schemas and
    footers live there)."""
    if size <= 0:
        return 0
    return draw(st.one_of(st.integers(0, min(size, hot) - 1), st.integers(0, size - 1),
                          st.integers(max(0, size - hot), size - 1)), label="position")


def mutate_bytes(draw: Draw, seed: bytes, *, max_edits: int = 4, hot: int = 1024,
                 tokens: Sequence[bytes] = ()) -> bytes:
    """1 to ``max_edits`` random edits of ``seed``."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, max_edits), label="edits")):
        op = draw(st.sampled_from(("flip", "byte", "int", "truncate", "token", "delete", "splice", "insert",
                                   "tail")), label="op")
        size = len(data)
        if op == "flip" and size:
            at = _position(draw, size, hot)
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and size:
            data[_position(draw, size, hot)] = draw(st.sampled_from((0, 0xFF, 0x7F, 0x80, 0x20, 0x30, 0x37, 0x39)))
        elif op == "int" and size:
            width = draw(st.sampled_from((8, 4, 2)))
            value = draw(st.sampled_from(INTERESTING_INTS)) % (1 << (8 * width))
            at = min(_position(draw, size, hot), max(0, size - width))
            data[at:at + width] = value.to_bytes(width, draw(st.sampled_from(("little", "big"))))
        elif op == "truncate":
            del data[_position(draw, size, hot):]
        elif op == "token":
            at = _position(draw, size, hot)
            token = draw(st.sampled_from(tuple(tokens) + TOKENS))
            if draw(st.booleans()):
                data[at:at] = token
            else:
                data[at:at + len(token)] = token
        elif op == "delete" and size:
            at = _position(draw, size, hot)
            del data[at:at + draw(st.integers(1, 512))]
        elif op == "splice" and size:
            start = _position(draw, size, hot)
            chunk = bytes(data[start:start + draw(st.integers(1, 1024))])
            at = _position(draw, size, hot)
            data[at:at] = chunk * draw(st.sampled_from((1, 2, 16)))
        elif op == "insert":
            data[_position(draw, size, hot):0] = draw(st.binary(min_size=1, max_size=64))
        elif op == "tail":
            data += draw(st.binary(min_size=1, max_size=64)) * draw(st.sampled_from((1, 1000)))
    return bytes(data)


# -- JSON -----------------------------------------------------------------------------------------------------------
# Values spliced into JSON text after serialising (json.dumps cannot write them, or would recurse to write them).
_RAW = {
    "deep-list": "[" * 100_000 + "]" * 100_000,
    "deep-dict": '{"a":' * 100_000 + "1" + "}" * 100_000,
    "deep-65": "[" * 65 + "]" * 65,  # one past shardcache's depth limit
    "deep-900": "[" * 900 + "]" * 900,  # within the interpreter's, past ours
    "big-int": "9" * 5000,  # more digits than int() converts
    "big-exp": "1e999999",
    "neg-zero-int": "-0",
}
_MARK = "\u0000raw:"
MAX_ITEMS = 20_000  # a list grown by an edit stays this short: enough to find a loop per item, cheap to write

INTERESTING_JSON: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2.5, "", "7", 1 << 31, (1 << 53) + 1, 1 << 63, 1 << 64, 10 ** 30, -(10 ** 30),
    1e30, 1e308, -0.0, math.nan, math.inf, -math.inf, [], {}, [None], {"": None}, "x" * 100_000,
    "../../../../etc/passwd", "/etc/passwd", "pipe:cat /etc/passwd", "http://127.0.0.1:9/x", "s3://bucket/key",
    "\ud800", "a\u0000b", ["x"] * 10_000, list(range(10_000)),
    *(_MARK + name for name in _RAW),
)


def dumps(value: Any) -> bytes:
    """JSON text of ``value`` with the raw splices (``_RAW``) in place; NaN and infinities as Python writes them."""
    text = json.dumps(value, allow_nan=True)  # ASCII: a lone surrogate stays the escape ``\\ud800``
    text = re.sub(r'"\\u0000raw:([a-z0-9-]+)"', lambda m: _RAW[m.group(1)], text)
    return text.encode("ascii")


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return list(node)
    if isinstance(node, list):
        return list(range(len(node)))
    return []


def _swap_type(value: Any) -> Any:
    """The same content in another JSON type: what a careless writer or an attacker produces."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return str(value) if value % 2 else float(value) + 0.5
    if isinstance(value, float):
        return str(value)
    if isinstance(value, str):
        return int(value) if value.isdigit() and len(value) < 100 else [value]
    if isinstance(value, list):
        return {str(i): v for i, v in enumerate(value)}
    if isinstance(value, dict):
        return list(value.values())
    return 0


def _interesting(draw: Draw) -> Any:
    """One of ``INTERESTING_JSON``, copied: a later edit may change it in place, and the next example must draw
    the same values from the same choices (Hypothesis replays choices when it shrinks)."""
    return copy.deepcopy(draw(st.sampled_from(INTERESTING_JSON)))


def _edit(draw: Draw, node: Any, known_keys: Sequence[str]) -> tuple[Any, bool]:
    """``(new node, deleted)`` for one edit at ``node``."""
    op = draw(st.sampled_from(("value", "swap", "delete", "add", "repeat", "wrap")), label="json-op")
    if op == "value":
        return _interesting(draw), False
    if op == "swap":
        return _swap_type(node), False
    if op == "delete":
        return None, True
    if op == "add" and isinstance(node, dict):
        key = draw(st.sampled_from(tuple(known_keys) + ("x", "", "__proto__")))
        return {**node, key: _interesting(draw)}, False
    if op == "repeat" and isinstance(node, list) and node:
        times = draw(st.sampled_from((2, 100, 10_000)))
        return node * max(1, min(times, MAX_ITEMS // len(node))), False
    if op == "wrap":
        return draw(st.sampled_from(([node], {"value": node}, [node, copy.deepcopy(node)]))), False
    return _interesting(draw), False


def _keys_of(value: Any, found: set[str]) -> set[str]:
    if isinstance(value, dict):
        for key, child in value.items():
            found.add(key)
            _keys_of(child, found)
    elif isinstance(value, list):
        for child in value[:50]:
            _keys_of(child, found)
    return found


def mutate_value(draw: Draw, value: Any, *, max_edits: int = 3) -> Any:
    """1 to ``max_edits`` edits, each at a node reached by a random walk from the root."""
    value = copy.deepcopy(value)
    known = sorted(_keys_of(value, set()))
    for _ in range(draw(st.integers(1, max_edits), label="json-edits")):
        parent, key, node = None, None, value
        while _children(node) and draw(st.integers(0, 3), label="descend") > 0:
            children = _children(node)
            parent, key = node, children[draw(st.integers(0, len(children) - 1), label="child")]
            node = node[key]
        new, deleted = _edit(draw, node, known)
        if parent is None:
            value = None if deleted else new
        elif deleted:
            del parent[key]
        else:
            parent[key] = new
    return value


def mutate_json(draw: Draw, seed: bytes) -> bytes:
    """A JSON file: its value edited (mostly), its text edited (sometimes after), or both."""
    value = json.loads(seed)
    mode = draw(st.sampled_from(("value", "value", "value+bytes", "bytes")), label="json-mode")
    data = dumps(mutate_value(draw, value)) if mode != "bytes" else seed
    if mode != "value":
        data = mutate_bytes(draw, data, max_edits=2, tokens=(b"NaN", b"Infinity", b"-Infinity", b"1e999", b"null",
                                                              b"true", b'""', b"[]", b"{}"))
    return data


def mutate_json_lines(draw: Draw, seed: bytes) -> bytes:
    """A JSON Lines file: one line's value edited, lines dropped, repeated or added, or the text edited."""
    lines = seed.decode("utf-8").splitlines()
    mode = draw(st.sampled_from(("line", "line", "lines", "bytes")), label="jsonl-mode")
    if mode == "line" and lines:
        at = draw(st.integers(0, len(lines) - 1))
        lines[at] = dumps(mutate_value(draw, json.loads(lines[at]))).decode("ascii")
    elif mode == "lines" and lines:
        at = draw(st.integers(0, len(lines) - 1))
        edit = draw(st.sampled_from(("drop", "repeat", "blank", "scalar")))
        if edit == "drop":
            del lines[at]
        elif edit == "repeat":
            lines[at:at] = [lines[at]] * draw(st.sampled_from((1, 1000)))
        elif edit == "blank":
            lines.insert(at, draw(st.sampled_from(("", "   ", "\x0c", "\u2028"))))
        else:
            lines.insert(at, dumps(draw(st.sampled_from(INTERESTING_JSON))).decode("ascii"))
    data = ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")
    if mode == "bytes":
        data = mutate_bytes(draw, data, max_edits=2)
    return data
