"""``where="width >= 256 and mode == 'RGB'"``: a filter on per-sample metadata, parsed, never evaluated as Python.

The expression is the caller's, but the values it is compared with come from a dataset (untrusted): so it is parsed
with ``ast`` into a small tree of comparisons, ``and``/``or``/``not``, field names and literal constants, and
evaluated by the walker below. Calls, attributes, subscripts, arithmetic and every other node are refused when the
filter is built, with a one-line error naming what is not allowed. A sample's fields are its JSON metadata (for
packed images: path, class, width, height, mode, format) plus ``key``, ``label`` (the class index in the source's
own manifest) and ``class`` (its name). A field a sample lacks is an error naming the field and the sample, since
a silent "no match" would quietly shrink the training set.

The expression is bounded before it is walked: at most ``MAX_WHERE_CHARS`` characters and ``MAX_WHERE_DEPTH`` levels
of syntax tree (measured without recursion). Both the checker and the evaluator below recurse once or twice per
level, and Python's parser itself fails with ``RecursionError`` or ``MemoryError`` on a few thousand nested
``not``; a real filter is a few comparisons joined by ``and``/``or`` (a long list of keys belongs in ``keys=``).
"""

from __future__ import annotations

import ast
import io
import operator
import tokenize
from typing import Any, Callable, Mapping

from shards.errors import InputError

_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
_LITERALS = (int, float, str, bool, type(None))
MAX_WHERE_CHARS = 8192
MAX_WHERE_DEPTH = 32
# Field names that are Python keywords ("class"), renamed before parsing and back when looked up.
_KEYWORD_FIELDS = {"class": "class_"}
_FIELD_OF = {renamed: name for name, renamed in _KEYWORD_FIELDS.items()}


def _keyword_fields(expression: str) -> str:
    """``class == 'cat'`` parses as ``class_ == 'cat'`` (tokens, so strings holding the word are untouched)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(expression).readline))
    except (tokenize.TokenError, SyntaxError):
        return expression  # ast.parse reports the syntax error
    out = [(t.type, _KEYWORD_FIELDS.get(t.string, t.string) if t.type == tokenize.NAME else t.string) for t in tokens]
    return tokenize.untokenize(out)


def _shortened(expression: str, keep: int = 60) -> str:
    """The expression for an error line: a deep one is thousands of characters of ``not not ...``."""
    return repr(expression) if len(expression) <= keep else repr(expression[:keep]) + f"... ({len(expression):,} chars)"


def _depth_exceeds(tree: ast.AST, limit: int) -> bool:
    """Whether the syntax tree is more than ``limit`` nodes deep; level by level, so no recursion."""
    level, depth = [tree], 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [child for node in level for child in ast.iter_child_nodes(node)]
    return False


class Where:
    """A compiled filter: ``Where("width >= 256")(fields) -> bool``. Picklable (it keeps only its text and tree)."""

    def __init__(self, expression: str):
        if not isinstance(expression, str) or not expression.strip():
            raise InputError(f"where={expression!r}: give a filter such as \"width >= 256\"")
        self.expression = expression
        if len(expression) > MAX_WHERE_CHARS:
            raise InputError(f"where={_shortened(expression)} is longer than {MAX_WHERE_CHARS:,} characters; "
                             "select many keys with keys= instead")
        too_deep = f"where={_shortened(expression)} nests deeper than {MAX_WHERE_DEPTH} levels"
        try:
            tree = ast.parse(_keyword_fields(expression.strip()), mode="eval")
        except SyntaxError as exc:
            raise InputError(f"where={expression!r} is not a valid filter ({exc.msg})") from None
        except (RecursionError, MemoryError):  # the parser's own guards against deep nesting
            raise InputError(too_deep) from None
        if _depth_exceeds(tree, MAX_WHERE_DEPTH):
            raise InputError(too_deep)
        self._tree = tree.body
        self._check(self._tree)

    def __repr__(self) -> str:
        return f"Where({self.expression!r})"

    def _check(self, node: ast.AST) -> None:
        if isinstance(node, ast.BoolOp):
            for value in node.values:
                self._check(value)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self._check(node.operand)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
                and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
            pass  # a negative number
        elif isinstance(node, ast.Compare):
            if any(type(op) not in _COMPARE for op in node.ops):
                raise InputError(f"where={self.expression!r}: only ==, !=, <, <=, >, >=, in, not in compare")
            for part in (node.left, *node.comparators):
                self._check(part)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                if not (isinstance(element, ast.Constant) and isinstance(element.value, _LITERALS)):
                    raise InputError(f"where={self.expression!r}: a list may hold only literal values")
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, _LITERALS):
                raise InputError(f"where={self.expression!r}: {node.value!r} is not a number, string or bool")
        elif not isinstance(node, ast.Name):
            raise InputError(f"where={self.expression!r}: {type(node).__name__} is not allowed (fields, literals, "
                             "comparisons, and/or/not only)")

    def __call__(self, fields: Mapping[str, Any]) -> bool:
        return bool(self._eval(self._tree, fields))

    def _eval(self, node: ast.AST, fields: Mapping[str, Any]) -> Any:
        if isinstance(node, ast.BoolOp):
            values = (self._eval(v, fields) for v in node.values)
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.UnaryOp):
            value = self._eval(node.operand, fields)
            return (not value) if isinstance(node.op, ast.Not) else -value
        if isinstance(node, ast.Compare):
            left = self._eval(node.left, fields)
            for op, right_node in zip(node.ops, node.comparators):
                right = self._eval(right_node, fields)
                try:
                    if not _COMPARE[type(op)](left, right):
                        return False
                except TypeError:
                    raise InputError(f"where={self.expression!r}: cannot compare {left!r} with {right!r} "
                                     f"[sample {fields.get('key')}]") from None
                left = right
            return True
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(element.value for element in node.elts)
        if isinstance(node, ast.Constant):
            return node.value
        name = _FIELD_OF.get(node.id, node.id)
        if name not in fields:
            raise InputError(f"where={self.expression!r}: sample {fields.get('key')!r} has no field {name!r} "
                             f"(it has {', '.join(sorted(fields))})")
        return fields[name]
