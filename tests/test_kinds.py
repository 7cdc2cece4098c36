"""One spelling per kind: op kinds, purposes, edge kinds and memory kinds are enums
(`ir.kinds`), and the source never compares one with a string literal (read with `ast`).

A comparison is flagged when one side is a string literal (or a tuple, list or set of
them) spelling an `Op`, a `Purpose` or an `EdgeKind`, or when a `.memory` is compared
with a memory kind's name: such code breaks silently the day a kind is renamed, and reads
as if kinds were free strings."""

from __future__ import annotations

import ast
from pathlib import Path

from piper_nb.ir.kinds import EdgeKind, Op, Purpose
from piper_nb.trace import MEMORY_KINDS

PACKAGE = Path(__file__).resolve().parents[1] / "piper_nb"
KIND_WORDS = ({o.value for o in Op} | {p.value for p in Purpose if p.value}
              | {e.value for e in EdgeKind})


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [x for e in node.elts for x in _literals(e)]
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("frozenset", "set", "tuple"):
        return [x for a in node.args for x in _literals(a)]
    return []


def _is_memory(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "memory"


def string_kind_comparisons() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            words = [w for s in sides for w in _literals(s)]
            bad = [w for w in words if w in KIND_WORDS]
            if any(_is_memory(s) for s in sides):
                bad += [w for w in words if w in MEMORY_KINDS]
            if bad:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: "
                             f"{ast.unparse(node)}")
    return found


def test_no_kind_is_compared_with_a_string():
    found = string_kind_comparisons()
    assert found == [], "compare with the enum members instead:\n" + "\n".join(found)


def test_the_check_sees_a_string_comparison(tmp_path):
    """The reader flags what it must (so the test above can fail)."""
    tree = ast.parse('if ins.kind == "SEND" or ins.purpose in ("norm", "x") or p.memory == '
                     '"params": pass')
    node = tree.body[0].test
    flagged = [v for c in node.values for s in [c.left, *c.comparators] for v in _literals(s)
               if v in KIND_WORDS or v in MEMORY_KINDS]
    assert flagged == ["SEND", "norm", "params"]
