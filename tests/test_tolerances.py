"""Every numeric tolerance of the suite is derived, not tuned on one machine (issue 33).

A tolerance tuned to pass on one CPU fails on another whose kernels round differently (AVX-512,
AMX, another BLAS): a bound must follow from float32's error at the compared values' scale, the
number of terms summed or the problem's conditioning, with a stated margin. The scan below finds
every literal tolerance in tests/*.py (pure Python: ast and tokenize, no imports of the modules):

- keyword arguments atol=, rtol=, abs=, rel=, rel_tol=, abs_tol=, tol= of any call (np.testing,
  pytest.approx, math.isclose, the tests' own checkers) and such parameters' defaults in a def;
- the positional rtol/atol of np.testing.assert_allclose, np.allclose, np.isclose and pytest.approx;
- upper bounds in asserts: `assert err < 1e-6`, `assert err <= 1e-5 * scale` (a float literal below
  1e-2 on the bound's side; lower bounds such as `> 1e-3`, "the change is visible", and coarse
  bounds such as `loss < 0.05 * first_loss` are not rounding tolerances).

A tolerance passes if its expression contains no nonzero number (0 is an exact comparison; so is a
variable whose value comes from elsewhere), if it uses a derivation from tests/helpers.py (any
name imported from helpers, or np.finfo) or one of the file's own (a function with "tol" in its
name and a docstring), or if a comment states its derivation: on its own line,
on a line of its statement above it, or in the comment block directly above its statement. A variable (`tol = 1e-5`,
then `atol=tol`) is followed to its assignment in the same function or module, which must pass.
"""

import ast
import io
import os
import tokenize

TESTS = os.path.dirname(os.path.abspath(__file__))

TOL_KEYWORDS = {"atol", "rtol", "abs", "rel", "rel_tol", "abs_tol", "tol"}
# Calls whose positional arguments after the compared values are tolerances: {name: {index: keyword}}.
POSITIONAL = {"assert_allclose": {2: "rtol", 3: "atol"}, "allclose": {2: "rtol", 3: "atol"},
              "isclose": {2: "rtol", 3: "atol"}, "approx": {1: "rel", 2: "abs"}}
DERIVED_ATTRS = {"finfo", "eps"}  # np.finfo(np.float32).eps and the like derive a bound too
PRAGMAS = ("noqa", "type:", "pragma", "fmt:")
# An assert's bound is a rounding tolerance when it holds a float literal this small (1e-6, 1 + 1e-9,
# 1e-5 * scale); 0.05 * loss or 0.6 < ratio < 1.1 are what a method does, not how a machine rounds.
SMALL = 1e-2
# Calls that compute nothing of their own: a literal inside them is still the tolerance.
PLAIN_CALLS = {"max", "min", "abs", "float", "int"}


def _comments(source: str) -> dict[int, str]:
    """line -> the comment on it (without '#'), pragma-only comments left out."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if text and not text.startswith(PRAGMAS):
                out[tok.start[0]] = text
    return out


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


ARITHMETIC = (ast.BinOp, ast.UnaryOp, ast.IfExp, ast.BoolOp, ast.Tuple, ast.List, ast.Set, ast.Starred,
              ast.operator, ast.unaryop, ast.boolop, ast.expr_context)


def _walk(expr: ast.AST, arithmetic_only: bool):
    """The nodes of `expr`, not descending into subscripts (an index is no tolerance), into the
    arguments of a call other than max/min/abs/float/int (a derivation's parameters), nor, if
    `arithmetic_only`, into anything but arithmetic and literal sequences (a call's arguments, a
    value computed from data)."""
    yield expr
    if isinstance(expr, ast.Subscript) or arithmetic_only and not isinstance(expr, ARITHMETIC):
        return
    if isinstance(expr, ast.Call) and _callee(expr) not in PLAIN_CALLS:
        return  # a derivation's parameters (adam_rtol(0.999, t)): the function is the derivation
    for child in ast.iter_child_nodes(expr):
        yield from _walk(child, arithmetic_only)


def _has_literal(expr: ast.AST, arithmetic_only: bool = False) -> bool:
    """A nonzero int or float literal in the expression (not a bool, not a string)."""
    return any(isinstance(n, ast.Constant) and type(n.value) in (int, float) and n.value != 0
               for n in _walk(expr, arithmetic_only))


class _Scan:
    def __init__(self, source: str, filename: str):
        self.lines = source.splitlines()
        self.comments = _comments(source)
        self.filename = filename
        self.tree = ast.parse(source, filename)
        self.helpers: set[str] = set()
        self.parents: dict[ast.AST, ast.AST] = {}
        self.sites: list[ast.AST] = []  # the calls, defs and asserts, checked once parents are known
        for node in ast.walk(self.tree):  # one pass: the scan must stay well under a second
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, (ast.Call, ast.Assert)):
                self.sites.append(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.sites.append(node)
                # the file's own derivations: functions named for a tolerance (shampoo_rtol,
                # schedule_atol) whose docstring states how they derive it
                if "tol" in node.name and ast.get_docstring(node):
                    self.helpers.add(node.name)
            elif isinstance(node, ast.ImportFrom) and node.module == "helpers":
                self.helpers.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import) and any(a.name == "helpers" for a in node.names):
                self.helpers.add("helpers")
        self.flagged: dict[int, str] = {}
        self._binding_cache: dict[ast.AST, list] = {}

    # --- where a name's value comes from -------------------------------------------------------
    def _scopes(self, node: ast.AST):
        """The enclosing functions (innermost first), then the module."""
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Module)):
                yield node

    def _bindings(self, scope: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
        """(target, value) of every assignment and for-loop in `scope` (computed once per scope)."""
        if scope not in self._binding_cache:
            pairs = []
            for node in ast.walk(scope):
                if isinstance(node, ast.Assign):
                    pairs += [(target, node.value) for target in node.targets]
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                    pairs.append((node.target, node.value))
                elif isinstance(node, (ast.For, ast.comprehension)):
                    pairs.append((node.target, node.iter))
            self._binding_cache[scope] = pairs
        return self._binding_cache[scope]

    def _assignments(self, name: str, at: ast.AST) -> list[ast.AST]:
        """The values bound to `name` by assignments or for-loops in the innermost scope that binds it."""
        for scope in self._scopes(at):
            found = [v for target, value in self._bindings(scope) for v in self._bound(target, value, name)]
            if found:
                return found
        return []

    @staticmethod
    def _bound(target: ast.AST, value: ast.AST, name: str) -> list[ast.AST]:
        if isinstance(target, ast.Name):
            return [value] if target.id == name else []
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                return [v for t, v in zip(target.elts, value.elts) for v in _Scan._bound(t, v, name)]
            if any(isinstance(t, ast.Name) and t.id == name for t in ast.walk(target)):
                return [value]  # unpacked from a call or a sequence of tuples: the whole value
        return []

    # --- what makes a tolerance pass ----------------------------------------------------------
    def _derived(self, expr: ast.AST, depth: int = 2) -> bool:
        for n in ast.walk(expr):
            if isinstance(n, ast.Name) and n.id in self.helpers:
                return True
            if isinstance(n, ast.Name) and depth and any(self._derived(v, depth - 1)  # F32_EPS = EPS32
                                                         for v in self._assignments(n.id, n)):
                return True
            if isinstance(n, ast.Attribute) and (n.attr in DERIVED_ATTRS or
                                                 isinstance(n.value, ast.Name) and n.value.id == "helpers"):
                return True
        return False

    def _documented(self, node: ast.AST) -> bool:
        stmt = node
        while not isinstance(stmt, ast.stmt) and stmt in self.parents:
            stmt = self.parents[stmt]
        lines = set(range(stmt.lineno, node.end_lineno + 1))  # its statement's lines up to its own last: a
        # comment on the tolerance's line or on a line of the statement above it
        while True:
            first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", ()))])
            line = first - 1
            while line >= 1 and self.lines[line - 1].strip().startswith("#"):
                lines.add(line)
                line -= 1
            # the first statement of a block: the header above it (`for ...:  # why`) speaks for it too
            parent = self.parents.get(stmt)
            if not isinstance(parent, ast.stmt) or not getattr(parent, "body", None) or parent.body[0] is not stmt:
                break
            lines.update(range(parent.lineno, stmt.lineno))
            stmt = parent
        return any(line in self.comments for line in lines)

    def check(self, expr: ast.AST, what: str, seen=frozenset()) -> None:
        """Flag `expr` (a tolerance) unless exact, derived or documented; follow the variables it
        is computed from by arithmetic (`tol`, `2 * tol`; not `np.abs(want).max()`: data)."""
        if self._derived(expr) or self._documented(expr):
            return
        if _has_literal(expr, arithmetic_only=bool(seen)):
            self.flagged.setdefault(expr.lineno, what)
            return
        for n in _walk(expr, arithmetic_only=True):
            if isinstance(n, ast.Name) and n.id not in seen:
                for value in self._assignments(n.id, expr):
                    self.check(value, f"{what} (via `{n.id}`)", seen | {n.id})

    # --- where tolerances are -------------------------------------------------------------------
    def run(self) -> None:
        for node in self.sites:
            if isinstance(node, ast.Call):
                self._call(node)
            elif isinstance(node, ast.Assert):
                self._assert(node)
            else:
                self._def(node)

    def _call(self, node: ast.Call) -> None:
        for kw in node.keywords:
            if kw.arg in TOL_KEYWORDS:
                self.check(kw.value, f"{kw.arg}=")
        for index, name in POSITIONAL.get(_callee(node), {}).items():
            if index < len(node.args) and not any(kw.arg == name for kw in node.keywords):
                self.check(node.args[index], f"positional {name}")

    def _def(self, node) -> None:
        args = node.args
        positional = args.posonlyargs + args.args
        pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        for arg, default in pairs:
            if arg.arg in TOL_KEYWORDS:
                self.check(default, f"default {arg.arg}=")

    def _assert(self, node: ast.Assert) -> None:
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            operands = [compare.left, *compare.comparators]
            for op, left, right in zip(compare.ops, operands, operands[1:]):
                bound = right if isinstance(op, (ast.Lt, ast.LtE)) else left if isinstance(op, (ast.Gt, ast.GtE)) \
                    else None
                if bound is not None and any(isinstance(n, ast.Constant) and type(n.value) is float
                                             and 0 < abs(n.value) < SMALL for n in ast.walk(bound)):
                    self.check(bound, "assert bound")


def scan(source: str, filename: str = "<source>") -> list[str]:
    """'file:line: what' for every literal tolerance in `source` with neither a derivation nor a comment."""
    s = _Scan(source, filename)
    s.run()
    return [f"{filename}:{line}: {what}" for line, what in sorted(s.flagged.items())]


def test_every_tolerance_in_the_suite_is_derived_or_explained():
    flagged = []
    for name in sorted(os.listdir(TESTS)):
        if name.endswith(".py"):
            with open(os.path.join(TESTS, name), encoding="utf-8") as f:
                flagged += scan(f.read(), f"tests/{name}")
    assert not flagged, ("literal tolerances with neither a helper from tests/helpers.py nor a comment deriving "
                         "them (float32 error at the values' scale, terms summed, conditioning, margin):\n"
                         + "\n".join(flagged))


def test_the_scan_flags_an_undocumented_literal_and_passes_a_documented_or_derived_one():
    bare = "import numpy as np\n\ndef test_x(a, b):\n    np.testing.assert_allclose(a, b, rtol=1e-6)\n"
    assert scan(bare, "t.py") == ["t.py:4: rtol="]
    above = bare.replace("    np.testing", "    # 8 float32 terms summed: 8 * EPS32 with 2x margin\n    np.testing")
    assert scan(above) == []
    assert scan(bare.replace("1e-6)", "1e-6)  # one rounding of each operand, 4x margin")) == []
    assert scan(bare.replace("rtol=1e-6", "rtol=0")) == []  # exact
    assert scan("from helpers import EPS32\n" + bare.replace("rtol=1e-6", "rtol=4 * EPS32")) == []
    assert scan(bare.replace("1e-6)", "1e-6)  # noqa: E501")) == ["<source>:4: rtol="]  # a pragma is no derivation


def test_the_scan_finds_tolerances_in_every_form():
    src = """\
import math
import numpy as np
import pytest

TOL = 1e-5


def check(a, b, atol=1e-7):
    tol = 3e-4
    np.testing.assert_allclose(a, b, 1e-6)
    assert a == pytest.approx(b, abs=tol)
    assert math.isclose(a, b, rel_tol=TOL)
    assert abs(a - b) < 1e-6 and 2e-3 * b >= abs(a)
    assert abs(a - b) > 1e-3  # a lower bound: not a tolerance
    for bound in (1e-4, 0.0):
        assert np.allclose(a, b, atol=bound)
    np.testing.assert_allclose(a, b, rtol=0, atol=0)
"""
    assert [line.split(": ", 1)[0] for line in scan(src, "t.py")] == [
        "t.py:5", "t.py:8", "t.py:9", "t.py:10", "t.py:13", "t.py:15"]
