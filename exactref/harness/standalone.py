"""Turning a regression case into a standalone pytest file: the inputs as code, no Hypothesis engine.

A ``suite`` case becomes a test that rebuilds the inputs from hex floats,
runs the kernel and judges it as the property suite did.  A ``test`` case
becomes a test that calls the repository test's body once with the saved
arguments (the test's module is imported, so whatever it imports is needed;
Hypothesis's search is not run).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .cases import SavedCase, flatten
from .config import DEFAULT_TIMEOUT

__all__ = ["check_kernel", "run_test_once", "standalone_test"]


def check_kernel(module: str, op: str, direction: str, inputs: Mapping[str, Any],
                 kwargs: Mapping[str, Any] | None = None, grad: Any = None, *, device: str = "cpu",
                 timeout: float | None = DEFAULT_TIMEOUT) -> None:
    """Run the ``op`` kernel of the kernel module ``module`` on one case and judge it as the property suite does.

    ``inputs`` holds the op's inputs by name, in call order (numpy arrays and
    Python scalars); ``kwargs`` its keywords; ``grad`` the output's gradient
    for ``direction="backward"``.  Raises the suite's failure (an
    OutOfToleranceError, SpecialValueError, ... naming the output) when the
    kernel is not covered; returns None when it is.  A kernel call that takes
    more than ``timeout`` seconds is a failure too (None: no limit).

    This is what the tests written by ``exactref to-pytest`` call.
    """
    from .judge import judge
    from .kernels import DIRECTIONS, load_kernels

    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} must be one of {DIRECTIONS}")
    kernels = load_kernels(module, device=device)
    if op not in kernels:
        raise ValueError(f"op={op!r}: the kernel module {module!r} has no such kernel; it has "
                         f"{', '.join(kernels) or 'none'}")
    judge(kernels[op], direction, dict(inputs), dict(kwargs or {}), grad, device=device, timeout=timeout)


def run_test_once(test: Callable[..., Any], arguments: Mapping[str, Any]) -> None:
    """Run the body of the Hypothesis test ``test`` once, on ``arguments``, without Hypothesis's search.

    ``arguments`` are the values the test's ``@given`` would draw, by name.
    This is what the tests ``exactref to-pytest`` writes from a repository
    test's case call, so that they depend on exactref's API only.
    """
    handle = getattr(test, "hypothesis", None)
    inner = getattr(handle, "inner_test", None)
    if inner is None:
        raise TypeError(f"test={test!r} is not a Hypothesis test (no @given): run_test_once runs the body of a "
                        "@given test once on the saved arguments")
    # The body Hypothesis would call, as plugins such as pytest-trio reach it (the documented handle).
    inner(**arguments)


def _code(encoded: Any, indent: str = "    ") -> str:
    """Python source that builds the value a case file stores."""
    if encoded is None or isinstance(encoded, (bool, int, str)):
        return repr(encoded)
    if "float" in encoded:
        return f"float.fromhex({encoded['float']!r})"
    if "complex" in encoded:
        re_, im = encoded["complex"]
        return f"complex(float.fromhex({re_!r}), float.fromhex({im!r}))"
    if "tuple" in encoded:
        items = [_code(v, indent) for v in encoded["tuple"]]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if "opcase" in encoded:
        c = encoded["opcase"]
        inputs = ", ".join(f"{k!r}: {_code(v, indent)}" for k, v in c["inputs"].items())
        kwargs = ", ".join(f"{k!r}: {_code(v, indent)}" for k, v in c["kwargs"].items())
        return f"OpCase({c['op']!r}, {{{inputs}}}, {{{kwargs}}}, {_code(c['grad'], indent)})"
    return _array_code(encoded)


def _array_code(encoded: dict[str, Any]) -> str:
    dtype, shape = encoded["dtype"], tuple(encoded["shape"])
    values = flatten(encoded["values"], len(shape))
    if dtype == "bool":
        return f"np.array({[bool(v) for v in values]!r}, dtype=bool).reshape({shape!r})"
    if dtype.startswith("complex"):
        items = ", ".join(f"({r!r}, {i!r})" for r, i in values)
        data = f"[complex(float.fromhex(r), float.fromhex(i)) for r, i in [{items}]]"
    else:
        data = f"[float.fromhex(h) for h in {values!r}]"
    return f"er.asarray(np.array({data}).reshape({shape!r}), {dtype!r})"


def _identifier(text: str) -> str:
    return re.sub(r"\W+", "_", text).strip("_").lower() or "case"


def standalone_test(saved: SavedCase, *, kernels: str | None = None, output: Path | None = None,
                    root: Path | None = None) -> str:
    """The source of a pytest file that replays ``saved`` without Hypothesis.

    ``kernels`` overrides the kernel module the case names; ``output`` (where
    the file will be written) and ``root`` (the repository root) let a
    ``test`` case find the test module it came from.
    """
    data = saved.data
    origin = saved.path.as_posix() if saved.path else "a regression case"
    header = [f'"""Regression case {saved.name}, as a standalone test.', "",
              f"Generated by `exactref to-pytest {origin}`.",
              f"First found by {data['test']}: {data.get('failure', '').split(':', 1)[0]}."]
    if saved.kind == "suite":
        return _suite_test(saved, header, kernels)
    return _repository_test(saved, header, output, root)


def _suite_test(saved: SavedCase, header: list[str], kernels: str | None) -> str:
    data = saved.data
    module = kernels or data["kernel"].split(":", 1)[0]
    case = data["case"]
    header += [f"It needs exactref and the kernel module {module}, not Hypothesis.", '"""', ""]
    lines = [*header, "import numpy as np", "", "import exactref as er",
             "from exactref.harness import check_kernel", "",
             "# The inputs exactly, as hex floats"]
    for name, value in case["inputs"].items():
        lines.append(f"{name} = {_code(value)}")
    keywords = ", ".join(f"{k!r}: {_code(v)}" for k, v in case["kwargs"].items())
    lines.append(f"KEYWORDS = {{{keywords}}}")
    lines.append(f"grad = {_code(case['grad'])}")
    inputs = ", ".join(f"{k!r}: {k}" for k in case["inputs"])
    name = _identifier(f"test_{data['op']}_{data['direction']}_{data['format']}_{saved.name.rsplit('-', 1)[-1]}")
    lines += ["", "", f"def {name}():",
              "    # Runs the kernel and judges every output as the property suite does; raises on a mismatch",
              f"    check_kernel({module!r}, {data['op']!r}, {data['direction']!r}, {{{inputs}}}, KEYWORDS, grad)",
              ""]
    return "\n".join(lines)


def _repository_test(saved: SavedCase, header: list[str], output: Path | None, root: Path | None) -> str:
    data = saved.data
    file, _, rest = data["test"].partition("::")
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file.replace("/", ".")
    parts = rest.split("[", 1)[0].split("::")
    here = (output.parent if output else Path.cwd()).resolve()
    relative = os.path.relpath((root or Path.cwd()).resolve(), here)
    header += [f"It calls the body of {data['test']} once with the saved arguments; Hypothesis's search",
               "does not run.", '"""', ""]
    lines = [*header, "import importlib", "import sys", "from pathlib import Path", "", "import numpy as np", "",
             "import exactref as er", "from exactref.harness import run_test_once", "from strategies import OpCase",
             "",
             f"sys.path.insert(0, str((Path(__file__).resolve().parent / {relative!r}).resolve()))",
             "", "# The arguments the test drew, exactly, as hex floats", "ARGUMENTS = {"]
    for name, value in data["arguments"].items():
        lines.append(f"    {name!r}: {_code(value, '        ')},")
    lines.append("}")
    name = _identifier(f"test_{parts[-1]}_{saved.name.rsplit('-', 1)[-1]}")
    lines += ["", "", f"def {name}():", f"    test = importlib.import_module({module!r})"]
    for part in parts:
        lines.append(f"    test = getattr(test, {part!r})")
    lines += ["    # The test's own body, once, without Hypothesis's search",
              "    run_test_once(test, ARGUMENTS)", ""]
    return "\n".join(lines)
