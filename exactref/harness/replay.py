"""Replaying saved ``suite`` regression cases against a kernel module, for the plugin and the audit.

The plugin makes one test item per case; ``exactref audit`` replays every
case of the audited kernel module before it searches, so that a bug once
found is checked again first, whatever the new search draws.  Cases of a
repository's own tests (kind ``test``) need their test, so only pytest
replays them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import ReferenceUnavailableError
from .cases import CaseFileError, SavedCase, decode_case, scan
from .judge import flatten, is_keyed, judge
from .kernels import Kernel

__all__ = ["Replayed", "replay_case", "replay_directory", "stale_reason"]


@dataclass
class Replayed:
    """What replaying one case file gave: ``passed``, ``failed``, ``known`` (a known failure still
    failing), ``skipped``, ``stale`` or ``unreadable``; ``text`` says why, or holds the failure report."""

    path: Path
    outcome: str
    text: str = ""


def stale_reason(saved: SavedCase, kernels: Mapping[str, Kernel], module: str, rel: str) -> str | None:
    """Why the case cannot be replayed against ``kernels`` any more (None when it can)."""
    data = saved.data
    kernel = kernels.get(data["op"])
    if kernel is None:
        return (f"regression case {rel} is stale: the kernel module {module!r} has no {data['op']} kernel now; "
                "delete the file, or restore the kernel")
    if data["format"] not in kernel.formats:
        return (f"regression case {rel} is stale: the {data['op']} kernel no longer declares {data['format']} "
                f"(its formats: {', '.join(kernel.formats)}); delete the file")
    if data["direction"] not in kernel.directions_of(data["format"]):
        return (f"regression case {rel} is stale: the {data['op']} kernel has no backward in {data['format']} "
                "now; delete the file")
    return None


def replay_case(kernel: Kernel, saved: SavedCase, *, device: str, timeout: float | None, note: str) -> None:
    """Judge ``kernel`` on the saved case; raises what :func:`~exactref.harness.judge.judge` raises."""
    data = saved.data
    _, inputs, kwargs, grad = decode_case(data["case"], str(saved.path))
    judge(kernel, data["direction"], inputs, kwargs, grad, device=device, note=note, timeout=timeout)


def replay_directory(directory: Path, kernels: Mapping[str, Kernel], *, module: str, device: str,
                     timeout: float | None, root: Path,
                     cells: set[tuple[str, str, str]] | None = None) -> list[Replayed]:
    """Replay every ``suite`` case in ``directory`` that was found on the kernel module ``module``.

    Cases found on another module are left alone (they are not about these
    kernels); ``test`` cases are left to pytest; with ``cells``, only cases
    of those (op, format, direction).  Reports name files relative to
    ``root``, the repository's root.
    """
    out = []
    for path, saved in scan(directory):
        try:
            rel = str(path.relative_to(root))
        except ValueError:
            rel = str(path)
        if isinstance(saved, CaseFileError):
            out.append(Replayed(path, "unreadable", str(saved)))
            continue
        data = saved.data
        if saved.kind != "suite" or data["kernel"].split(":", 1)[0] != module:
            continue
        if cells is not None and (data["op"], data["format"], data["direction"]) not in cells:
            continue
        stale = stale_reason(saved, kernels, module, rel)
        if stale is not None:
            out.append(Replayed(path, "stale", stale))
            continue
        out.append(_replay_one(kernels[saved.data["op"]], saved, rel, device, timeout))
    return out


def _replay_one(kernel: Kernel, saved: SavedCase, rel: str, device: str, timeout: float | None) -> Replayed:
    note = f"Replayed from the regression case {rel} (first found by {saved.data['test']})."
    try:
        replay_case(kernel, saved, device=device, timeout=timeout, note=note)
    except ReferenceUnavailableError as exc:
        return Replayed(saved.path, "skipped", f"exactref has no decidable reference for this case: {exc}")
    except Exception as exc:
        members = flatten(exc)
        if not all(is_keyed(e) for e in members):
            raise
        known = kernel.known_failure(saved.data["format"], saved.data["direction"])
        text = "\n\n".join(f"-- {getattr(type(e), 'kind', type(e).__name__)} in {type(e).where}\n{e}"
                           for e in members)
        return Replayed(saved.path, "known" if known else "failed", text)
    return Replayed(saved.path, "passed")
