"""What the documentation tests read: the examples fenced in the Markdown, and the errors the package raises.

An example runs when the line before its ```` ```python ```` fence is ``<!-- docs-test: run -->`` (executed in the
test's process) or ``<!-- docs-test: run as a script -->`` (run as ``python example.py``, for code that starts
processes of its own, such as Lightning's launcher on several devices).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGE = ROOT / "lightning_superpipe"

_FENCE = re.compile(r"<!-- docs-test: (run|run as a script) -->\n```python\n(.*?)\n```", re.DOTALL)
#: A message's key is its longest stretch of literal text; shorter ones are assembled elsewhere (``f"{call}: {why}"``).
MIN_KEY_CHARS = 15
_ERROR_NAME = re.compile(r"(Error|Exception|Violation|Budget)$")


@dataclass(frozen=True)
class Example:
    """One fenced example: where it is, how it runs, its code."""

    path: Path
    as_script: bool
    code: str

    @property
    def name(self) -> str:
        """The file's path from the repository's root, for test ids."""
        return str(self.path.relative_to(ROOT))


def examples(path: Path) -> list[Example]:
    """The marked examples of one Markdown file, in order."""
    text = path.read_text(encoding="utf-8")
    return [Example(path, kind == "run as a script", code) for kind, code in _FENCE.findall(text)]


def documented_examples() -> list[Example]:
    """The README's and every documentation page's marked examples."""
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [example for page in pages for example in examples(page)]


@dataclass(frozen=True)
class RaiseSite:
    """A ``raise SomeError(message)`` in the package, with the longest literal stretch of its message."""

    error: str
    module: str
    line: int
    key: str


def _literal_parts(node: ast.expr) -> list[str]:
    """The literal stretches of a message expression: a string, an f-string's text, concatenations of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts: list[str] = []
        text = ""
        for value in node.values:
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                text += value.value
            else:
                parts.append(text)
                text = ""
        return [*parts, text]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal_parts(node.left) + _literal_parts(node.right)
    return []


def _error_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def _error_call(node: ast.AST) -> ast.Call | None:
    """The error built with a message by ``raise SomeError(message)``, or by ``return SomeError(message)`` in a
    helper that makes an error for its callers to raise (its name ends in ``Error``, ``Violation`` or ``Budget``)."""
    if isinstance(node, ast.Raise):
        call = node.exc
    elif isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
        call = node.value if _ERROR_NAME.search(_error_name(node.value)) else None
    else:
        return None
    return call if isinstance(call, ast.Call) and call.args else None


def raise_sites() -> list[RaiseSite]:
    """Every error of the package raised (or made to be raised) with a message that has a literal stretch of
    :data:`MIN_KEY_CHARS` characters."""
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            call = _error_call(node)
            if call is None:
                continue
            parts = [part.strip(" :;,.(") for part in _literal_parts(call.args[0])]
            key = max(parts, key=len, default="")
            if len(key) >= MIN_KEY_CHARS:
                module = str(path.relative_to(ROOT))
                sites.append(RaiseSite(_error_name(call), module, node.lineno, key))
    return sites
