"""The repository's own ExactRef-based test: add's backward through autograd, judged exactly."""

from hypothesis import given, settings
from mykernels import ops

import exactref as er
import strategies as sx


@settings(max_examples=100, deadline=None)
@given(case=sx.matmul_inputs(dtypes=["float32"], max_side=2, allow_1d=False))
def test_matmul_backward(case):
    t = case.to_torch()
    got = ops.matmul_backward(t.A, t.B, t.grad)
    er.matmul.backward(case.A, case.B, case.grad, model=er.models.PYTORCH_AUTOGRAD).check(**got)
