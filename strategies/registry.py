"""Which strategy draws each op's cases: the built-in one, or one a kernel repository registered.

A kernel repository puts its own strategies in a module of its own, either
calling :func:`register` at import time or defining a mapping
``EXACTREF_STRATEGIES = {"matmul": ..., ...}``, and loads it with
:func:`load_module` (the pytest plugin does this from configuration).
:func:`strategy_for` then hands out that strategy, with every drawn case
checked for the op's field names.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any, Union

from hypothesis import strategies as st

from .attention import scaled_dot_product_attention_inputs
from .case import OPS, OpCase, check_case
from .elementwise import add_inputs, multiply_inputs, sum_inputs
from .linalg import gemm_inputs, matmul_inputs
from .matrix_exp import matrix_exp_frechet_inputs, matrix_exp_inputs
from .scaled_matmul import scaled_matmul_inputs

__all__ = ["BUILTIN", "load_module", "register", "registered", "strategy_for", "unregister"]

Factory = Callable[..., st.SearchStrategy[OpCase]]
StrategyOrFactory = Union[st.SearchStrategy[OpCase], Factory]

#: The built-in ``<op>_inputs`` factory of every op.
BUILTIN: dict[str, Factory] = {
    "matmul": matmul_inputs,
    "gemm": gemm_inputs,
    "add": add_inputs,
    "multiply": multiply_inputs,
    "sum": sum_inputs,
    "scaled_dot_product_attention": scaled_dot_product_attention_inputs,
    "matrix_exp": matrix_exp_inputs,
    "matrix_exp_frechet": matrix_exp_frechet_inputs,
    "scaled_matmul": scaled_matmul_inputs,
}

# op -> (strategy or factory, where it came from)
_REGISTRY: dict[str, tuple[StrategyOrFactory, str]] = {}

#: The name of the mapping a strategy module may define instead of calling register().
MODULE_ATTRIBUTE = "EXACTREF_STRATEGIES"


def _check_op(op: Any, argument: str = "op") -> str:
    if not isinstance(op, str):
        raise TypeError(f"{argument}={op!r} must be an op name, one of: {', '.join(OPS)}")
    if op not in BUILTIN:
        raise ValueError(f"{argument}={op!r} is not an op; use one of: {', '.join(OPS)}")
    return op


def register(op: str, strategy: StrategyOrFactory, *, replace: bool = False, source: str | None = None) -> None:
    """Use ``strategy`` for ``op`` from now on.

    ``strategy`` is a Hypothesis strategy of :class:`OpCase`, or a factory
    that takes keyword options and returns one (as the built-in
    ``<op>_inputs`` functions do).  Registering an op twice is an error
    unless ``replace=True``.  ``source`` names where it came from in messages.

    >>> import strategies as sx
    >>> sx.register("matmul", lambda **kw: sx.matmul_inputs(dtypes=["float32"], **kw))
    >>> sx.registered()
    {'matmul': "register('matmul')"}
    >>> sx.unregister("matmul")
    """
    op = _check_op(op)
    if not (isinstance(strategy, st.SearchStrategy) or callable(strategy)):
        raise TypeError(f"strategy={strategy!r:.80} for {op} must be a Hypothesis strategy of OpCase, "
                        "or a function that takes keyword options and returns one")
    if op in _REGISTRY and not replace:
        raise ValueError(f"{op} already has a strategy, from {_REGISTRY[op][1]}; "
                         "pass replace=True to replace it, or call unregister first")
    _REGISTRY[op] = (strategy, source or f"register({op!r})")


def unregister(op: str) -> None:
    """Go back to the built-in strategy for ``op`` (no error if none was registered).

    >>> import strategies as sx
    >>> sx.register("sum", sx.sum_inputs(dtypes=["float16"]))
    >>> sx.unregister("sum")
    >>> sx.registered()
    {}
    """
    _REGISTRY.pop(_check_op(op), None)


def registered() -> dict[str, str]:
    """Each op that has a registered strategy, with where it came from.

    >>> registered()
    {}
    """
    return {op: source for op, (_, source) in _REGISTRY.items()}


def strategy_for(op: str, **options: Any) -> st.SearchStrategy[OpCase]:
    """The strategy of ``op``'s cases: a registered one if there is one, else the built-in.

    ``options`` go to the factory (for a registered strategy object there
    must be none).  Each drawn case is checked: a case of another op, or one
    with the wrong field names, raises an error naming the strategy's source.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10)
    ... @given(strategy_for("add", dtypes=["float16"]))
    ... def test_dtype(case):
    ...     assert case.op == "add" and case.x.dtype.name == "float16"
    >>> test_dtype()
    """
    op = _check_op(op)
    strategy, source = _REGISTRY.get(op, (BUILTIN[op], f"strategies.{op}_inputs"))
    if isinstance(strategy, st.SearchStrategy):
        if options:
            raise TypeError(f"the strategy for {op} from {source} is a strategy object, not a factory, "
                            f"so it takes no options; got {sorted(options)}")
        built = strategy
    else:
        try:
            built = strategy(**options)
        except TypeError as e:
            raise TypeError(f"the strategy factory for {op} from {source} rejected options "
                            f"{sorted(options)}: {e}") from e
        if not isinstance(built, st.SearchStrategy):
            raise TypeError(f"the strategy factory for {op} from {source} returned {built!r:.80}, "
                            "not a Hypothesis strategy")
    return built.map(functools.partial(check_case, op=op, source=f"the strategy from {source}"))


def load_module(name: str) -> list[str]:
    """Import the module ``name`` ("pkg.mod") and register the strategies it provides.

    The module may call :func:`register` when imported, or define
    ``EXACTREF_STRATEGIES``, a mapping from op name to strategy or factory;
    both register with the module as their source (a mapping entry replaces
    an earlier registration from the same module).  Returns the ops the
    module registered.

    >>> import strategies as sx
    >>> sx.load_module("strategies.no_such_module")
    Traceback (most recent call last):
    ...
    ImportError: could not import the strategy module 'strategies.no_such_module': ...
    """
    if not isinstance(name, str) or not name or name.startswith("."):
        raise ValueError(f"name={name!r} must be an absolute module name such as 'mykernels.strategies'")
    label = f"module {name!r}"
    before = dict(_REGISTRY)
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"could not import the strategy module {name!r}: {e}; check that it is "
                          "installed or on sys.path") from e
    except Exception as e:
        raise ImportError(f"the strategy module {name!r} raised {type(e).__name__} when imported: {e}") from e
    for op, entry in list(_REGISTRY.items()):
        if before.get(op) is not entry:
            _REGISTRY[op] = (entry[0], label)
    mapping = getattr(module, MODULE_ATTRIBUTE, None)
    if mapping is not None:
        if not isinstance(mapping, Mapping):
            raise TypeError(f"{name}.{MODULE_ATTRIBUTE} must be a dict from op name to strategy or factory, "
                            f"not {type(mapping).__name__}")
        for op, strategy in mapping.items():
            _check_op(op, argument=f"{name}.{MODULE_ATTRIBUTE} key")
            register(op, strategy, replace=_REGISTRY.get(op, (None, ""))[1] == label, source=label)
    return [op for op, (_, source) in _REGISTRY.items() if source == label]
