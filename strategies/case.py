"""The case object every per-op strategy draws, and conversions to and from torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from exactref.harness.kernels import OP_INPUTS, to_torch
from exactref.formats import FLOAT8_FORMATS, ComplexFormat, Format, format_of

from .hard import HardCase

__all__ = ["OPS", "OpCase", "Signature", "SIGNATURES", "check_case", "tensor_from_numpy", "tensor_to_numpy"]


class Signature(NamedTuple):
    """An op's parameter names: positional inputs in call order, keyword options, and
    whether it has a backward (and so a ``grad``)."""

    inputs: tuple[str, ...]
    keywords: tuple[str, ...]
    has_backward: bool


#: Every op a case can be drawn for, with its parameter names (exactref's own table of the ops).
SIGNATURES: dict[str, Signature] = {op: Signature(i.inputs, i.keywords, i.has_backward) for op, i in OP_INPUTS.items()}
#: The ops, in the order the docs list them.
OPS: tuple[str, ...] = tuple(SIGNATURES)


def check_case(case: Any, op: str | None = None, *, source: str = "a strategy") -> OpCase:
    """``case`` itself if it is a well-formed OpCase (for ``op``, when given); else a clear error.

    ``source`` names where the case came from, for the message.

    >>> import numpy as np
    >>> A = np.ones((1, 1), np.float32)
    >>> check_case(OpCase("matmul", {"A": A, "B": A}, {}, A), "matmul").op
    'matmul'
    >>> check_case(OpCase("matmul", {"A": A, "B": A}, {}, A), "gemm")
    Traceback (most recent call last):
    ...
    ValueError: a strategy for gemm drew a case for matmul; it must draw OpCase(op='gemm', ...)
    """
    if not isinstance(case, OpCase):
        want = f"OpCase(op={op!r}, ...)" if op else "an OpCase"
        raise TypeError(f"{source} drew {type(case).__name__} {case!r:.80}; it must draw {want} "
                        "(from strategies.OpCase)")
    if op is not None and case.op != op:
        raise ValueError(f"{source} for {op} drew a case for {case.op}; it must draw OpCase(op={op!r}, ...)")
    _check_fields(case.op, case.inputs, case.kwargs, case.grad, source)
    return case


def _check_fields(op: str, inputs: Any, kwargs: Any, grad: Any, source: str) -> None:
    sig = SIGNATURES.get(op)
    if sig is None:
        raise ValueError(f"{source} made a case for op={op!r}, which is not an op; use one of: {', '.join(OPS)}")
    if not isinstance(inputs, dict) or tuple(inputs) != sig.inputs:
        got = tuple(inputs) if isinstance(inputs, dict) else inputs
        raise ValueError(f"{source} made a {op} case with inputs {got!r}; {op}'s inputs are "
                         f"{sig.inputs!r}, in that order")
    if not isinstance(kwargs, dict) or not set(kwargs) <= set(sig.keywords):
        extra = sorted(set(kwargs) - set(sig.keywords)) if isinstance(kwargs, dict) else kwargs
        raise ValueError(f"{source} made a {op} case with keywords {extra!r} that {op} does not take; "
                         f"its keywords are {sig.keywords!r}")
    if sig.has_backward and grad is None:
        raise ValueError(f"{source} made a {op} case without grad; every {op} case needs the output "
                         "gradient, with the output's shape and dtype")
    if not sig.has_backward and grad is not None:
        raise ValueError(f"{source} made a {op} case with a grad, but {op} has no backward; pass grad=None")


@dataclass(frozen=True, eq=False)
class OpCase:
    """One drawn set of inputs for an op.

    ``inputs`` holds the positional inputs in call order by parameter name,
    ``kwargs`` the keyword options, ``grad`` the output gradient (None for
    an op without a backward) and ``hard`` where the case holds hard
    rounding cases.  Every input, keyword and ``grad`` is also an attribute:
    ``case.A``, ``case.alpha``.

    >>> import numpy as np
    >>> A = np.array([[1.0, 2.0]], np.float32)
    >>> B = np.array([[3.0], [4.0]], np.float32)
    >>> case = OpCase("matmul", {"A": A, "B": B}, {}, np.ones((1, 1), np.float32))
    >>> case.forward().rounded.tolist()
    [[11.0]]
    >>> case.backward().rounded.grad_B.tolist()
    [[1.0], [2.0]]
    >>> case.to_torch().A.dtype
    torch.float32
    """

    op: str
    inputs: dict[str, Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    grad: Any = None
    hard: tuple[HardCase, ...] = ()

    def __post_init__(self) -> None:
        _check_fields(self.op, self.inputs, self.kwargs, self.grad, "OpCase")

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not real attributes; __dict__ is read
        # directly so that copy and pickle, which probe before fields exist, work.
        if name.startswith("__"):
            raise AttributeError(name)
        for key in ("inputs", "kwargs"):
            values = self.__dict__.get(key)
            if values is not None and name in values:
                return values[name]
        fields = [*self.__dict__.get("inputs", {}), *self.__dict__.get("kwargs", {}), "grad"]
        raise AttributeError(f"this {self.__dict__.get('op')} case has no field {name!r}; "
                             f"its fields are: {', '.join(fields)}")

    @property
    def fields(self) -> dict[str, Any]:
        """Every input, keyword and the grad, by name, in call order."""
        out = {**self.inputs, **self.kwargs}
        if self.grad is not None:
            out["grad"] = self.grad
        return out

    @property
    def format(self) -> Format | ComplexFormat:
        """The exactref format of the case's first array input."""
        for v in self.inputs.values():
            if hasattr(v, "dtype"):
                return format_of(v.dtype)
        raise TypeError(f"this {self.op} case has no array input")

    def forward(self, module: ModuleType | None = None) -> Any:
        """``getattr(module, op)(*inputs, **kwargs)``; ``module`` defaults to exactref."""
        return _op_of(module, self.op)(*self.inputs.values(), **self.kwargs)

    def backward(self, module: ModuleType | None = None) -> Any:
        """``getattr(module, op).backward(*inputs, grad, **kwargs)``; ``module`` defaults to exactref."""
        if self.grad is None:
            raise TypeError(f"{self.op} has no backward, so this case has no grad")
        return _op_of(module, self.op).backward(*self.inputs.values(), self.grad, **self.kwargs)

    def to_torch(self, device: Any = "cpu", *, requires_grad: bool = False) -> OpCase:
        """The same case with every array a torch tensor on ``device``.

        With ``requires_grad`` the floating-point inputs (not masks, not grad)
        record gradients, ready for ``out.backward(case.grad)``.
        """
        return OpCase(self.op, {k: to_torch(v, device, requires_grad=requires_grad) for k, v in self.inputs.items()},
                      {k: to_torch(v, device) for k, v in self.kwargs.items()},
                      to_torch(self.grad, device), self.hard)

    def to_numpy(self) -> OpCase:
        """The same case with every torch tensor back as a numpy array."""
        def conv(v: Any) -> Any:
            return tensor_to_numpy(v) if type(v).__module__.startswith("torch") else v
        return OpCase(self.op, {k: conv(v) for k, v in self.inputs.items()},
                      {k: conv(v) for k, v in self.kwargs.items()}, conv(self.grad), self.hard)

    def __repr__(self) -> str:
        parts = [f"op={self.op!r}"] + [f"{k}={_show(v)}" for k, v in self.fields.items()]
        if self.hard:
            parts.append(f"hard={self.hard!r}")
        return f"OpCase({', '.join(parts)})"


def _show(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return np.array_repr(v, max_line_width=10**6, precision=None)
    return repr(v)


def _op_of(module: ModuleType | None, op: str) -> Any:
    if module is None:
        import exactref as module
    try:
        return getattr(module, op)
    except AttributeError:
        raise AttributeError(f"module {getattr(module, '__name__', module)!r} has no op {op!r}") from None


def tensor_from_numpy(a: np.ndarray, device: Any = "cpu") -> Any:
    """A torch tensor with ``a``'s values and dtype (bfloat16 included), on ``device``."""
    return to_torch(a, device)


def tensor_to_numpy(t: Any) -> np.ndarray:
    """A numpy copy of a torch tensor on any device (bfloat16 and float8 through ml_dtypes)."""
    import torch
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    name = str(t.dtype).removeprefix("torch.")
    if name in FLOAT8_FORMATS:
        return t.view(torch.uint8).numpy().view(getattr(ml_dtypes, name)).copy()
    return t.numpy().copy()
