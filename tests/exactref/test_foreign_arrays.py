"""Arrays of other libraries (JAX here) are read in their own format, through DLPack or ``__array__``.

A JAX float64 result read as float32 would be judged in the wrong format, and
the verdict would be wrong: each format must come through as itself, and
bfloat16 without torch.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import exactref as er

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jax.config.update("jax_enable_x64", True)

FORMATS = ["float64", "float32", "float16", "bfloat16", "complex128", "complex64"]


@pytest.mark.parametrize("name", FORMATS)
def test_a_jax_array_is_read_in_its_own_format_with_its_values(name):
    values = np.array([[1.5, -2.0 ** -20], [3.0, 0.1]]).astype(er.asarray([0.0], name).dtype)
    a = jnp.asarray(values)
    assert str(a.dtype) == name
    got = er.asarray(a)
    assert got.dtype.name == name
    assert got.tobytes() == values.tobytes()


@pytest.mark.parametrize("name", FORMATS)
def test_an_op_on_jax_arrays_has_the_jax_format(name):
    a = jnp.asarray(np.ones((2, 2)).astype(er.asarray([0.0], name).dtype))
    result = er.matmul(a, a)
    assert result.dtype.name == name
    assert result.covers(a @ a).all()
    result.check(a @ a)


def test_a_jax_float64_result_judged_as_float32_would_be_refused():
    a = jnp.asarray(np.array([[1.0 + 2.0 ** -40]]))
    result = er.matmul(a, a)
    assert result.dtype.name == "float64"
    # Read as float32, 1 + 2**-39 would round to 1 and the float64 answer would look wrong.
    assert result.covers(a @ a).all()


def test_jax_bfloat16_is_read_without_torch():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torch':\n"
            "            raise ImportError('torch is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import jax.numpy as jnp, numpy as np, exactref as er\n"
            "a = jnp.asarray([1.5, 2.0], jnp.bfloat16)\n"
            "got = er.asarray(a)\n"
            "print(got.dtype.name, got.astype(np.float64).tolist(), 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "bfloat16 [1.5, 2.0] False", result.stdout
