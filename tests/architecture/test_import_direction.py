"""Imports run one way: from the harness and the backends down to the judge's core.

The core (formats, rounding, errors, result and its report, input conversion,
``engine/``, ``models/`` and ``ops/``) must never import the harness, a
backend, the CLI or a test tool.  Two checks: every core module's import
statements, read statically (so a lazy import inside a function counts too),
and a fresh interpreter that imports exactref and calls every op, forward and
backward, then lists what was loaded.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "exactref"
# What the core may not reach: the harness, the backends, the CLI, and the test tools.
FORBIDDEN = ("exactref.harness", "exactref.backends", "exactref.cli", "strategies", "hypothesis", "pytest")
OUTSIDE_CORE = ("harness", "backends", "cli.py")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(source: str, name: str, is_package: bool) -> list[str]:
    """Every module an import statement in ``source`` names, relative imports resolved against ``name``."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from . import x" may import a submodule x: count both.
            found += [base] + [f"{base}.{a.name}" for a in node.names]
    return found


def violations(modules: dict[str, tuple[str, bool]]) -> list[str]:
    """'module imports target' for each forbidden import, from {name: (source, is_package)}."""
    out = []
    for name, (source, is_package) in sorted(modules.items()):
        for target in imported_names(source, name, is_package):
            if any(target == f or target.startswith(f + ".") for f in FORBIDDEN):
                out.append(f"{name} imports {target}")
    return out


def core_modules() -> dict[str, tuple[str, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in OUTSIDE_CORE:
            continue
        out[module_name(path)] = (path.read_text(encoding="utf-8"), path.name == "__init__.py")
    return out


def test_the_core_is_the_packages_we_think_it_is():
    names = core_modules()
    for expected in ("exactref", "exactref.formats", "exactref.rounding", "exactref.result", "exactref.models",
                     "exactref.engine.fast", "exactref.ops.matmul", "exactref.ops.attention.op",
                     "exactref.ops.matrix_exp.op"):
        assert expected in names
    assert not [n for n in names if n.startswith(("exactref.harness", "exactref.backends", "exactref.cli"))]


def test_no_core_module_imports_the_harness_a_backend_or_a_test_tool():
    assert violations(core_modules()) == []


@pytest.mark.parametrize("source, name, is_package, expected", [
    ("from ..harness import suite\n", "exactref.ops.matmul", False, ["exactref.ops.matmul imports exactref.harness",
                                                                    "exactref.ops.matmul imports exactref.harness.suite"]),
    ("def f():\n    from ...backends.torch import X\n", "exactref.ops.attention.op", False,
     ["exactref.ops.attention.op imports exactref.backends.torch",
      "exactref.ops.attention.op imports exactref.backends.torch.X"]),
    ("from . import cli\n", "exactref", True, ["exactref imports exactref.cli"]),
    ("import hypothesis.strategies as st\n", "exactref.models", True,
     ["exactref.models imports hypothesis.strategies"]),
    ("from .harnesses import x\nimport pytestish\n", "exactref.result", False, []),
    ("from .engine import fast\n", "exactref.result", False, []),
])
def test_the_checker_resolves_relative_and_lazy_imports(source, name, is_package, expected):
    assert violations({name: (source, is_package)}) == expected


_CALL_EVERY_OP = r"""
import json, sys
import numpy as np
import exactref as er

A = er.asarray(np.arange(1.0, 7.0).reshape(2, 3) / 8, "float32")
B = er.asarray(np.arange(1.0, 7.0).reshape(3, 2) / 4, "float32")
G = er.asarray(np.ones((2, 2)), "float32")
C = er.asarray(np.ones((2, 2)), "float32")
x = er.asarray([[1.5, -2.0], [0.25, 3.0]], "float16")
q = er.asarray(np.arange(8.0).reshape(1, 2, 4) / 16, "float32")
M = er.asarray([[0.5, 0.25], [-0.125, 0.75]], "float64")
calls = [
    (er.matmul, (A, B), {}, G),
    (er.gemm, (A, B, C), {"alpha": 2, "beta": 0.5}, G),
    (er.add, (x, x), {"alpha": 3}, x),
    (er.multiply, (x, x), {}, x),
    (er.sum, (x,), {"axis": 0}, er.asarray([1.0, 1.0], "float16")),
    (er.scaled_dot_product_attention, (q, q, q), {"is_causal": True}, q),
    (er.matrix_exp, (M,), {}, M),
]
for op, args, kw, grad in calls:
    res = op(*args, **kw)
    res.check(res.rounded)
    grads = op.backward(*args, grad, **kw)
    grads.check(**{name: g.rounded for name, g in grads.items()})
er.matrix_exp_frechet(M, M).check(er.matrix_exp_frechet(M, M).rounded)
print(json.dumps(sorted(sys.modules)))
"""


def test_importing_exactref_and_calling_every_op_loads_no_harness_backend_or_test_tool():
    run = subprocess.run([sys.executable, "-c", _CALL_EVERY_OP], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    loaded = json.loads(run.stdout.splitlines()[-1])
    assert "exactref.ops.attention.op" in loaded and "exactref.ops.matrix_exp.op" in loaded
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert bad == []
