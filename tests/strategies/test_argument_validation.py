"""Each bad argument is refused where the strategy is built, by a message naming it and showing the value."""

import math
import re

import pytest
from hypothesis import given, settings

import strategies as sx

CASES = [
    # (function, keyword arguments, error, text the message must contain)
    (sx.formats, {"dtypes": []}, ValueError, "dtypes=[] is empty"),
    (sx.formats, {"dtypes": ["int32"]}, TypeError, "dtypes contains 'int32'"),
    (sx.formats, {"dtypes": "float8_e4m3"}, TypeError, "dtypes contains 'float8_e4m3', which is not a supported"),
    # float8 is drawn only where asked for by name, and only by the strategies that take it.
    (sx.add_inputs, {"dtypes": "float8_e4m3fn"}, ValueError,
     "dtypes contains 'float8_e4m3fn', which this strategy does not accept (PyTorch computes only matmul"),
    (sx.elements, {"dtype": "float8_e8m0fnu"}, ValueError, "dtype='float8_e8m0fnu' holds only the powers of two"),
    (sx.cast_values, {"dtype": "int8"}, TypeError, "dtype='int8' is not a supported format"),
    (sx.cast_values, {"dtype": "float8_e8m0fnu"}, ValueError, "dtype='float8_e8m0fnu' holds only powers of two"),
    (sx.cast_values, {"dtype": "float64"}, ValueError, "dtype='float64' has no wider format to cast from"),
    (sx.cast_values, {"dtype": "complex64"}, ValueError, "dtype='complex64' is complex"),
    (sx.cast_values, {"dtype": "float16", "source": "bfloat16"}, ValueError,
     "source='bfloat16' cannot hold the hard cases of a cast to float16"),
    (sx.cast_values, {"dtype": "float8_e5m2", "source": "float8_e4m3fn"}, ValueError, "source='float8_e4m3fn'"),
    (sx.cast_values, {"dtype": "float8_e4m3fn", "classes": ["ties"]}, ValueError, "classes contains 'ties'"),
    (sx.cast_values, {"dtype": "float8_e4m3fn", "classes": False}, ValueError, "classes=False switches every"),
    (sx.formats, {"allow_complex": "no"}, TypeError, "allow_complex='no' must be True or False"),
    (sx.formats, {"dtypes": ["complex64"], "allow_complex": False}, ValueError, "dtypes contains 'complex64'"),
    (sx.shapes, {"min_dims": -1}, ValueError, "min_dims=-1 must be at least 0"),
    (sx.shapes, {"max_dims": "3"}, TypeError, "max_dims='3' must be an int"),
    (sx.shapes, {"min_side": 5, "max_side": 3}, ValueError, "min_side=5 is larger than max_side=3"),
    (sx.shapes, {"max_side": 0}, ValueError, "max_side=0 must be at least 1"),
    (sx.shapes, {"max_dims": 2.0}, TypeError, "max_dims=2.0 must be an int"),
    (sx.broadcast_shapes, {"num_shapes": 0}, ValueError, "num_shapes=0 must be at least 1"),
    (sx.broadcast_shapes, {"signature": 3}, TypeError, "signature=3 must be a gufunc signature"),
    (sx.matmul_shapes, {"max_batch_dims": -1}, ValueError, "max_batch_dims=-1 must be at least 0"),
    (sx.matmul_shapes, {"allow_1d": 1}, TypeError, "allow_1d=1 must be True or False"),
    (sx.matmul_shapes, {"max_batch_side": 0}, ValueError, "max_batch_side=0 must be at least 1"),
    (sx.matmul_inputs, {"max_batch_side": "2"}, TypeError, "max_batch_side='2' must be an int"),
    (sx.gemm_shapes, {"max_side": True}, TypeError, "max_side=True must be an int"),
    (sx.elements, {"dtype": "int8"}, TypeError, "dtype='int8' is not a supported format"),
    (sx.elements, {"dtype": "float32", "specials": ["nope"]}, ValueError, "specials contains 'nope'"),
    (sx.elements, {"dtype": "float32", "specials": 3}, TypeError, "specials=3 must be True, False or a collection"),
    (sx.elements, {"dtype": "float32", "max_abs": -1}, ValueError, "max_abs=-1.0 must be finite and greater than zero"),
    (sx.elements, {"dtype": "float32", "max_abs": "big"}, TypeError, "max_abs='big' must be a positive number"),
    (sx.elements, {"dtype": "float32", "max_abs": math.inf}, ValueError, "max_abs=inf must be finite"),
    (sx.special_values, {"dtype": "float16", "classes": False}, ValueError, "classes=False switches every class off"),
    (sx.special_values, {"dtype": "float16", "classes": ["zero"]}, ValueError, "classes contains 'zero'"),
    (sx.arrays, {"dtype": "float32", "shape": [2, 3]}, TypeError, "shape=[2, 3] must be a tuple of ints"),
    (sx.arrays, {"dtype": "float32", "shape": (-1,)}, ValueError, "shape=(-1,) must hold non-negative ints"),
    (sx.arrays, {"dtype": "float32", "shape": (2,), "device": 3}, TypeError, "device=3 must be None"),
    (sx.arrays, {"dtype": "float32", "shape": (2,), "device": ""}, ValueError, "device='' is empty"),
    (sx.add_inputs, {"max_dims": -1}, ValueError, "max_dims=-1 must be at least 0"),
    (sx.add_inputs, {"max_side": 0}, ValueError, "max_side=0 must be at least 1"),
    (sx.add_inputs, {"hard": ["tie", "foo"]}, ValueError, "hard contains 'foo'"),
    (sx.add_inputs, {"scalars": "yes"}, TypeError, "scalars='yes' must be True or False"),
    (sx.add_inputs, {"alpha": math.inf}, ValueError, "alpha=inf must be finite"),
    (sx.add_inputs, {"alpha": "1"}, TypeError, "alpha='1' must be None (drawn) or a Python int"),
    (sx.add_inputs, {"dtypes": "float32", "alpha": 1j}, ValueError, "alpha=1j is complex but dtypes include real"),
    (sx.multiply_inputs, {"specials": "nan!"}, ValueError, "specials contains 'nan!'"),
    (sx.sum_inputs, {"max_dims": 17}, ValueError, "max_dims=17 must be at most 16"),
    (sx.sum_inputs, {"device": object()}, TypeError, "device=<object object"),
    (sx.matmul_inputs, {"allow_1d": None}, TypeError, "allow_1d=None must be True or False"),
    (sx.matmul_inputs, {"max_batch_dims": 1.5}, TypeError, "max_batch_dims=1.5 must be an int"),
    (sx.matmul_inputs, {"hard": ["masked_row"]}, ValueError, "hard contains 'masked_row'"),
    (sx.gemm_inputs, {"beta": 1j}, ValueError, "beta=1j is complex but dtypes include real formats"),
    (sx.gemm_inputs, {"alpha": math.nan}, ValueError, "alpha=nan must be finite"),
    (sx.scaled_dot_product_attention_inputs, {"dtypes": ["complex64"]}, ValueError,
     "dtypes contains 'complex64', which scaled_dot_product_attention does not accept"),
    (sx.scaled_dot_product_attention_inputs, {"masks": ["int"]}, ValueError, "masks contains 'int'"),
    (sx.scaled_dot_product_attention_inputs, {"causal": 1}, TypeError, "causal=1 must be True or False"),
    (sx.scaled_dot_product_attention_inputs, {"gqa": "x"}, TypeError, "gqa='x' must be True or False"),
    (sx.scaled_dot_product_attention_inputs, {"scale": None}, TypeError, "scale=None must be True or False"),
    (sx.scaled_dot_product_attention_inputs, {"hard": ["tie"]}, ValueError, "hard contains 'tie'"),
    (sx.scaled_dot_product_attention_inputs, {"max_abs": 0}, ValueError, "max_abs=0.0 must be finite and greater"),
    (sx.matrix_exp_inputs, {"max_norm": 0}, ValueError, "max_norm=0.0 must be finite and greater than zero"),
    (sx.matrix_exp_inputs, {"max_norm": None}, TypeError, "max_norm=None must be a positive number"),
    (sx.matrix_exp_inputs, {"hard": ["commuting"]}, ValueError, "hard contains 'commuting'"),
    (sx.matrix_exp_frechet_inputs, {"max_batch_dims": -2}, ValueError, "max_batch_dims=-2 must be at least 0"),
    # scaled_matmul_inputs' full table is in test_scaled_matmul.py.
    (sx.scaled_matmul_inputs, {"max_side": 0}, ValueError, "max_side=0 must be at least 1"),
    (sx.scaled_matmul_inputs, {"dtypes": "float8_e8m0fnu"}, ValueError, "dtypes contains 'float8_e8m0fnu'"),
    # Sizes: one drawn array may have at most 2**24 elements; the message gives the largest values that fit.
    (sx.matmul_inputs, {"max_side": 10**6}, ValueError,
     "matmul_inputs(max_batch_dims=2, max_side=1000000) could draw an array of 16,000,000,000,000 elements"),
    (sx.matmul_inputs, {"max_side": 4096}, ValueError,
     "more than the limit of 16,777,216 (2**24) per array; pass max_batch_dims=0, or max_side at most 1024"),
    (sx.matmul_inputs, {"max_side": 8, "max_batch_dims": 16, "max_batch_side": 8}, ValueError,
     "pass max_batch_dims at most 6, or max_side at most 2, or max_batch_side at most 2"),
    (sx.gemm_inputs, {"max_side": 3000}, ValueError, "pass max_batch_dims=0, or max_side at most 2048"),
    (sx.add_inputs, {"max_side": 10**6}, ValueError,
     "add_inputs(max_dims=3, max_side=1000000) could draw an array of 1,000,000,000,000,000,000 elements"),
    (sx.multiply_inputs, {"max_dims": 13}, ValueError, "(0.5 GiB as float64), more than the limit"),
    (sx.sum_inputs, {"max_dims": 16}, ValueError,
     "sum_inputs(max_dims=16, max_side=4) could draw an array of 4,294,967,296 elements (32 GiB as float64)"),
    (sx.scaled_dot_product_attention_inputs, {"max_side": 100}, ValueError, "; pass max_side at most 32"),
    (sx.scaled_dot_product_attention_inputs, {"max_side": 1, "max_batch_side": 10**4}, ValueError,
     "pass max_batch_dims at most 1, or max_batch_side at most 4096"),
    (sx.matrix_exp_inputs, {"max_side": 5000}, ValueError, "; pass max_side at most 2048"),
    (sx.matrix_exp_frechet_inputs, {"max_side": 4097, "max_batch_dims": 0}, ValueError,
     "matrix_exp_frechet_inputs(max_batch_dims=0, max_side=4097) could draw an array of 16,785,409 elements"),
    (sx.arrays, {"dtype": "float32", "shape": (4096, 4097)}, ValueError,
     "shape=(4096, 4097) has 16,781,312 elements (0.125 GiB as float64), more than the limit of 16,777,216"),
    (sx.strategy_for, {"op": "conv2d"}, ValueError, "op='conv2d' is not an op"),
    (sx.load_module, {"name": ""}, ValueError, "name='' must be an absolute module name"),
]


def call(function, kwargs):
    # strategy_for and load_module take their first argument positionally.
    if function in (sx.strategy_for, sx.load_module):
        return function(*kwargs.values())
    return function(**kwargs)


@pytest.mark.parametrize("function, kwargs, error, text", CASES,
                         ids=[f"{f.__name__}-{'-'.join(map(str, k))}" for f, k, _, _ in CASES])
def test_bad_argument_is_refused_with_its_name_and_value(function, kwargs, error, text):
    with pytest.raises(error, match=re.escape(text)):
        call(function, kwargs)


def test_every_public_strategy_function_has_a_row():
    covered = {f.__name__ for f, *_ in CASES}
    public = {name for name in sx.__all__ if callable(getattr(sx, name)) and not isinstance(getattr(sx, name), type)
              and name not in ("register", "registered", "unregister", "check_case", "special_class",
                               "degree_thresholds")}
    assert public <= covered, f"no validation row for: {sorted(public - covered)}"


def test_errors_come_at_build_time_not_at_the_first_draw():
    # Building is enough: no .example() or @given needed for the error.
    with pytest.raises(ValueError):
        sx.matmul_inputs(max_side=-3)


@pytest.mark.parametrize("function, kwargs, largest", [
    # The largest sizes computed by hand: batch sides are capped at min(max_side, 4).
    (sx.matmul_inputs, {"max_batch_dims": 2}, 1024),  # 4**2 * 1024**2 == 2**24
    (sx.gemm_inputs, {"max_batch_dims": 0}, 4096),  # 4096**2 == 2**24
    (sx.add_inputs, {"max_dims": 3}, 256),  # 256**3 == 2**24
    (sx.sum_inputs, {"max_dims": 2}, 4096),
    (sx.scaled_dot_product_attention_inputs, {"max_batch_dims": 0}, 64),  # with GQA: 64**4 == 2**24
    (sx.scaled_dot_product_attention_inputs, {"max_batch_dims": 0, "gqa": False}, 4096),
    (sx.matrix_exp_inputs, {"max_batch_dims": 1}, 2048),  # 4 * 2048**2 == 2**24
])
def test_the_size_limit_is_exactly_two_to_the_24_elements(function, kwargs, largest):
    function(max_side=largest, **kwargs)  # builds: the limit is inclusive
    with pytest.raises(ValueError, match=re.escape(f"max_side at most {largest}")):
        function(max_side=largest + 1, **kwargs)


def test_a_drawn_shape_over_the_limit_is_refused_when_drawn():
    # A strategy's shapes are only known when drawn, so arrays() checks each one then.
    big = sx.arrays(dtype="float32", shape=sx.shapes(min_dims=2, max_dims=2, min_side=4097, max_side=4097))

    @settings(max_examples=1, database=None)
    @given(big)
    def draw(a):
        pass
    with pytest.raises(ValueError, match=re.escape("the shape strategy drew (4097, 4097), which has 16,785,409")):
        draw()
    sx.arrays(dtype="float32", shape=(4096, 4096))  # at the limit: builds
