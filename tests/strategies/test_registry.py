"""The registry: built-in strategies by default, registered ones on request, clear errors."""

import sys
import textwrap

import pytest
from hypothesis import strategies as st

import strategies as sx

from ._collect import each


@pytest.fixture(autouse=True)
def clean_registry():
    yield
    for op in list(sx.registered()):
        sx.unregister(op)


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("kernels_")]:
        del sys.modules[name]


def write(directory, name, source):
    (directory / f"{name}.py").write_text(textwrap.dedent(source))


def test_builtin_strategy_by_default_with_options():
    seen = []
    each(sx.strategy_for("sum", dtypes=["float16"], max_dims=1), 10, lambda c: seen.append(c))
    assert seen and all(c.op == "sum" and c.x.dtype.name == "float16" and c.x.ndim <= 1 for c in seen)


def test_a_registered_factory_gets_the_options():
    got = {}

    def factory(**options):
        got.update(options)
        return sx.matmul_inputs(dtypes=["float64"], **options)

    sx.register("matmul", factory)
    each(sx.strategy_for("matmul", max_side=2), 5, lambda c: None)
    assert got == {"max_side": 2}
    assert sx.registered() == {"matmul": "register('matmul')"}


def test_a_registered_strategy_object_takes_no_options():
    sx.register("add", sx.add_inputs(dtypes=["float32"]))
    each(sx.strategy_for("add"), 5, lambda c: None)
    with pytest.raises(TypeError, match="strategy object, not a factory, so it takes no options"):
        sx.strategy_for("add", max_side=2)


def test_registering_twice_needs_replace():
    sx.register("sum", sx.sum_inputs())
    with pytest.raises(ValueError, match="already has a strategy, from register\\('sum'\\); pass replace=True"):
        sx.register("sum", sx.sum_inputs())
    sx.register("sum", sx.sum_inputs(max_side=2), replace=True)


@pytest.mark.parametrize("op, error, message", [
    ("mul", ValueError, "op='mul' is not an op; use one of: matmul, gemm"),
    (3, TypeError, "op=3 must be an op name"),
])
def test_unknown_ops_are_refused(op, error, message):
    with pytest.raises(error, match=message):
        sx.strategy_for(op)
    with pytest.raises(error, match=message):
        sx.register(op, sx.sum_inputs())


def test_a_non_strategy_is_refused():
    with pytest.raises(TypeError, match="must be a Hypothesis strategy of OpCase, or a function"):
        sx.register("sum", 42)


def test_a_strategy_drawing_wrong_cases_fails_at_draw_with_its_source():
    sx.register("gemm", st.just(sx.OpCase("matmul", {"A": 1, "B": 1}, {}, 1)))
    with pytest.raises(ValueError, match="the strategy from register\\('gemm'\\) for gemm drew a case for matmul"):
        each(sx.strategy_for("gemm"), 3, lambda c: None)
    sx.register("sum", st.just("not a case"), replace=True)
    with pytest.raises(TypeError, match="drew str 'not a case'; it must draw OpCase\\(op='sum'"):
        each(sx.strategy_for("sum"), 3, lambda c: None)


def test_a_factory_that_rejects_options_or_returns_junk_is_named():
    sx.register("sum", lambda: sx.sum_inputs())
    with pytest.raises(TypeError, match="factory for sum from register\\('sum'\\) rejected options \\['max_side'\\]"):
        sx.strategy_for("sum", max_side=3)
    sx.register("sum", lambda **kw: 7, replace=True)
    with pytest.raises(TypeError, match="returned 7, not a Hypothesis strategy"):
        sx.strategy_for("sum")


def test_load_module_registers_by_call_and_by_mapping(module_dir):
    write(module_dir, "kernels_calls", """
        import strategies as sx
        sx.register("matmul", lambda **kw: sx.matmul_inputs(dtypes=["float32"], **kw))
    """)
    write(module_dir, "kernels_mapping", """
        import strategies as sx
        EXACTREF_STRATEGIES = {"add": sx.add_inputs(dtypes=["bfloat16"]), "sum": sx.sum_inputs}
    """)
    assert sx.load_module("kernels_calls") == ["matmul"]
    assert sx.load_module("kernels_mapping") == ["add", "sum"]
    assert sx.registered() == {"matmul": "module 'kernels_calls'", "add": "module 'kernels_mapping'",
                               "sum": "module 'kernels_mapping'"}
    # Loading again is harmless.
    assert sx.load_module("kernels_mapping") == ["add", "sum"]
    each(sx.strategy_for("add"), 5, lambda c: None)


def test_load_module_errors_are_clear(module_dir):
    with pytest.raises(ImportError, match="could not import the strategy module 'kernels_missing'"):
        sx.load_module("kernels_missing")
    write(module_dir, "kernels_broken", "raise RuntimeError('no GPU here')\n")
    with pytest.raises(ImportError, match="'kernels_broken' raised RuntimeError when imported: no GPU here"):
        sx.load_module("kernels_broken")
    write(module_dir, "kernels_badmap", "EXACTREF_STRATEGIES = {'conv': None}\n")
    with pytest.raises(ValueError, match="kernels_badmap.EXACTREF_STRATEGIES key='conv' is not an op"):
        sx.load_module("kernels_badmap")
    with pytest.raises(ValueError, match="must be an absolute module name"):
        sx.load_module(".relative")


def test_two_modules_for_one_op_conflict(module_dir):
    write(module_dir, "kernels_a", "import strategies as sx\nEXACTREF_STRATEGIES = {'sum': sx.sum_inputs}\n")
    write(module_dir, "kernels_b", "import strategies as sx\nEXACTREF_STRATEGIES = {'sum': sx.sum_inputs}\n")
    sx.load_module("kernels_a")
    with pytest.raises(ValueError, match="sum already has a strategy, from module 'kernels_a'"):
        sx.load_module("kernels_b")
