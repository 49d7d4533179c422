"""Shape strategies draw what numpy and torch.matmul accept, and reach their documented variety."""

import numpy as np

import strategies as sx

from ._collect import each


def test_shapes_stay_in_bounds():
    def check(s):
        assert 1 <= len(s) <= 2 and all(2 <= n <= 3 for n in s)
    each(sx.shapes(min_dims=1, max_dims=2, min_side=2, max_side=3), 50, check)


def test_broadcast_shapes_broadcast():
    def check(b):
        assert np.broadcast_shapes(*b.input_shapes) == b.result_shape
    each(sx.broadcast_shapes(num_shapes=3), 50, check)


def test_matmul_shapes_are_what_numpy_matmul_accepts_and_reach_every_form():
    seen = set()

    def check(b):
        A, B = (np.zeros(s) for s in b.input_shapes)
        assert (A @ B).shape == b.result_shape
        seen.add((min(A.ndim, 3), min(B.ndim, 3)))
        return len(seen) == 9

    each(sx.matmul_shapes(max_batch_dims=1), 300, check)
    assert seen == {(a, b) for a in (1, 2, 3) for b in (1, 2, 3)}


def test_batch_sides_are_capped_apart_from_the_matrix_sides():
    seen = set()

    def check(b):
        A, B = b.input_shapes
        assert (np.zeros(A) @ np.zeros(B)).shape == b.result_shape
        assert all(s <= 2 for shape in (A, B) for s in shape[:-2])
        seen.update(s for shape in (A, B) for s in shape[-2:])
        return max(seen) > 2
    each(sx.matmul_shapes(max_side=9, max_batch_side=2, max_batch_dims=2), 200, check)
    assert max(seen) > 2


def test_matmul_shapes_without_1d_are_at_least_2d():
    def check(b):
        assert all(len(s) >= 2 for s in b.input_shapes)
    each(sx.matmul_shapes(allow_1d=False), 50, check)


def test_gemm_c_broadcasts_to_the_product_without_enlarging_it():
    seen = set()

    def check(b):
        A, B, C = b.input_shapes
        out = (np.zeros(A) @ np.zeros(B)).shape
        assert out == b.result_shape and np.broadcast_shapes(C, out) == out
        seen.add(len(C))
        return seen == {0, 1, 2, 3}

    each(sx.gemm_shapes(max_batch_dims=1), 200, check)
    assert seen == {0, 1, 2, 3}
