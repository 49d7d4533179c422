"""An op's blocks run side by side on its own threads (exactref/_parallel.py).

The results must not depend on how many threads ran them; the threads must
be as many as numpy's BLAS had when the op began (the user's setting); a
block's exception, or a KeyboardInterrupt, must stop the rest and come up in
the calling thread; numpy's error state must reach every block.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import threadpoolctl

import exactref as er
import exactref._parallel as parallel
import exactref._threads as threads


def blas_threads() -> list[int]:
    return [lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]


needs_blas = pytest.mark.skipif(not blas_threads(), reason="threadpoolctl sees no BLAS library in this process")


@pytest.fixture
def wide(monkeypatch):
    """Every op may use 4 threads, whatever this machine's BLAS pool."""
    monkeypatch.setattr(parallel, "width", lambda: 1 if getattr(parallel._local, "inside", False) else 4)


def _fields(res: er.Result) -> list[np.ndarray]:
    """Every array of every part of the judgement."""
    return [np.asarray(getattr(part, name), dtype=np.float64) for part in res._parts
            for name in ("rounded", "x_lo", "x_hi", "lo", "hi", "nan_ok", "special_ok", "tolerance")]


rng = np.random.default_rng(12)
CASES = {  # each large enough to be cut into several blocks
    "matmul float64": lambda: er.matmul(rng.standard_normal((700, 300)), rng.standard_normal((300, 600))),
    "matmul float32": lambda: er.matmul(rng.standard_normal((900, 64)).astype(np.float32),
                                        rng.standard_normal((64, 800)).astype(np.float32)),
    # Over 2**21 outputs: the tolerance, the widening of the inputs and the output's cast run in
    # blocks too (exactref._parallel.elementwise).
    "matmul float16, a large output": lambda: er.matmul(rng.standard_normal((1500, 8)).astype(np.float16),
                                                        rng.standard_normal((8, 1400)).astype(np.float16)),
    "matmul bfloat16, a large output": lambda: er.matmul(er.asarray(rng.standard_normal((1500, 8)), "bfloat16"),
                                                         er.asarray(rng.standard_normal((8, 1400)), "bfloat16")),
    "sum float32, one long row": lambda: er.sum(rng.standard_normal(9 * 10**6).astype(np.float32)),
    "sum float32, rows": lambda: er.sum(rng.standard_normal((64, 1 << 17)).astype(np.float32), axis=1),
    "sum float64, one long row": lambda: er.sum(rng.standard_normal(5 * 10**6) * 2.0 ** rng.integers(-30, 30, 5 * 10**6)),
    "sum float64, rows": lambda: er.sum(rng.standard_normal((40, 1 << 17)), axis=1),
}


def _serial_then_shared(monkeypatch, modules: list[str], run) -> None:
    """``run()`` on one thread, then with 4 threads through ``for_each`` (``modules``' own references to it,
    and for_each_slice's): the same arrays."""
    serial = run()
    calls: list[int] = []
    real = parallel.for_each

    def counting(fn, count):
        calls.append(count)
        return real(fn, count)
    monkeypatch.setattr(parallel, "width", lambda: 1 if getattr(parallel._local, "inside", False) else 4)
    monkeypatch.setattr(parallel, "for_each", counting)
    for module in modules:
        if hasattr(importlib.import_module(module), "for_each"):
            monkeypatch.setattr(f"{module}.for_each", counting)
    side_by_side = run()
    assert max(calls) > 1, "the case was meant to be cut into several blocks"
    for a, b in zip(serial, side_by_side, strict=True):
        np.testing.assert_array_equal(a, b)
        assert np.array_equal(np.signbit(a), np.signbit(b))


@pytest.mark.parametrize("case", list(CASES))
def test_results_do_not_depend_on_the_threads(case, monkeypatch):
    state = rng.bit_generator.state

    def run() -> list[np.ndarray]:
        rng.bit_generator.state = state  # the same draw both times
        return _fields(CASES[case]())
    _serial_then_shared(monkeypatch, ["exactref.engine.sumprod", "exactref.engine.fast"], run)


def test_blocks_run_on_several_threads_and_each_once(wide):
    seen: dict[int, int] = {}
    lock = threading.Lock()

    def block(i: int) -> None:
        time.sleep(0.01)  # long enough for the helpers to take some
        with lock:
            seen[i] = threading.get_ident()
    parallel.for_each(block, 12)
    assert sorted(seen) == list(range(12))
    assert len(set(seen.values())) > 1


@pytest.mark.parametrize("n, step", [(0, 4), (1, 4), (12, 4), (13, 4), (3, 1)])
def test_slices_cover_each_index_once(wide, n, step):
    seen: list[int] = []
    lock = threading.Lock()

    def block(cut: slice) -> None:
        time.sleep(0.002)
        with lock:
            seen.extend(range(n)[cut])
    parallel.for_each_slice(block, n, step)
    assert sorted(seen) == list(range(n))


def test_the_first_slice_alone_runs_first_on_the_calling_thread(wide):
    order: list[tuple[int, int]] = []

    def block(cut: slice) -> None:
        if cut.start:
            time.sleep(0.002)
        order.append((cut.start, threading.get_ident()))
    parallel.for_each_slice(block, 40, 5, first_alone=True)
    assert order[0] == (0, threading.get_ident())
    assert sorted(start for start, _ in order) == list(range(0, 40, 5))
    order.clear()
    parallel.for_each_slice(block, 0, 5, first_alone=True)  # one empty block, on this thread
    assert order == [(0, threading.get_ident())]


def test_a_block_inside_a_block_runs_serially(wide):
    inner: list[int] = []

    def block(i: int) -> None:
        assert parallel.width() == 1
        parallel.for_each(lambda j: inner.append(threading.get_ident()), 3)
    parallel.for_each(block, 4)
    assert len(inner) == 12


def test_a_blocks_exception_stops_the_rest_and_comes_up(wide):
    ran: list[int] = []

    def block(i: int) -> None:
        ran.append(i)
        time.sleep(0.005)
        if i == 2:
            raise ValueError("block 2")
    with pytest.raises(ValueError, match="block 2"):
        parallel.for_each(block, 200)
    assert len(ran) < 20  # the handing out stopped; the blocks started finished
    assert not any(t.name.startswith("exactref") and _busy(t) for t in threading.enumerate())


def _busy(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "_drain":
            return True
        frame = frame.f_back
    return False


def test_keyboard_interrupt_in_the_calling_thread_stops_the_helpers(wide):
    ran: list[int] = []
    main = threading.get_ident()

    def block(i: int) -> None:
        ran.append(i)
        time.sleep(0.005)
        if threading.get_ident() == main and len(ran) > 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        parallel.for_each(block, 500)
    count = len(ran)
    time.sleep(0.05)
    assert len(ran) == count < 50  # nothing runs after it came up


def test_numpy_error_state_reaches_every_block(wide):
    raised: list[bool] = []
    lock = threading.Lock()

    def block(i: int) -> None:
        time.sleep(0.005)
        try:
            np.array(1.0) / np.array(0.0)
            ok = False
        except FloatingPointError:
            ok = True
        with lock:
            raised.append(ok)
    with np.errstate(divide="raise"):
        parallel.for_each(block, 8)
    assert raised == [True] * 8


@needs_blas
def test_the_width_is_the_blas_pool_before_the_limit(monkeypatch):
    monkeypatch.setattr(threads, "_SMALL", -1)
    seen: list[int] = []
    M = np.ones((2, 2), dtype=np.float32)

    def spy(*args, **kwargs):
        seen.append(parallel.width())
        return real(*args, **kwargs)
    real = er.matmul._forward
    monkeypatch.setattr(er.matmul, "_forward", spy)
    for outer in (3, 1):
        with threadpoolctl.threadpool_limits(limits=outer, user_api="blas"):
            er.matmul(M, M)
    monkeypatch.setattr(threads, "_enabled", False)  # the limit switched off: BLAS threads itself
    with threadpoolctl.threadpool_limits(limits=3, user_api="blas"):
        er.matmul(M, M)
    assert seen == [3, 1, 1]
    assert parallel.width() == 1  # outside any op


@needs_blas
def test_a_small_op_and_another_thread_run_serially(monkeypatch):
    monkeypatch.setattr(threads, "_SMALL", 64)
    seen: dict[str, int] = {}
    real = er.matmul._forward
    M = np.ones((2, 2), dtype=np.float32)

    def spy(*args, **kwargs):
        seen.setdefault("small op", parallel.width())
        return real(*args, **kwargs)
    monkeypatch.setattr(er.matmul, "_forward", spy)
    with threadpoolctl.threadpool_limits(limits=3, user_api="blas"):
        er.matmul(M, M)
        with threads.own_threads():  # this thread holds the limit: another thread's op may not widen
            other = threading.Thread(target=lambda: seen.setdefault("other thread", parallel.width()))
            other.start()
            other.join()
            seen["owner"] = parallel.width()
    assert seen == {"small op": 1, "other thread": 1, "owner": 3}


# Run in a fresh interpreter: forking this test process, where JAX's threads may run, could itself
# deadlock the child.
_FORK_SCRIPT = """
import os, time
import exactref._parallel as parallel
parallel.width = lambda: 1 if getattr(parallel._local, "inside", False) else 4
parallel.for_each(lambda i: time.sleep(0.001), 6)  # the parent's pool exists
pid = os.fork()
if pid == 0:
    parallel.for_each(lambda i: time.sleep(0.001), 6)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_makes_its_own_threads():
    run = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["child", "exit", "0"]


def test_attention_does_not_depend_on_the_threads(monkeypatch):
    gen = np.random.default_rng(3)
    q, k, v, g = (gen.standard_normal((1, 2, 300, 16)).astype(np.float32) for _ in range(4))

    def run() -> list[np.ndarray]:
        res = er.scaled_dot_product_attention(q, k, v)
        grads = res.backward(g)
        return _fields(res) + [a for name in grads for a in _fields(grads[name])]
    _serial_then_shared(monkeypatch, [f"exactref.ops.attention.{m}" for m in ("_first", "_model", "_second")], run)


def test_elementwise_blocks_make_the_whole_arrays(wide):
    x = np.random.default_rng(3).standard_normal(5 * 419431)  # 2**21 + 3: 16 blocks and 3 values
    seen: list[int] = []

    def fn(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seen.append(v.size)
        return v * 2, v > 0
    doubled, positive = parallel.elementwise(fn, x.reshape(-1, 5))
    assert doubled.shape == positive.shape == (x.size // 5, 5) and positive.dtype == bool
    np.testing.assert_array_equal(doubled.reshape(-1), x * 2)
    np.testing.assert_array_equal(positive.reshape(-1), x > 0)
    # Cut into blocks, the last one short; a small array is passed whole.
    block = parallel._ELEMENTWISE_BLOCK
    assert sorted(seen) == [x.size % block] + [block] * (x.size // block)
    seen.clear()
    parallel.elementwise(fn, x[:100])
    assert seen == [100]


def test_the_blocked_copy_is_a_copy(wide):
    a = np.arange(5 * parallel._COPY_BLOCK + 7, dtype=np.float32).reshape(-1, 1)
    b = parallel.copy_array(a)
    assert b.shape == a.shape and b.dtype == a.dtype
    np.testing.assert_array_equal(a, b)
    a[-1] = -1.0  # the last, short block was copied too, and apart
    assert b[-1, 0] == 5 * parallel._COPY_BLOCK + 6


@pytest.mark.parametrize("where", [0, parallel._COPY_BLOCK + 3, -1])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_checked_copy_finds_one_bad_value_in_any_block(wide, where, bad):
    from exactref._convert import finite_values
    x = np.ones(3 * parallel._COPY_BLOCK + 5)
    y, ok = parallel.copy_checked(x, finite_values)
    assert ok and np.array_equal(x, y) and not np.shares_memory(x, y)
    x[where] = bad
    y, ok = parallel.copy_checked(x, finite_values)
    assert not ok and np.array_equal(x, y, equal_nan=True)
    small = x[-7:] if where == -1 else x[where:where + 7]
    assert not parallel.copy_checked(small, finite_values)[1]  # one block, copied whole


@pytest.mark.parametrize(("dtype", "known"), [("float32", True), ("float64", True), ("float16", False)])
def test_sum_s_own_copy_knows_whether_every_value_is_finite(wide, dtype, known):
    from exactref._convert import operand
    from exactref.ops.reduction import _own
    x = er.asarray(np.arange(6.0).reshape(2, 3), dtype)
    assert _own(operand(x, "x", copy=False), (0, 1))[0].finite is (True if known else None)
    x[1, 2] = np.inf
    o = _own(operand(x, "x", copy=False), (0, 1))[0]
    assert o.finite is (False if known else None) and not np.shares_memory(o.array, x)
    x[1, 2] = 0.0  # the operand holds its own copy
    assert o.array[1, 2] == np.inf
    assert operand(x, "x").finite is None  # not asked


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tensor_read_without_a_copy_of_its_own_is_still_copied_once(dtype):
    # The tensor's memory is read as a view; sum's operand array is the op's one copy of it.
    torch = pytest.importorskip("torch")
    from exactref._convert import operand
    from exactref.ops.reduction import _own
    t = torch.arange(6.0).reshape(2, 3).to(getattr(torch, dtype))
    o = _own(operand(t, "x", copy=False), (0, 1))[0]
    t[1, 2] = 100.0
    assert float(o.array[1, 2]) == 5.0 and o.finite is (True if dtype == "float32" else None)
    res = er.sum(t)  # 0 + 1 + 2 + 3 + 4 + 100
    t[0, 0] = 1000.0
    assert res.rounded == 110.0 and res.exact(()) == 110


@pytest.mark.parametrize("where", [0, 1 << 20, -1])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_blocked_finiteness_check_finds_one_bad_value(wide, where, bad):
    from exactref.ops.reduction import _all_finite
    x = np.ones(3 * (1 << 20) + 5, dtype=np.float32)
    assert _all_finite(x)
    x[where] = bad
    assert not _all_finite(x)
    assert er.sum(x).rounded != er.sum(np.ones_like(x)).rounded


@pytest.mark.parametrize("where", [0, 64 * 4096 - 1, -1])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_sum_enclosed_as_it_is_copied_finds_one_bad_value(where, bad):
    # A full float32 sum of whole groups of 64 values takes its enclosure from the op's own copy;
    # its sums of |x| tell whether every value is finite.
    x = np.ones(64 * 8192, dtype=np.float32)
    assert er.sum(x).rounded == x.size
    x[where] = bad
    res = er.sum(x)
    assert np.isnan(res.rounded) if np.isnan(bad) else res.rounded == bad
    if np.isinf(bad):
        x[3] = -bad  # inf + -inf
        assert np.isnan(er.sum(x).rounded)


def test_a_sum_enclosed_as_it_is_copied_keeps_its_own_copy():
    from exactref._convert import operand
    x = np.arange(64 * 2048, dtype=np.float32)
    o = operand(x, "x", copy=False)
    assert np.shares_memory(o.array, x)
    res = er.sum(x)
    x[:] = 0
    assert res.exact(()) == sum(range(64 * 2048)) and res.rounded == np.float32(sum(range(64 * 2048)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "complex64"])
@pytest.mark.parametrize("where", [None, 0, parallel._COPY_BLOCK + 3, -1])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_widened_values_know_whether_every_value_is_finite(wide, dtype, where, bad):
    # values_checked widens in blocks side by side, checking each block in cache; the imaginary
    # part of a complex value counts too (its largest value, by real part, can be finite).
    from exactref._convert import operand, values_checked, values_of
    from exactref.formats import FORMATS
    x = er.asarray(np.ones(3 * parallel._COPY_BLOCK + 5), dtype)
    if where is not None:
        x[where] = complex(1.0, bad) if dtype == "complex64" else bad
    fmt = FORMATS["complex128" if dtype == "complex64" else "float64"]
    o = operand(x, "x")
    values, finite = values_checked(o, fmt)
    assert finite is (where is None)
    assert values.dtype == values_of(o, fmt).dtype
    np.testing.assert_array_equal(values, values_of(o, fmt))
    # The same answers without blocks: a small array, and a view that is not C-contiguous.
    assert values_checked(operand(x[-9:], "x"), fmt)[1] is (where != -1)
    assert values_checked(operand(x[::2], "x"), fmt)[1] is (where is None or where % x.size % 2 == 1)


def test_a_blocked_matmul_sees_an_infinity_in_its_last_block(wide):
    # matmul learns finiteness as it widens its operands (values_checked): an inf in the last
    # block of A makes the normal answer's row inf or NaN, as numpy's own float64 product does.
    rng = np.random.default_rng(5)
    A = rng.standard_normal((1500, 8)).astype(np.float16)
    B = rng.standard_normal((8, 1400)).astype(np.float16)
    B[3, :7] = 0.0
    A[-1, 3] = np.inf
    res = er.matmul(A, B)
    expected = np.einsum("ik,kj->ij", A[-1:].astype(np.float64), B.astype(np.float64))[0]
    got = res.rounded[-1].astype(np.float64)
    assert np.isnan(expected[:7]).all() and np.isinf(expected[7:]).all()
    np.testing.assert_array_equal(got, expected)
    assert np.isfinite(res.rounded[:-1]).all()
    assert res.covers(np.asarray(res.rounded)).all()


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "complex64"])
@pytest.mark.parametrize("K", [3, 1024])  # A in one block, and (2048 x 1024) in blocks side by side
@pytest.mark.parametrize("op", ["matmul", "gemm"])
def test_matmul_reads_its_operands_once_into_values_of_its_own(wide, dtype, K, op):
    # matmul and gemm read A, B and C without a copy of their own first: the values the Result and
    # its backward keep are their own copies, so writing into the arrays after the call changes
    # neither the Result, nor its exact values, nor its later backward.
    rng = np.random.default_rng(5)
    side = 4 if K == 3 else 2048
    assert (side * K >= 2 * parallel._COPY_BLOCK) is (K > 3)
    shape_a, shape_b = (side, K), (K, 5)

    def draw(shape: tuple[int, ...]) -> np.ndarray:
        v = rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if dtype == "complex64" else 0)
        return er.asarray(v, dtype)
    A, B, C, G = draw(shape_a), draw(shape_b), draw((side, 5)), draw((side, 5))
    call = (lambda *xs: er.matmul(*xs[:2])) if op == "matmul" else (lambda *xs: er.gemm(*xs, alpha=2, beta=3))
    want = call(A.copy(), B.copy(), C.copy())
    want_grads = want.backward(G)
    res = call(A, B, C)
    for x in (A, B, C):
        x[...] = np.nan
    grads = res.backward(G)
    assert all(_same(a, b) for a, b in zip(_fields(res), _fields(want)))
    for index in [(0, 0), (side - 1, 4)]:
        assert res.exact(index) == want.exact(index)
    for name in want_grads:
        assert all(_same(a, b) for a, b in zip(_fields(grads[name]), _fields(want_grads[name]))), name
        assert grads[name].exact((0, 0)) == want_grads[name].exact((0, 0)), name


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
