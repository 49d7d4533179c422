"""Regression case files: a minimal failing case written out exactly, as reviewable JSON.

A value is stored so that it reads back bit for bit (NaN payloads aside):
floats as hex strings (``"0x1.8p+1"``, ``"-0x0p+0"``, ``"inf"``, ``"nan"``),
arrays as a dtype, a shape and nested lists of those strings (a complex
element is a ``[real, imag]`` pair).  Nothing depends on Hypothesis or on the
test's source, so a case keeps replaying when either changes.

Two kinds of case are kept: ``suite`` cases of the built-in property suite
(op, direction, format, kernel module, and the inputs), and ``test`` cases of
a repository's own Hypothesis test (its node id and its drawn arguments).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "VERSION",
    "CaseFileError",
    "SavedCase",
    "decode_value",
    "encode_value",
    "hex_float",
    "read_case",
    "unwritable",
    "write_case",
]

#: The format version written into every file; a reader refuses newer ones.
VERSION = 1
_MARK = "exactref_regression"
_OPCASE = "opcase"


class CaseFileError(ValueError):
    """A regression case file that cannot be used: unreadable, corrupt, or of an unknown version."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"regression case {path}: {reason}")
        self.path = Path(path)
        self.reason = reason


def hex_float(x: float) -> str:
    """The shortest exact hex text of a float: ``0x1.8p+1``, ``-0x0p+0``, ``inf``, ``nan``."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    text = x.hex()
    mantissa, exponent = text.split("p")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}p{exponent}"


def _from_hex(text: Any, where: str) -> float:
    if not isinstance(text, str):
        raise ValueError(f"{where}: {text!r} is not a hex float string such as '0x1.8p+1'")
    try:
        return float.fromhex(text) if text.lower() not in ("nan", "-nan") else math.nan
    except (ValueError, OverflowError):
        raise ValueError(f"{where}: {text!r} is not a hex float string such as '0x1.8p+1'") from None


def _element(v: Any, kind: str) -> Any:
    if kind == "b":
        return bool(v)
    if kind in "iu":
        return int(v)
    if kind == "c":
        c = complex(v)
        return [hex_float(c.real), hex_float(c.imag)]
    return hex_float(float(v))


def _dtype_name(value: Any) -> str | None:
    """The format name of a dtype object (numpy's, ml_dtypes', torch's), or None for anything else."""
    from ..formats import FORMATS, format_of

    is_dtype = isinstance(value, np.dtype) or (type(value).__module__ == "torch" and type(value).__name__ == "dtype") \
        or (isinstance(value, type) and issubclass(value, np.generic))
    if not is_dtype:
        return None
    try:
        return format_of(value).name
    except TypeError:
        raise TypeError(f"cannot save the dtype {value} in a regression case: it is not one of "
                        f"{', '.join(FORMATS)}") from None


def encode_value(value: Any) -> Any:
    """A JSON-ready, exact form of an array, a Python scalar, a tuple, or an OpCase.

    A dtype (a keyword such as scaled_matmul's ``out_dtype``) is stored as its
    format's name, which every op and the harness read back as that dtype.
    """
    name = _dtype_name(value)
    if name is not None:
        return name
    if isinstance(value, np.ndarray) or type(value).__module__.startswith("torch"):
        from ..formats import FORMATS
        from .kernels import to_numpy

        a = to_numpy(value)
        # ml_dtypes' formats (bfloat16, float8) are numpy kind "V"; their values are floats.
        kind = "f" if a.dtype.name in FORMATS and a.dtype.kind == "V" else a.dtype.kind
        as64 = a.astype(np.complex128 if kind == "c" else np.float64) if kind in "fc" else a
        flat = [_element(v, kind) for v in as64.reshape(-1).tolist()]
        return {"dtype": a.dtype.name, "shape": list(a.shape), "values": _nest(flat, a.shape)}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return {"float": hex_float(float(value))}
    if isinstance(value, complex):
        return {"complex": [hex_float(value.real), hex_float(value.imag)]}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v) for v in value]}
    if type(value).__name__ == "OpCase":
        return {_OPCASE: encode_case(value.op, value.inputs, value.kwargs, value.grad)}
    raise TypeError(f"cannot save a value of type {type(value).__name__} in a regression case: {value!r:.80}")


def _nest(flat: list[Any], shape: tuple[int, ...]) -> Any:
    if not shape:
        return flat[0]
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def decode_value(data: Any, where: str = "value") -> Any:
    """The value :func:`encode_value` stored (OpCases come back as dicts; see :func:`decode_case`)."""
    if data is None or isinstance(data, (bool, str, int)):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {data!r:.60} is not a stored value")
    if "float" in data:
        return _from_hex(data["float"], where)
    if "complex" in data:
        re_, im = data["complex"]
        return complex(_from_hex(re_, where), _from_hex(im, where))
    if "tuple" in data:
        return tuple(decode_value(v, where) for v in data["tuple"])
    if _OPCASE in data:
        return data
    if "dtype" in data:
        return _decode_array(data, where)
    raise ValueError(f"{where}: {data!r:.60} is not a stored value")


def flatten(values: Any, depth: int) -> list[Any]:
    """The elements of nested lists ``depth`` levels deep (a complex element is itself a pair)."""
    if depth == 0:
        return [values]
    if not isinstance(values, list):
        raise TypeError(values)
    return [v for row in values for v in flatten(row, depth - 1)]


_INTEGER_DTYPES = tuple(f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64))


def _decode_array(data: dict[str, Any], where: str) -> np.ndarray:
    from ..formats import FORMATS

    dtype, shape = data.get("dtype"), data.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"{where}: shape {shape!r} is not a list of sides")
    try:
        flat = flatten(data.get("values"), len(shape))
    except TypeError:
        raise ValueError(f"{where}: the values are not nested {len(shape)} lists deep") from None
    if len(flat) != math.prod(shape):
        raise ValueError(f"{where}: {len(flat)} values do not fill the shape {tuple(shape)}")
    if dtype == "bool":
        return np.array([bool(v) for v in flat], dtype=bool).reshape(shape)
    if dtype in _INTEGER_DTYPES:
        # encode_value writes integer arrays (indices, say) as plain ints.
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            raise ValueError(f"{where}: the values of a {dtype} array must be integers")
        return np.array(flat, dtype=dtype).reshape(shape)
    if dtype not in FORMATS:
        raise ValueError(f"{where}: dtype {dtype!r} is not one of {', '.join(FORMATS)}, an integer type or bool")
    if FORMATS[dtype].is_complex:
        pairs = [v if isinstance(v, list) and len(v) == 2 else [None, None] for v in flat]
        vals = np.array([complex(_from_hex(r, where), _from_hex(i, where)) for r, i in pairs])
    else:
        vals = np.array([_from_hex(v, where) for v in flat], dtype=np.float64)
    import exactref as er

    # asarray rounds once; the stored values are values of the format, so nothing changes.
    return er.asarray(vals.reshape(shape), dtype)


def encode_case(op: str, inputs: Mapping[str, Any], kwargs: Mapping[str, Any], grad: Any) -> dict[str, Any]:
    return {"op": op, "inputs": {k: encode_value(v) for k, v in inputs.items()},
            "kwargs": {k: encode_value(v) for k, v in kwargs.items()}, "grad": encode_value(grad)}


def decode_case(data: Any, where: str) -> tuple[str, dict[str, Any], dict[str, Any], Any]:
    """op, inputs (in call order), kwargs and grad of a stored case."""
    if not isinstance(data, dict) or not isinstance(data.get("op"), str):
        raise ValueError(f"{where}: the case has no 'op'")
    for key in ("inputs", "kwargs"):
        if not isinstance(data.get(key), dict):
            raise ValueError(f"{where}: the case's {key!r} is not an object")
    inputs = {k: decode_value(v, f"{where} input {k!r}") for k, v in data["inputs"].items()}
    kwargs = {k: decode_value(v, f"{where} keyword {k!r}") for k, v in data["kwargs"].items()}
    names = _check_signature(data["op"], inputs, kwargs, where)
    # Callers pass the inputs positionally, so they go in the op's order whatever the file's.
    inputs = {name: inputs[name] for name in names}
    return data["op"], inputs, kwargs, decode_value(data.get("grad"), f"{where} grad")


def _check_signature(op: str, inputs: Mapping[str, Any], kwargs: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """The op's input names; raises unless the stored inputs and keywords fit its signature.

    Checked when a case is read, so that a hand-edited or truncated file is
    called corrupt instead of replaying into a TypeError inside the op.
    """
    from .kernels import OP_INPUTS

    info = OP_INPUTS.get(op)
    if info is None:
        raise ValueError(f"{where}: op {op!r} is not one of {', '.join(OP_INPUTS)}")
    takes = f"{op} takes {', '.join(info.inputs)}"
    for name in info.inputs:
        if name not in inputs:
            raise ValueError(f"{where}: {op}'s input {name!r} is missing ({takes})")
    for name in inputs:
        if name not in info.inputs:
            raise ValueError(f"{where}: {name!r} is not an input of {op} ({takes})")
    for name in kwargs:
        if name not in info.keywords:
            known = f"its keywords: {', '.join(info.keywords)}" if info.keywords else "it takes none"
            raise ValueError(f"{where}: {name!r} is not a keyword of {op} ({known})")
    return info.inputs


@dataclass
class SavedCase:
    """One regression case file's contents."""

    kind: str  # "suite" or "test"
    test: str  # the pytest node id the case belongs to
    data: dict[str, Any]
    path: Path | None = None

    @property
    def name(self) -> str:
        return self.path.stem if self.path else "unsaved"


def _digest(content: Mapping[str, Any]) -> str:
    # The failure text is left out, so one case gets one file however its message changes.
    stable = {k: v for k, v in content.items() if k != "failure"}
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:12]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "-", text).strip("-")[:80] or "case"


def suite_content(*, test: str, kernel: str, strategy: str, op: str, direction: str, fmt: str,
                  inputs: Mapping[str, Any], kwargs: Mapping[str, Any], grad: Any, model: str,
                  failure: str) -> dict[str, Any]:
    return {_MARK: VERSION, "kind": "suite", "test": test, "kernel": kernel, "op": op, "direction": direction,
            "format": fmt, "model": model, "strategy": strategy, "failure": failure,
            "case": encode_case(op, inputs, kwargs, grad if direction == "backward" else None)}


def content_of_test(*, test: str, arguments: Mapping[str, Any], failure: str) -> dict[str, Any]:
    return {_MARK: VERSION, "kind": "test", "test": test, "failure": failure,
            "arguments": {k: encode_value(v) for k, v in arguments.items()}}


def file_name(content: Mapping[str, Any]) -> str:
    if content["kind"] == "suite":
        stem = f"{content['op']}-{content['direction']}-{content['format']}"
    else:
        stem = content["test"].split("::")[-1]
    return f"{_slug(stem)}-{_digest(content)}.json"


def dumps(value: Any, indent: str = "") -> str:
    """JSON laid out for review: objects one key a line, arrays one row a line."""
    if isinstance(value, dict):
        if not value:
            return "{}"
        inner = indent + "  "
        if set(value) == {"dtype", "shape", "values"}:
            head = f'{{"dtype": {json.dumps(value["dtype"])}, "shape": {json.dumps(value["shape"])}, "values": '
            return head + _rows(value["values"], inner) + "}"
        items = [f"{inner}{json.dumps(k)}: {dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    return json.dumps(value)


def _rows(values: Any, indent: str) -> str:
    flat = json.dumps(values)
    if len(flat) <= 100 or not isinstance(values, list):
        return flat
    inner = indent + "  "
    return "[\n" + ",\n".join(inner + _rows(v, inner) for v in values) + f"\n{indent}]"


def write_case(directory: Path, content: Mapping[str, Any]) -> Path:
    """Write ``content`` into ``directory`` atomically; return its path.

    The name holds a digest of the case, so the same case found twice (by two
    pytest-xdist workers, or by two runs) lands in the same file, and a
    reader never sees half a file: it is written aside and renamed into place.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(content)
    text = dumps(content) + "\n"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        # mkstemp makes the file private; a case file is shared like any source file.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def unwritable(directory: Path, exc: OSError) -> str:
    """The line that says a case could not be written into ``directory``, and why."""
    # mkdir's "File exists" means some part of the path is a file; say which.
    blocking = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        why = f"{blocking} is a file, not a directory"
    else:
        why = exc.strerror or str(exc)
        if exc.filename and str(exc.filename) != str(directory):
            why += f" ({exc.filename})"
    return f"could not save the case: the regressions directory {directory} is not writable: {why}"


def read_case(path: Path) -> SavedCase:
    """Read and check one case file; any problem is a :class:`CaseFileError` naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CaseFileError(path, f"cannot be read: {exc}") from None
    except UnicodeDecodeError as exc:
        raise CaseFileError(path, f"is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                                  "exactref writes case files as UTF-8 JSON: delete the file, or restore it "
                                  "from version control") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise CaseFileError(path, f"is not valid JSON ({exc}); fix it or delete the file") from None
    if not isinstance(data, dict) or _MARK not in data:
        raise CaseFileError(path, f"is not an exactref regression case (no {_MARK!r} field)")
    version = data[_MARK]
    if version != VERSION:
        raise CaseFileError(path, f"has format version {version!r}, but this exactref reads version {VERSION}; "
                                  "upgrade exactref or delete the file")
    kind, test = data.get("kind"), data.get("test")
    if kind not in ("suite", "test") or not isinstance(test, str):
        raise CaseFileError(path, f"has kind {kind!r} and test {test!r}; expected kind 'suite' or 'test' "
                                  "and a test id")
    try:
        if kind == "suite":
            for key in ("op", "direction", "format", "kernel"):
                if not isinstance(data.get(key), str):
                    raise ValueError(f"the field {key!r} is missing or not a string")
            if decode_case(data.get("case"), "case")[0] != data["op"]:
                raise ValueError(f"the case's op {data['case']['op']!r} is not the file's op {data['op']!r}")
            if data["direction"] not in ("forward", "backward"):
                raise ValueError(f"the direction {data['direction']!r} is not 'forward' or 'backward'")
        else:
            if not isinstance(data.get("arguments"), dict):
                raise ValueError("the field 'arguments' is missing")
            for k, v in data["arguments"].items():
                decoded = decode_value(v, f"argument {k!r}")
                if isinstance(decoded, dict):
                    decode_case(decoded[_OPCASE], f"argument {k!r}")
    except (ValueError, TypeError, KeyError) as exc:
        raise CaseFileError(path, f"is corrupt: {exc}; fix it or delete the file") from None
    return SavedCase(kind, test, data, path)


def arguments_of_test(saved: SavedCase) -> dict[str, Any]:
    """The drawn arguments of a ``test`` case, OpCases rebuilt (this imports strategies)."""
    out = {}
    for k, v in saved.data["arguments"].items():
        value = decode_value(v, f"argument {k!r}")
        if isinstance(value, dict):
            from strategies import OpCase

            op, inputs, kwargs, grad = decode_case(value[_OPCASE], f"argument {k!r}")
            value = OpCase(op, inputs, kwargs, grad)
        out[k] = value
    return out


def scan(directory: Path) -> list[tuple[Path, SavedCase | CaseFileError]]:
    """Every ``*.json`` case in ``directory`` (sorted), read, or the error that reading it gave."""
    if not directory.is_dir():
        return []
    out: list[tuple[Path, SavedCase | CaseFileError]] = []
    for path in sorted(directory.glob("*.json")):
        try:
            out.append((path, read_case(path)))
        except CaseFileError as exc:
            out.append((path, exc))
    return out
