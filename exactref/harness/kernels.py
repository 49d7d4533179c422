"""Kernel modules: what a kernel repository hands ExactRef to test, and how its kernels are called.

A kernel module defines ``EXACTREF_KERNELS``, a mapping from op name to either
the forward callable or a dict describing the kernel (see ``docs/plugin.md``).
This module reads and validates that mapping, converts arrays to and from
torch or numpy, and calls the kernels.  It imports neither Hypothesis nor
``strategies``, so that a standalone regression test runs without them.
"""

from __future__ import annotations

import importlib
import queue
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .. import formats

__all__ = [
    "AUTOGRAD",
    "CELL_FORMATS",
    "DIRECTIONS",
    "FLOAT8_INPUTS",
    "FORMATS",
    "OP_INPUTS",
    "Kernel",
    "KernelOutputError",
    "KernelRaisedError",
    "KernelTimeoutError",
    "call_kernel",
    "device_problem",
    "ensure_importable",
    "kernel_formats",
    "load_kernels",
    "run_with_timeout",
    "to_numpy",
    "to_torch",
]

#: The forward and backward direction of an op.
DIRECTIONS: tuple[str, ...] = ("forward", "backward")
#: A kernel's backward may be this string: the plugin runs torch autograd through the forward.
AUTOGRAD = "autograd"
#: The formats every op takes, in the order cells are listed (the float8 formats are matmul's and
#: scaled_matmul's only, below).
FORMATS: tuple[str, ...] = tuple(n for n in formats.FORMATS if n not in formats.FLOAT8_FORMATS)
_REAL = FORMATS[:4]
#: The float8 formats an operand of matmul and scaled_matmul may have (float8_e8m0fnu is only a scale).
FLOAT8_INPUTS: tuple[str, ...] = tuple(n for n in formats.FLOAT8_FORMATS if n != "float8_e8m0fnu")
#: The OCP formats, which NVIDIA's and Intel's float8 kernels take; the fnuz ones are AMD's.
_OCP = ("float8_e4m3fn", "float8_e5m2")
#: Every format a cell can be in, in the order cells are listed.
CELL_FORMATS: tuple[str, ...] = FORMATS + FLOAT8_INPUTS


class _OpInfo(NamedTuple):
    """An op as the harness sees it.

    ``formats`` are the cells a kernel gets when it declares none;
    ``accepts`` the formats it may declare (None: ``formats``), which is how
    a kernel opts in to float8 matmul cells: most matmul kernels have none.
    A format in ``forward_only`` has no backward cell even when the kernel
    has a backward (PyTorch has no float8 backward).  The keywords in
    ``dtype_keywords`` hold a dtype: a case stores its name, and a torch
    kernel is called with the torch dtype.
    """

    inputs: tuple[str, ...]
    keywords: tuple[str, ...]
    has_backward: bool
    formats: tuple[str, ...]
    model_keyword: str | None
    accepts: tuple[str, ...] | None = None
    forward_only: tuple[str, ...] = ()
    dtype_keywords: tuple[str, ...] = ()

    @property
    def allowed(self) -> tuple[str, ...]:
        """The formats a kernel of this op may declare."""
        return self.formats if self.accepts is None else self.accepts


# Every op's inputs, keywords, formats and model keyword; strategies.SIGNATURES is built from it.
OP_INPUTS: dict[str, _OpInfo] = {
    "matmul": _OpInfo(("A", "B"), (), True, FORMATS, "model", accepts=CELL_FORMATS, forward_only=FLOAT8_INPUTS),
    "gemm": _OpInfo(("A", "B", "C"), ("alpha", "beta"), True, FORMATS, "model"),
    "add": _OpInfo(("x", "y"), ("alpha",), True, FORMATS, "model"),
    "multiply": _OpInfo(("x", "y"), (), True, FORMATS, "model"),
    "sum": _OpInfo(("x",), ("axis", "keepdims"), True, FORMATS, "model"),
    "scaled_dot_product_attention": _OpInfo(
        ("query", "key", "value"), ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), True,
        _REAL, "algorithm"),
    "matrix_exp": _OpInfo(("A",), (), True, FORMATS, "model"),
    "matrix_exp_frechet": _OpInfo(("A", "E"), (), False, FORMATS, "model"),
    "scaled_matmul": _OpInfo(("A", "B", "scale_a", "scale_b"), ("bias", "out_dtype", "use_fast_accum"), False,
                             _OCP, "model", accepts=FLOAT8_INPUTS, dtype_keywords=("out_dtype",)),
}

_ENTRY_KEYS = ("forward", "backward", "formats", "arrays", "model", "backward_model", "reference_options",
               "strategy_options", "known_failures")
_ARRAYS = ("torch", "numpy")
MODULE_ATTRIBUTE = "EXACTREF_KERNELS"


class KernelRaisedError(Exception):
    """The kernel under test raised instead of returning; the message holds its traceback."""


class KernelOutputError(TypeError):
    """The kernel returned something that is not an output or gradients: no array, an unknown gradient."""


class KernelTimeoutError(Exception):
    """The kernel did not return within the per-call timeout; the message names the call."""


@dataclass(frozen=True, eq=False)
class Kernel:
    """One op's kernel from a kernel module, with how to judge it.

    ``models`` maps a direction to the error model (an ErrorModel or an
    AttentionAlgorithm, or a dict from format name to one) that the
    reference uses; None means exactref's default.
    """

    op: str
    forward: Callable[..., Any]
    backward: Callable[..., Any] | str | None
    formats: tuple[str, ...]
    arrays: str
    source: str
    models: dict[str, Any] = field(default_factory=dict)
    # A dict, or a function of the case's inputs and keywords that returns one.
    reference_options: dict[str, Any] | Callable[..., Mapping[str, Any]] = field(default_factory=dict)
    strategy_options: dict[str, Any] = field(default_factory=dict)
    known_failures: dict[str, str] = field(default_factory=dict)

    @property
    def directions(self) -> tuple[str, ...]:
        return DIRECTIONS if self.backward is not None else DIRECTIONS[:1]

    def known_failure(self, fmt: str, direction: str) -> tuple[str, str] | None:
        """The ``known_failures`` entry of the cell ``fmt``, ``direction``, as (key, reason), or None.

        A key ``"float16-backward"`` names one direction; a key ``"float16"`` both (the narrower wins).
        """
        for key in (f"{fmt}-{direction}", fmt):
            if key in self.known_failures:
                return key, self.known_failures[key]
        return None

    def directions_of(self, fmt: str) -> tuple[str, ...]:
        """The directions of this kernel's cells in ``fmt`` (a float8 matmul has no backward)."""
        return DIRECTIONS[:1] if fmt in OP_INPUTS[self.op].forward_only else self.directions

    def model(self, direction: str, fmt: str) -> Any:
        """The error model the reference uses for this direction and format (None: exactref's default)."""
        model = self.models.get(direction)
        if isinstance(model, Mapping):
            return model.get(fmt)
        return model

    def reference_kwargs(self, direction: str, fmt: str, inputs: Mapping[str, Any] | None = None,
                         kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Keywords for exactref's op beyond the case's own: the model, and any reference options.

        Reference options given as a function are called with the case's
        ``inputs`` and ``kwargs``: for a kernel whose algorithm depends on the
        case (PyTorch's _scaled_mm takes another path for row-wise scales).
        """
        options = self.reference_options
        if callable(options):
            options = options(dict(inputs or {}), dict(kwargs or {}))
            if not isinstance(options, Mapping):
                raise TypeError(f"the reference_options function of {self.source} returned {options!r:.60}; "
                                "it must return a dict of keyword arguments for exactref's op")
        out = dict(options)
        model = self.model(direction, fmt)
        keyword = OP_INPUTS[self.op].model_keyword
        if model is not None and keyword is not None:
            out[keyword] = model
        return out


def _import(name: str, what: str) -> Any:
    if not isinstance(name, str) or not name or name.startswith("."):
        raise ValueError(f"{what}={name!r} must be an absolute module name such as 'mykernels.exactref_kernels'")
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"could not import the kernel module {name!r} ({what}): {exc}; check that it "
                          "is installed or importable from the repository root") from exc
    except Exception as exc:
        tb = "".join(traceback.format_exception(exc))
        raise ImportError(f"the kernel module {name!r} ({what}) raised {type(exc).__name__} when imported: "
                          f"{exc}\n{tb}") from exc


def ensure_importable(root: Path) -> None:
    """Put the repository root on sys.path, as ``python -m`` does, so its packages import."""
    text = str(root)
    if text not in sys.path:
        sys.path.insert(0, text)


def load_kernels(name: str, *, device: str = "cpu", what: str = "kernels") -> dict[str, Kernel]:
    """Import the module ``name`` and read its ``EXACTREF_KERNELS`` into Kernels, by op.

    ``EXACTREF_KERNELS`` is a dict, or a function of the device name that
    returns one (so that models can follow the device).  Every problem is a
    ValueError or TypeError naming the module, the op and the key, with the
    value found.
    """
    module = _import(name, what)
    mapping = getattr(module, MODULE_ATTRIBUTE, None)
    if callable(mapping) and not isinstance(mapping, Mapping):
        mapping = mapping(device)
    if mapping is None:
        raise ValueError(f"the kernel module {name!r} defines no {MODULE_ATTRIBUTE}; define "
                         f"{MODULE_ATTRIBUTE} = {{'matmul': my_matmul, ...}}, a dict from op name to kernel")
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{name}.{MODULE_ATTRIBUTE} must be a dict from op name to kernel, "
                        f"not {type(mapping).__name__}")
    arrays = getattr(module, "EXACTREF_ARRAYS", "torch")
    return {op: _read_entry(name, op, entry, arrays) for op, entry in mapping.items()}


def _read_entry(module: str, op: Any, entry: Any, default_arrays: Any) -> Kernel:
    where = f"{module}.{MODULE_ATTRIBUTE}[{op!r}]"
    if op not in OP_INPUTS:
        raise ValueError(f"{module}.{MODULE_ATTRIBUTE} has the key {op!r}, which is not an op; "
                         f"use op names from: {', '.join(OP_INPUTS)}")
    info = OP_INPUTS[op]
    if callable(entry):
        entry = {"forward": entry}
    if not isinstance(entry, Mapping):
        raise TypeError(f"{where} must be the forward callable or a dict with 'forward' (and optionally "
                        f"'backward', 'formats', ...), not {type(entry).__name__} {entry!r:.60}")
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; the keys are: {', '.join(_ENTRY_KEYS)}")
    forward = entry.get("forward")
    if not callable(forward):
        raise TypeError(f"{where}['forward'] must be callable, called like exactref.{op}(...); got {forward!r:.60}")
    backward = entry.get("backward")
    if backward is not None:
        if not info.has_backward:
            raise ValueError(f"{where}['backward'] is given, but {op} has no backward; remove it")
        if not (callable(backward) or backward == AUTOGRAD):
            raise TypeError(f"{where}['backward'] must be callable or {AUTOGRAD!r}; got {backward!r:.60}")
    arrays = entry.get("arrays", default_arrays)
    if arrays not in _ARRAYS:
        raise ValueError(f"{where}['arrays']={arrays!r} must be one of {_ARRAYS}")
    if backward == AUTOGRAD and arrays != "torch":
        raise ValueError(f"{where}['backward']={AUTOGRAD!r} needs torch arrays, but 'arrays' is {arrays!r}")
    formats = _read_formats(where, entry.get("formats"), info, op)
    models = {"forward": entry.get("model"), "backward": entry.get("backward_model", entry.get("model"))}
    for key in ("model", "backward_model"):
        _check_model(where, key, entry.get(key), op, info.model_keyword)
    options: dict[str, Any] = {}
    for key in ("reference_options", "strategy_options"):
        value = entry.get(key, {})
        if key == "reference_options" and callable(value) and not isinstance(value, Mapping):
            options[key] = value
            continue
        if not isinstance(value, Mapping):
            also = ", or a function of the case's inputs and keywords that returns one" \
                if key == "reference_options" else ""
            raise TypeError(f"{where}[{key!r}] must be a dict of keyword arguments{also}, not {value!r:.60}")
        options[key] = dict(value)
    known = entry.get("known_failures", {})
    if not isinstance(known, Mapping) or not all(isinstance(v, str) for v in known.values()):
        raise TypeError(f"{where}['known_failures'] must be a dict from format name (or 'FORMAT-DIRECTION') to the reason, "
                        f"not {known!r:.80}")
    for key in known:
        _check_known_key(where, key, formats, backward is not None)
    source = f"{module}:{op}"
    return Kernel(op, forward, backward, formats, arrays, source, models,
                  options["reference_options"], options["strategy_options"], dict(known))


def _check_known_key(where: str, key: Any, formats: tuple[str, ...], has_backward: bool) -> None:
    """A known_failures key is a format name, or ``FORMAT-DIRECTION`` for one direction of it."""
    fmt, _, direction = str(key).partition("-")
    directions = DIRECTIONS if has_backward else DIRECTIONS[:1]
    if not isinstance(key, str) or fmt not in formats or (direction and direction not in directions):
        raise ValueError(f"{where}['known_failures'] names {key!r}, which is neither one of its formats {formats} "
                         f"nor such a format and a direction ({', '.join(directions)}), as in "
                         f"{formats[0] + '-' + directions[-1]!r}")


def _read_formats(where: str, value: Any, info: _OpInfo, op: str) -> tuple[str, ...]:
    if value is None:
        return info.formats
    allowed = info.allowed
    items = [value] if isinstance(value, str) else value
    try:
        names = [_format_name(v) for v in items]
    except TypeError:
        raise TypeError(f"{where}['formats']={value!r} must be a list of format names from: "
                        f"{', '.join(allowed)}") from None
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"{where}['formats']={value!r}: {op} takes the formats {', '.join(allowed)}")
    return tuple(n for n in CELL_FORMATS if n in names)


def _format_name(value: Any) -> str:
    if isinstance(value, str):
        return value
    name = getattr(value, "name", None) or str(value).replace("torch.", "")
    if not isinstance(name, str):
        raise TypeError(value)
    return name


def _check_model(where: str, key: str, value: Any, op: str, keyword: str | None) -> None:
    """Raise unless ``value`` is the kind of model the op's ``keyword`` takes (or a dict of them)."""
    if value is None:
        return
    values = value.values() if isinstance(value, Mapping) else [value]
    import exactref as er

    want = er.AttentionAlgorithm if keyword == "algorithm" else (
        er.models.MatrixExpModel if op.startswith("matrix_exp") else er.ErrorModel)
    for v in values:
        if not isinstance(v, want):
            article = "an" if want.__name__[0] in "AEIOU" else "a"
            raise TypeError(f"{where}[{key!r}] must be {article} {want.__name__} (or a dict from format name to "
                            f"one), not {v!r:.60}")


def device_problem(device: str) -> str | None:
    """Why kernels cannot get tensors on ``device`` (None when they can), naming the device."""
    if device == "cpu":
        return None
    try:
        import torch
    except ImportError:
        return f"{device} needs torch: pip install torch"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return (f"{device}: no CUDA device is available here (torch {torch.__version__}, "
                "torch.cuda.is_available() is False); run on a machine with a GPU and a CUDA build "
                "of torch, or leave the device out for the CPU")
    try:
        kind = torch.empty(1, device=device).device.type
    except (RuntimeError, ValueError) as exc:
        return f"{device}: torch cannot use it: {exc}"
    if kind == "meta":
        return (f"{device}: meta tensors have shapes but no values, so there is nothing to judge; "
                "use cpu or a device with memory, such as cuda")
    return None


def kernel_formats(kernel: Kernel, wanted: tuple[str, ...] | None) -> tuple[str, ...]:
    """The kernel's formats, restricted to ``wanted`` when given."""
    return kernel.formats if wanted is None else tuple(f for f in kernel.formats if f in wanted)


# ---------------------------------------------------------------- arrays


def to_torch(value: Any, device: Any, *, requires_grad: bool = False) -> Any:
    """A torch tensor with exactly the values and dtype of a numpy array (others unchanged)."""
    if not isinstance(value, np.ndarray):
        return value
    import torch

    # A C-ordered copy (np.ascontiguousarray would turn a 0-d array into 1-d).
    a = np.array(value, order="C", copy=True)
    if a.dtype.name == "bfloat16":
        # torch cannot read ml_dtypes arrays; the bits are the same, so go through int16.
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    elif a.dtype.name in formats.FLOAT8_FORMATS:
        # The same for float8, through uint8 (same size, so 0-d arrays view too).
        t = torch.from_numpy(a.view(np.uint8)).view(getattr(torch, a.dtype.name))
    else:
        t = torch.from_numpy(a)
    t = t.to(device)
    if requires_grad and (t.is_floating_point() or t.is_complex()):
        t.requires_grad_(True)
    return t


def to_numpy(value: Any) -> Any:
    """A numpy copy of a torch tensor on any device, or of another library's array (JAX, CuPy, ...: anything
    with ``__dlpack__`` or ``__array__``) in its own dtype; numpy arrays, lists and scalars unchanged."""
    from .._convert import _is_torch, _plain, _torch_to_numpy

    if _is_torch(value):
        return _torch_to_numpy(value)
    if isinstance(value, (np.ndarray, np.generic, list, tuple)) or not (
            hasattr(value, "__dlpack__") or hasattr(value, "__array__")):
        return value
    return np.array(_plain(value), copy=True)


def _convert(value: Any, kernel: Kernel, device: str, requires_grad: bool = False) -> Any:
    if kernel.arrays == "torch":
        return to_torch(value, device, requires_grad=requires_grad)
    return np.array(value, copy=True) if isinstance(value, np.ndarray) else value


def _dtype_for(value: Any, kernel: Kernel, name: str) -> Any:
    """A dtype keyword's value as the kernel's library spells it: a torch dtype, or a numpy one."""
    if value is None:
        return None
    fmt = formats.format_of(value, argument=name)
    if kernel.arrays == "torch":
        import torch

        return getattr(torch, fmt.torch_name)
    return np.dtype(fmt.dtype)


def call_kernel(kernel: Kernel, direction: str, inputs: Mapping[str, Any], kwargs: Mapping[str, Any],
                grad: Any, *, device: str = "cpu", timeout: float | None = None) -> Any:
    """Run the kernel on numpy inputs: the output array (forward) or a dict of gradients by name.

    Inputs are copied, so a kernel that writes into them changes nothing
    else.  A kernel that raises gives :class:`KernelRaisedError` with its
    traceback; one that returns something that is not an array or gradients
    gives :class:`KernelOutputError` saying what was expected; one that has
    not returned after ``timeout`` seconds gives :class:`KernelTimeoutError`
    (None or 0: no limit).
    """
    array_names = [k for k, v in inputs.items() if isinstance(v, np.ndarray)]
    autograd = direction == "backward" and kernel.backward == AUTOGRAD
    args = [_convert(v, kernel, device, requires_grad=autograd) for v in inputs.values()]
    dtype_keywords = OP_INPUTS[kernel.op].dtype_keywords
    kw = {k: _dtype_for(v, kernel, k) if k in dtype_keywords else _convert(v, kernel, device)
          for k, v in kwargs.items()}

    def run() -> Any:
        if direction == "forward":
            return kernel.forward(*args, **kw)
        g = _convert(grad, kernel, device)
        if not autograd:
            return kernel.backward(*args, g, **kw)
        out = kernel.forward(*args, **kw)
        out.backward(g)
        import torch

        return {f"grad_{n}": (a.grad if a.grad is not None else torch.zeros_like(a))
                for n, a in zip(inputs, args, strict=True) if isinstance(a, torch.Tensor) and a.requires_grad}

    try:
        got = run_with_timeout(run, timeout)
    except KernelTimeoutError:
        raise KernelTimeoutError(
            f"the {kernel.op} {direction} kernel ({kernel.source}) did not return within {timeout:g} s; "
            "exactref stopped waiting (the call is left running in a background thread) and stops searching "
            "here. Raise the limit with timeout = N in [tool.exactref], --exactref-timeout N (pytest) or "
            "--timeout N (exactref audit); 0 means no limit") from None
    except Exception as exc:
        raise KernelRaisedError(_raised(kernel, direction, exc)) from exc
    if direction == "forward":
        return _output(got, kernel, "output")
    return _gradients(got, kernel, array_names)


class _Call:
    """One kernel call handed to the worker thread, and what it gave."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
            self.error = exc
        finally:
            self.done.set()


class _Worker:
    """A thread that runs kernel calls, so that the caller can stop waiting for one that hangs.

    A daemon thread: a call that never returns must not keep the interpreter
    from exiting.  (A ThreadPoolExecutor's threads are joined at exit.)
    """

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="exactref-kernel-calls", daemon=True).start()

    def _serve(self) -> None:
        while True:
            self.calls.get().run()


_worker: _Worker | None = None


def run_with_timeout(fn: Callable[[], Any], timeout: float | None) -> Any:
    """``fn()``, waiting at most ``timeout`` seconds for it (None or 0: no limit, run on this thread).

    With a limit, ``fn`` runs on a worker thread, since Python cannot stop a
    call from outside; once it overruns, the worker is left to it and the
    next call gets a new one.  Raises :class:`KernelTimeoutError` on overrun.
    """
    global _worker
    if not timeout:
        return fn()
    worker = _worker if _worker is not None else _Worker()
    _worker = worker
    call = _Call(fn)
    worker.calls.put(call)
    try:
        finished = call.done.wait(timeout)
    except BaseException:
        # Ctrl-C while waiting: the call may still be running on that thread.
        _worker = None
        raise
    if not finished:
        _worker = None
        raise KernelTimeoutError(f"no result within {timeout:g} s")
    if call.error is not None:
        raise call.error
    return call.value


def _raised(kernel: Kernel, direction: str, exc: BaseException) -> str:
    frames = exc.__traceback__
    # The frames of this module (the worker thread, the call) are exactref's, not the kernel's.
    while frames is not None and frames.tb_frame.f_code.co_filename == __file__:
        frames = frames.tb_next
    tb = "".join(traceback.format_exception(type(exc), exc, frames))
    return (f"the {kernel.op} {direction} kernel ({kernel.source}) raised "
            f"{type(exc).__name__}: {exc}\n\nIts traceback:\n{tb.rstrip()}")


def _output(value: Any, kernel: Kernel, what: str) -> np.ndarray:
    value = to_numpy(value)
    if isinstance(value, (int, float, complex, np.generic)):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        # A list or tuple is refused too: its dtype would be numpy's guess, not the kernel's.
        kind = f"a {type(value).__name__}" if isinstance(value, (list, tuple)) else type(value).__name__
        raise KernelOutputError(f"the {kernel.op} kernel ({kernel.source}) returned {kind} "
                                f"{value!r:.60} as its {what}; return a torch tensor or a numpy array")
    return value


def _check_names(unknown: list[str], kernel: Kernel, names: list[str]) -> None:
    """Raise for gradient names a backward returned that this case does not have."""
    if not unknown:
        return
    op_names = [f"grad_{n}" for n in OP_INPUTS[kernel.op].inputs]
    extra = [n for n in unknown if n not in op_names]
    if extra:
        what = f"an extra gradient {extra[0]}" if len(extra) == 1 else f"extra gradients {', '.join(extra)}"
        raise KernelOutputError(f"the {kernel.op} backward ({kernel.source}) returned {what} that this op does "
                                f"not have; its gradients are {', '.join(op_names)}")
    raise KernelOutputError(f"the {kernel.op} backward ({kernel.source}) returned gradients {unknown} of "
                            f"inputs that are not arrays in this case; this case's gradients are {names}")


def _gradients(got: Any, kernel: Kernel, array_names: list[str]) -> dict[str, np.ndarray]:
    names = [f"grad_{n}" for n in array_names]
    if isinstance(got, Mapping):
        _check_names(sorted(set(got) - set(names)), kernel, names)
        return {n: _output(v, kernel, n) for n, v in got.items() if v is not None}
    if isinstance(got, (tuple, list)):
        all_names = [f"grad_{n}" for n in OP_INPUTS[kernel.op].inputs]
        if len(got) == len(all_names):
            pairs = zip(all_names, got, strict=True)
        elif len(got) == len(names):
            pairs = zip(names, got, strict=True)
        else:
            raise KernelOutputError(f"the {kernel.op} backward ({kernel.source}) returned {len(got)} values; "
                                    f"return one gradient per input ({', '.join(all_names)}) or a dict by name")
        return {n: _output(v, kernel, n) for n, v in pairs if v is not None and n in names}
    if len(names) == 1:
        return {names[0]: _output(got, kernel, names[0])}
    raise KernelOutputError(f"the {kernel.op} backward ({kernel.source}) returned {type(got).__name__}; "
                            f"return a dict {{{', '.join(repr(n) for n in names)}: ...}} or a tuple in that order")
