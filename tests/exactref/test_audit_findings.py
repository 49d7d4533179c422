"""False alarms that ``exactref audit`` found on PyTorch's CPU kernels, shrunk and kept as regressions.

Each case runs PyTorch, checks that PyTorch really does the surprising thing,
and then that exactref covers it; a twin case checks that the leniency stays
narrow, so that a kernel doing the same thing where PyTorch does not is still
rejected.
"""

from __future__ import annotations

import numpy as np
import pytest

import exactref as er

torch = pytest.importorskip("torch")
INF = float("inf")


def _dtype(name: str):
    return getattr(torch, name)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_add_alpha_that_vanishes_in_the_tensor_format_times_inf_is_nan(dtype):
    # add converts alpha to the tensor's dtype: 2^-454 is 0 there, and 0 * inf is NaN.
    alpha = float.fromhex("0x1.31184054876b2p-454")
    x, y = torch.zeros((), dtype=_dtype(dtype)), torch.full((), INF, dtype=_dtype(dtype))
    out = torch.add(x, y, alpha=alpha)
    assert torch.isnan(out)
    assert er.add(x, y, alpha=alpha).covers(out).all()


def test_add_alpha_that_survives_in_float32_times_inf_is_still_inf():
    x, y = torch.zeros(()), torch.full((), INF)
    res = er.add(x, y, alpha=1e-9)
    assert torch.isinf(torch.add(x, y, alpha=1e-9))
    assert not res.covers(torch.tensor(float("nan"))).any()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_add_grad_y_with_a_vanishing_alpha_times_an_infinite_grad_is_nan(dtype):
    # Autograd multiplies grad by alpha in opmath (float32 here): 2^-1022 * 0.1 is 0 there.
    alpha = float.fromhex("0x0.199999999999ap-1022")
    x, y = (torch.zeros((), dtype=_dtype(dtype), requires_grad=True) for _ in range(2))
    grad = torch.full((), INF, dtype=_dtype(dtype))
    torch.add(x, y, alpha=alpha).backward(grad)
    assert torch.isnan(y.grad)
    g = er.add.backward(x.detach(), y.detach(), grad, alpha=alpha)
    assert g["grad_y"].covers(y.grad).all()
    assert g["grad_x"].covers(x.grad).all()
    # float16 grad with alpha = 1e-9: zero in float16 but not in float32, where autograd multiplies.
    if dtype == "float16":
        y2 = torch.zeros((), dtype=torch.float16, requires_grad=True)
        torch.add(x.detach(), y2, alpha=1e-9).backward(grad)
        assert torch.isinf(y2.grad)
        g2 = er.add.backward(x.detach(), y2.detach(), grad, alpha=1e-9)
        assert g2["grad_y"].covers(y2.grad).all()
        assert not g2["grad_y"].covers(torch.tensor(float("nan"), dtype=torch.float16)).any()


def test_float16_add_whose_alpha_times_y_overflows_before_the_addition():
    # PyTorch's CPU add rounds alpha * y to float16 first: -3 * 21840 = -65520 is -inf there,
    # although 33 + (-65520) = -65487 rounds to -65504.
    x, y = torch.full((3,), 33.0, dtype=torch.float16), torch.full((3,), 21840.0, dtype=torch.float16)
    out = torch.add(x, y, alpha=-3.0)
    assert torch.isinf(out).all()
    assert er.add(x, y, alpha=-3.0).covers(out).all()
    # Where alpha * y is far from overflowing, an infinite result is still wrong.
    small = torch.full((3,), 2000.0, dtype=torch.float16)
    assert not er.add(x, small, alpha=-3.0).covers(torch.full((3,), -INF, dtype=torch.float16)).any()


def _gemm_run(A, B, C, grad, alpha, beta):
    leaves = [t.clone().requires_grad_() for t in (A, B, C)]
    out = torch.addmm(leaves[2], leaves[0], leaves[1], alpha=alpha, beta=beta)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("which", ["grad_A", "grad_B", "grad_C"])
def test_gemm_backward_with_a_vanishing_coefficient_times_an_infinite_grad_is_nan(which):
    tiny = float.fromhex("0x1.04025e2fb2735p-376")
    one, zero = torch.ones(1, 1), torch.zeros(1, 1)
    A, B = (one, zero) if which == "grad_B" else (zero, one)
    alpha, beta = (0.0, tiny) if which == "grad_C" else (tiny, 1.0)
    grad = torch.full((1, 1), INF)
    _, grads = _gemm_run(A, B, torch.zeros(()), grad, alpha, beta)
    got = dict(zip(("grad_A", "grad_B", "grad_C"), grads, strict=True))
    assert torch.isnan(got[which]).all()
    g = er.gemm.backward(A, B, torch.zeros(()), grad, alpha=alpha, beta=beta)
    for name, value in got.items():
        assert g[name].covers(value).all(), name


@pytest.mark.parametrize("dtype", ["float32", "complex64"])
def test_blas_gemm_skips_a_product_whose_alpha_vanishes(dtype):
    # A 2-D float32 addmm goes to a BLAS, which reads alpha as a float32 0 and never forms A @ B.
    A, B, C = torch.full((1, 1), INF, dtype=_dtype(dtype)), torch.ones(1, 1, dtype=_dtype(dtype)), \
        torch.zeros(1, 1, dtype=_dtype(dtype))
    out = torch.addmm(C, A, B, alpha=1e-50)
    assert (out == 0).all()
    assert er.gemm(A, B, C, alpha=1e-50).covers(out).all()
    # A finite product still counts through the tolerance, however small alpha is.
    A2 = torch.full((1, 1), 3.0e38)
    res = er.gemm(A2, torch.full((1, 1), 3.0e38), torch.zeros(1, 1), alpha=1e-50)
    assert res.covers(torch.addmm(torch.zeros(1, 1), A2, torch.full((1, 1), 3.0e38), alpha=1e-50)).all()
    assert res.covers(torch.tensor([[float(np.float32(9e26))]])).all()


def test_attention_backward_whose_masked_logit_overflows():
    # The math path adds the causal mask as -inf: a masked logit that overflowed to +inf becomes
    # NaN, and so do the output and every gradient.
    q = torch.tensor([[32.0]])
    k = torch.tensor([[1.0], [float(np.finfo(np.float32).max)]])
    v, grad = torch.zeros(2, 1), torch.zeros(1, 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.125)
    out.backward(grad)
    assert torch.isnan(out).all() and torch.isnan(leaves[0].grad).all()
    assert er.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125).covers(out.detach()).all()
    g = er.scaled_dot_product_attention.backward(q, k, v, grad, is_causal=True, scale=0.125)
    for name, t in zip(("grad_query", "grad_key", "grad_value"), leaves, strict=True):
        assert g[name].covers(t.grad).all(), name
    # Without the overflow the row is an ordinary one, and NaN is wrong.
    k_small = torch.tensor([[1.0], [2.0]])
    assert not er.scaled_dot_product_attention(q, k_small, v, is_causal=True, scale=0.125).covers(
        torch.full((1, 1), float("nan"))).any()


def test_attention_backward_where_a_weight_underflows_against_a_huge_dp():
    # bfloat16 runs in float32: the second weight, e^-170, underflows to 0 there, so dS = P (dP - D)
    # loses P * 3.4e38 ~ 5e-36 exactly; the model budgets a weight's underflow times |dP - D|.
    bf = torch.bfloat16
    q = torch.tensor([[16.0, 0.0]], dtype=bf)
    k = torch.tensor([[16.0, 0.0], [1.0, 1.0]], dtype=bf)
    v = torch.tensor([[float.fromhex("0x1.fep+127")], [0.0]], dtype=bf)
    grad = torch.ones(1, 1, dtype=bf)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves).backward(grad)
    assert leaves[0].grad[0, 1] == 0
    for algorithm in (er.AttentionAlgorithm.MATH, er.AttentionAlgorithm.FLASH_ATTENTION):
        g = er.scaled_dot_product_attention.backward(q, k, v, grad, algorithm=algorithm)
        assert g["grad_query"].rounded[0, 1] != 0
        for name, t in zip(("grad_query", "grad_key", "grad_value"), leaves, strict=True):
            assert g[name].covers(t.grad).all(), (algorithm, name)


def test_attention_backward_where_the_math_paths_scaled_key_underflows_against_a_huge_ds():
    # The math path multiplies K by sqrt(scale) = 2**-0.25 in float32: the subnormal 2**-149 stays
    # 2**-149 (0.84 of it rounds up), which is 19% off, and dS ~ 8.5e37 multiplies it in
    # grad_query = sqrt(s) dS (K sqrt(s)).  Found by `exactref audit` (seed 1884206864).
    q = torch.zeros(1, 2)
    k = torch.tensor([[2.0 ** -149, 0.0], [0.0, 0.0]])
    v = torch.tensor([[0.0], [1.0]])
    grad = torch.full((1, 1), float.fromhex("0x1.fffffep+127"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves).backward(grad)
    got = leaves[0].grad
    g = er.scaled_dot_product_attention.backward(q, k, v, grad)
    exact = float(g["grad_query"].rounded[0, 0])
    assert abs(float(got[0, 0]) / exact - 2 ** -0.25 * 2 ** 0.5) < 1e-6  # (the surprising thing)
    for name, t in zip(("grad_query", "grad_key", "grad_value"), leaves, strict=True):
        assert g[name].covers(t.grad).all(), name
    # k = 2**-126 is normal, but k sqrt(s) is not: a kernel that flushes subnormals to zero (as
    # float32 on a GPU may) multiplies dS by 0 there, and returns 0 where the exact value is -0.71.
    k_ftz = torch.tensor([[2.0 ** -126, 0.0], [0.0, 0.0]])
    g_ftz = er.scaled_dot_product_attention.backward(q, k_ftz, v, grad)
    assert g_ftz["grad_query"].rounded[0, 0] < -0.7
    assert g_ftz["grad_query"].covers(np.zeros((1, 2), np.float32)).all()
    # Its twin, with k a normal number: nothing underflows, and the same 19% is rejected.
    k2 = torch.tensor([[2.0 ** -100, 0.0], [0.0, 0.0]])
    g2 = er.scaled_dot_product_attention.backward(q, k2, v, grad)
    off = g2["grad_query"].rounded.copy()
    off[0, 0] = np.float32(off[0, 0] * 2 ** 0.25)
    assert off[0, 0] != 0 and not g2["grad_query"].covers(off)[0, 0]


def test_attention_backward_whose_bounds_have_no_finite_value_keeps_them_infinite():
    # A subnormal v and a zero grad: the bound on |dS~| is not finite here, and the underflow term
    # of the scaled operands (the test above) must not turn E into NaN, which accepts nothing.
    q, k, grad = (torch.zeros(1, 1, dtype=torch.float64) for _ in range(3))
    v = torch.full((1, 1), 5e-324, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves).backward(grad)
    g = er.scaled_dot_product_attention.backward(q, k, v, grad)
    for name, t in zip(("grad_query", "grad_key", "grad_value"), leaves, strict=True):
        assert not np.isnan(g[name].tolerance).any(), name
        assert g[name].covers(t.grad).all(), name


def test_float64_attention_beside_a_key_whose_logit_is_huge():
    # Key 1's logit, -1.75 * 2**49, underflows its weight to 0, but its float64 rounding bound is
    # a third of a nat: the first pass's row-wise weight bound went negative, so the weights' upper
    # bound was ~1e-323 and the tolerance of the weight on key 2 (about 0.012) was 2 ulps. The math
    # path is 3 ulps from the correctly rounded value, as any kernel may be after its logit's rounding.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    f = float.fromhex
    q = torch.tensor([[f("-0x1.cp+0")], [0.0]], dtype=torch.float64)
    k = torch.tensor([[f("-0x1.42b6a5be2335cp+1")], [f("0x1p+49")], [0.0]], dtype=torch.float64)
    v = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    with sdpa_kernel(SDPBackend.MATH):
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    res = er.scaled_dot_product_attention(q, k, v)
    exact = float.fromhex("0x1.88b3e3604669dp-7")
    assert res.rounded[0, 0] == exact and got[0, 0].item() == float.fromhex("0x1.88b3e360466a0p-7")
    assert res.covers(got).all()
    # Still narrow: the weight's tolerance is that of an ordinary row, not the logit's third of a nat.
    assert res.tolerance[0, 0] < 2.0 ** -40 * exact
    off = got.clone()
    off[0, 0] = exact * (1 + 2.0 ** -40)
    assert not res.covers(off)[0, 0]


def test_cpu_fused_attention_swallows_a_nan_logit_and_exactref_says_so():
    # A PyTorch 2.13 bug, not exactref's: the CPU fused kernel takes the NaN logit of an attended
    # key for a masked one and returns 0, where the math path (exactref's normal answer) gives NaN.
    # `exactref audit` therefore runs attention on non-finite inputs through the math path.
    q, k = torch.zeros(1, 1, 1, 1), torch.tensor([[[[float("nan")], [0.0]]]])
    v = torch.zeros(1, 1, 2, 1)
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert "Flash" in type(torch.nn.functional.scaled_dot_product_attention(
        q.requires_grad_(), k, v, is_causal=True).grad_fn).__name__
    assert fused.item() == 0
    res = er.scaled_dot_product_attention(q.detach(), k, v, is_causal=True)
    assert np.isnan(res.normal).all() and not res.covers(fused).any()
    from exactref.backends.torch import EXACTREF_KERNELS

    audited = EXACTREF_KERNELS("cpu")["scaled_dot_product_attention"]["forward"](q.detach(), k, v, is_causal=True)
    assert torch.isnan(audited).all() and res.covers(audited).all()


def test_cpu_fused_attention_backward_of_an_infinite_grad_and_exactref_says_so():
    # Found by `exactref audit` (seed 2716312366): with dO = inf and values -2 and 1, the CPU fused
    # backward's D = rowsum(dO * O) is -inf, where the math path's sum_j P_j dP_j is -inf + inf = NaN,
    # so its grad_key is inf for the key of value 1 where the math path (exactref's normal answer)
    # gives NaN.  The audited backward therefore takes the math path where the grad holds NaN or inf.
    from exactref.backends.torch import EXACTREF_KERNELS

    q, k, v = torch.ones(1, 1, 1, 1), torch.zeros(1, 1, 2, 1), torch.tensor([[[[-2.0], [1.0]]]])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves)
    assert "Flash" in type(out.grad_fn).__name__
    out.backward(torch.full((1, 1, 1, 1), INF))
    fused_key = leaves[1].grad
    assert torch.isnan(fused_key[0, 0, 0]).all() and fused_key[0, 0, 1].item() == INF
    grads = er.scaled_dot_product_attention(q, k, v).backward(torch.full((1, 1, 1, 1), INF))
    assert np.isnan(grads["grad_key"].normal).all() and not grads["grad_key"].covers(fused_key)[0, 0, 1].any()
    audited = EXACTREF_KERNELS("cpu")["scaled_dot_product_attention"]["backward"](q, k, v, torch.full((1, 1, 1, 1), INF))
    assert torch.isnan(audited["grad_key"]).all()
    for name, got in audited.items():
        assert grads[name].covers(got).all(), name
    # A finite grad still goes through the kernel dispatch picks, bit for bit.
    g = torch.tensor([[[[0.75]]]])
    fused = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*fused).backward(g)
    again = EXACTREF_KERNELS("cpu")["scaled_dot_product_attention"]["backward"](q, k, v, g)
    assert all(torch.equal(again[f"grad_{n}"], t.grad) for n, t in zip(("query", "key", "value"), fused))


def test_float64_matrix_exp_whose_entry_is_a_rounded_subnormal():
    # Half a float64 subnormal spacing is 0 in float64 itself: the model's underflow term had vanished,
    # leaving a tolerance of 0 on an entry that PyTorch rounds among the subnormals.
    A = np.zeros((3, 3, 3))
    A[2, 0, 2], A[2, 1, 0] = float.fromhex("0x1p-52"), float.fromhex("0x1.cdb2dc4acf572p-1018")
    got = torch.linalg.matrix_exp(torch.from_numpy(A))
    res = er.matrix_exp(A)
    assert got[2, 1, 2].item() != res.rounded[2, 1, 2]
    assert res.covers(got).all()
    assert res.tolerance[2, 1, 2] < 1e-320


def test_complex_scalars_whose_modulus_overflows():
    # abs() of such a Python complex raises OverflowError; the ops must not.
    x, y = np.array([1 + 1j]), complex(1.5e308, 1.5e308)
    xt = torch.tensor(x, requires_grad=True)
    out = torch.mul(xt, y)
    out.backward(torch.tensor([1 + 0j]))
    assert er.multiply(x, y).covers(out.detach()).all()
    assert er.multiply.backward(x, y, np.array([1 + 0j]))["grad_x"].covers(xt.grad).all()
    assert er.add(x, x, alpha=y).covers(torch.add(torch.tensor(x), torch.tensor(x), alpha=y)).all()


def test_complex_gemm_where_an_overflowing_product_meets_an_infinity():
    # 1.8e308 * -1.3e90 overflows in the same sum as a product with an infinite part: the BLAS
    # gives +inf where the textbook formula gives NaN; either is a correct evaluation.
    h = float.fromhex
    A = np.array([[complex(1.0, 0.0), complex(h("0x1.fffffffffffffp+1023"), -746.0)]])
    B = np.array([[complex(1.0, 0.0)], [complex(-h("0x1.28418ee381cc3p+301"), INF)]])
    C = np.zeros((1, 1), dtype=complex)
    alpha = complex(-0.14, -1.84)
    out = torch.addmm(torch.tensor(C), torch.tensor(A), torch.tensor(B), alpha=alpha, beta=0.0)
    res = er.gemm(A, B, C, alpha=alpha, beta=0.0)
    assert res.covers(out).all()
    for got in (complex(INF, INF), complex(float("nan"), -INF), complex(-INF, float("nan"))):
        assert res.covers(np.array([[got]])).all(), got
    # Without the overflowing product only the special values the formula can give are accepted.
    small = A.copy()
    small[0, 1] = complex(3.0, -746.0)
    res_small = er.gemm(small, B, C, alpha=alpha, beta=0.0)
    assert not res_small.covers(np.array([[complex(1.0, 1.0)]])).any()


def test_complex_beta_whose_small_part_rounds_in_float32():
    # beta's imaginary part is 78% of |beta|; its own rounding to float32, times C's imaginary part,
    # is the error that counts, more than the error relative to |beta| suggests.
    h = float.fromhex
    A = B = np.zeros((1, 1), np.complex64)
    C = np.array(complex(0, h("0x1.1a399ap+55")), np.complex64)
    beta = complex(2.0, h("0x1.4360fe8977484p+1"))
    out = torch.addmm(torch.tensor(C), torch.tensor(A), torch.tensor(B), alpha=0.0, beta=beta)
    assert er.gemm(A, B, C, alpha=0.0, beta=beta).covers(out).all()
    # A beta with one part below float32's range still uses C (only a beta that is 0 entirely skips it).
    tiny_part = complex(1.0, 1e-60)
    res = er.gemm(A, B, C, alpha=0.0, beta=tiny_part)
    assert res.covers(torch.addmm(torch.tensor(C), torch.tensor(A), torch.tensor(B), alpha=0.0,
                                  beta=tiny_part)).all()
    assert res.rounded[0, 0] != 0


def test_complex_beta_times_c_alone_is_two_products_and_a_sum():
    # alpha = 0 leaves beta * C, whose imaginary part br ci + bi cr rounds twice in complex128.
    h = float.fromhex
    A = B = np.zeros((1, 1), np.complex128)
    C = np.array(complex(1.0, -h("0x1.065b5245acfb6p+55")))
    beta = complex(2.5, 1.0)
    out = torch.addmm(torch.tensor(C), torch.tensor(A), torch.tensor(B), alpha=0.0, beta=beta)
    res = er.gemm(A, B, C, alpha=0.0, beta=beta)
    assert out.imag.item() != res.rounded.imag[0, 0]
    assert res.covers(out).all()
    assert not res.covers(np.array([[complex(out.real.item(), out.imag.item() - 64)]])).any()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_gemm_reads_beta_in_float32(dtype):
    # CI's audit, seed 3070579008: beta = 3.4e-44 is 0 in bfloat16 (and float16) but a float32
    # subnormal, and PyTorch's CPU kernel for half types reads its scalars in float32: C is read,
    # and its NaN gives NaN.  A beta that is 0 in float32 too skips C.
    A, B, C = torch.zeros(1, 1, dtype=_dtype(dtype)), torch.zeros(1, 1, dtype=_dtype(dtype)), \
        torch.tensor(float("nan"), dtype=_dtype(dtype))
    beta = float.fromhex("0x1.859d466a27432p-145")
    got = torch.addmm(C, A, B, beta=beta)
    assert torch.isnan(got).all()
    assert er.gemm(A, B, C, beta=beta).covers(got).all()
    skipped = torch.addmm(C, A, B, beta=1e-50)
    assert (skipped == 0).all()
    res = er.gemm(A, B, C, beta=1e-50)
    assert res.covers(skipped).all() and not res.covers(got).any()


def _attention_grads(q, k, v, grad, scale):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, scale=scale).backward(grad)
    return leaves[0].grad, leaves[1].grad


def test_fused_attention_gradient_that_overflows_before_its_scale():
    # CI's audit, seed 3070579008: PyTorch's CPU fused kernel adds grad_attn @ K in a gemm whose
    # alpha is s = 1/8; a gemm may apply alpha after its sums.  With v near bfloat16's largest value
    # its grad_query is inf where the exact value is 1.27e38 (dS K is 1.02e39).
    bf = torch.bfloat16
    q = torch.tensor([[32.0], [0.0]], dtype=bf)
    grad = torch.full((2, 1), 0.375, dtype=bf)

    def exact(v: float):
        return er.scaled_dot_product_attention.backward(q, q, torch.tensor([[v], [0.0]], dtype=bf), grad,
                                                        scale=0.125, algorithm=er.AttentionAlgorithm.FLASH_ATTENTION)
    g_q, g_k = _attention_grads(q, q, torch.tensor([[float.fromhex("0x1.fep+127")], [0.0]], dtype=bf), grad, 0.125)
    assert torch.isinf(g_q[1]).all()
    g = exact(float.fromhex("0x1.fep+127"))
    assert g["grad_query"].covers(g_q).all() and g["grad_key"].covers(g_k).all()
    # v = 1.22e38: dS K, 3.7e38, is past float32's range too (PyTorch's own gemm stays finite here),
    # while even a rank-one bound on the scaled gradient stays below half of it.
    v = float.fromhex("0x1.7p+126")
    g_q, _ = _attention_grads(q, q, torch.tensor([[v], [0.0]], dtype=bf), grad, 0.125)
    g = exact(v)
    assert g["grad_query"].covers(g_q).all()
    assert g["grad_query"].covers(torch.full_like(g_q, INF))[1].all()
    # The twin: v 2**100 keeps dS K far inside float32, and an inf there is wrong.
    v_small = torch.tensor([[2.0 ** 100], [0.0]], dtype=bf)
    g_q, _ = _attention_grads(q, q, v_small, grad, 0.125)
    assert torch.isfinite(g_q).all()
    g = exact(2.0 ** 100)
    assert g["grad_query"].covers(g_q).all()
    assert not g["grad_query"].covers(torch.full_like(g_q, INF))[1].any()


def test_float32_attention_gradient_whose_sum_before_the_scale_may_overflow():
    # The same leniency where no bound needs the gradient's product of sizes (float32, the math
    # path's class): the rank-one bound on s |dS| |K|, 9.2e37, is below half of float32's range,
    # and it is dS K's, 3.7e38, that decides.
    q = torch.tensor([[32.0], [0.0]])
    grad = torch.full((2, 1), 0.375)
    for v, lenient in ((float.fromhex("0x1.7p+126"), True), (2.0 ** 100, False)):
        g = er.scaled_dot_product_attention.backward(q, q, torch.tensor([[v], [0.0]]), grad, scale=0.125)
        g_q, _ = _attention_grads(q, q, torch.tensor([[v], [0.0]]), grad, 0.125)
        assert g["grad_query"].covers(g_q).all()
        assert bool(g["grad_query"].covers(torch.full_like(g_q, INF))[1].all()) is lenient
