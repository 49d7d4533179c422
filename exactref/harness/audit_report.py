"""What ``exactref audit`` prints and writes: the table, the counterexamples, and the report with plots."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["bin_counts", "check_report_path", "counted_ratios", "counterexamples", "summary", "table",
           "write_report"]

_COLUMNS = ("op", "format", "direction", "examples", "failures", "worst err/tol", "time", "result")
_SUFFIXES = {".md": "markdown", ".markdown": "markdown", ".html": "html", ".htm": "html"}
#: Ratios below this are drawn in the first bin of a plot (0 is an exact answer).
_FLOOR = 1e-8


def _ratio(r: float) -> str:
    if math.isinf(r):
        return "inf"
    return f"{r:.3g}"


def _note(run: Any) -> str:
    if run.interrupted:
        return "interrupted"
    if run.error is not None:
        return f"error: {type(run.error).__name__}"
    if run.failures and run.cell.known_failure:
        return "known failure"
    if run.failures:
        return "FAIL"
    if run.skipped:
        return "skipped"
    if run.cell.known_failure:
        return "known failure did not show"
    return "ok"


def _with_typical(runs: Sequence[Any]) -> bool:
    # The column appears only where some cell's model declares an order (it has a typical kernel).
    return any(run.typical for run in runs)


def _header(runs: Sequence[Any]) -> list[str]:
    header = list(_COLUMNS)
    if _with_typical(runs):
        header.insert(header.index("worst err/tol") + 1, "err/typical")
    return header


def _rows(runs: Sequence[Any]) -> list[list[str]]:
    rows = []
    typical = _with_typical(runs)
    for run in runs:
        c = run.cell
        row = [c.op, c.fmt, c.direction, str(run.examples), str(len(run.failures)),
               _ratio(run.worst) if run.ratios else "-"]
        if typical:
            row.append(_ratio(max(run.typical)) if run.typical else "-")
        rows.append(row + [f"{run.seconds:.1f}s", _note(run)])
    return rows


def table(runs: Sequence[Any]) -> str:
    """The audit table, one row per op, format and direction, in fixed-width text."""
    header = _header(runs)
    rows = _rows(runs)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = set(range(3, len(header) - 1))

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in pairs)

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header).rstrip(), rule.rstrip(), *(line(r).rstrip() for r in rows)])


def counterexamples(runs: Sequence[Any]) -> str:
    """The minimal counterexamples of every failing cell, and the errors; empty when there are none."""
    blocks = []
    for run in runs:
        if run.error is not None:
            blocks.append(f"== {run.cell.name}: the search could not run\n{type(run.error).__name__}: {run.error}")
        if not run.failures:
            continue
        known = run.cell.known_failure
        title = f"== {run.cell.name}: {len(run.failures)} minimal counterexample{'s' * (len(run.failures) > 1)}"
        if known:
            title += f" (known failure: {known})"
        parts = [title]
        for exc in run.failures:
            kind = getattr(type(exc), "kind", type(exc).__name__)
            where = getattr(type(exc), "where", run.cell.op)
            parts.append(f"-- {kind} in {where}\n{exc}")
        if run.cut_short:
            parts.append("(the search stopped early to keep to the time budget; each case is the smallest seen)")
        blocks.append("\n\n".join(parts))
    if not blocks:
        return ""
    return "\nMinimal counterexamples\n\n" + "\n\n".join(blocks) + "\n\n"


@dataclass
class Status:
    text: str
    failed: bool


def summary(runs: Sequence[Any], elapsed: float, seed: int) -> Status:
    """The closing lines, and whether the audit failed (a mismatch or an error outside known failures)."""
    bad = [r for r in runs if (r.failures and not r.cell.known_failure) or r.error is not None]
    known = [r for r in runs if r.failures and r.cell.known_failure]
    examples = sum(r.examples for r in runs)
    unavailable = sum(r.unavailable for r in runs)
    lines = [f"{len(runs)} cells, {examples} examples in {elapsed:.1f}s (seed {seed}; --seed {seed} repeats it)."]
    if unavailable:
        lines.append(f"{unavailable} drawn cases had no decidable reference (ReferenceUnavailableError) "
                     "and were skipped.")
    if known:
        lines.append(f"{len(known)} cells failed as known: " + ", ".join(r.cell.name for r in known) + ".")
    if bad:
        lines.append(f"FAILED: {len(bad)} cells with mismatches or errors: "
                     + ", ".join(r.cell.name for r in bad) + ".")
    else:
        lines.append("PASSED: no mismatches.")
    return Status("\n".join(lines), bool(bad))


def check_report_path(path: Path) -> str:
    """The report's kind from its suffix; raises if it has another suffix or matplotlib is missing."""
    kind = _SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"--report {path}: the file must end in .md (Markdown) or .html")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("--report draws plots with matplotlib, which is not installed: "
                          "pip install 'exactref[report]' (or pip install matplotlib)") from None
    return kind


def counted_ratios(run: Any) -> tuple[list[float], list[float]]:
    """The ratios the table counts: one per example that passed before the first failure, and one per
    minimal counterexample (a kernel that raised has none).

    A run records a ratio for every call, shrinking included; the examples
    counted come first, one ratio each, so they are the first ``examples``.
    """
    failures = [float(v.worst) for v in (getattr(e, "verdict", None) for e in run.failures) if v is not None]
    return list(run.ratios[:run.examples]), failures


def bin_counts(ratios: Sequence[float], edges: Any) -> Any:
    """How many of ``ratios`` fall in each bin of log10(ratio) between ``edges``, bins closed on the right.

    Closed on the right so that a ratio of exactly 1 (an error equal to the
    tolerance, which covers it) is counted left of the tolerance line.
    Ratios below ``_FLOOR`` (0 included: exact) go to the first bin.
    """
    import numpy as np

    finite = np.array([min(x, 1e300) for x in ratios if math.isfinite(x)], dtype=np.float64)
    values = np.log10(np.maximum(finite, _FLOOR))
    index = np.clip(np.searchsorted(edges, values, side="left") - 1, 0, len(edges) - 2)
    return np.bincount(index, minlength=len(edges) - 1)


PLOT_NOTE = ("Each line counts the examples the table counts (those that passed before a cell's first "
             "failure) by their worst |error| / tolerance; an x marks a minimal counterexample. Left of the "
             "dashed line is covered: a ratio of 1 is an error equal to the tolerance, which a correctly "
             "rounded result reaches where the tolerance is half an ulp.")


def _plot(op: str, runs: Sequence[Any]) -> bytes:
    """A PNG histogram of log10(error/tolerance) of the counted examples of one op, a line per cell."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    series = [(run, *counted_ratios(run)) for run in runs]
    every = [x for _, passed, failed in series for x in passed + failed if math.isfinite(x)]
    top = max(every, default=1.0)
    # Quarter-decade bins from the floor, so that 0 (the tolerance) is an edge.
    high = max(1.0, math.ceil(math.log10(max(min(top, 1e300), _FLOOR)))) + 0.25
    edges = np.arange(math.log10(_FLOOR), high + 0.125, 0.25)
    fig, ax = plt.subplots(figsize=(9, 3.4), dpi=100)
    drawn = False
    for run, passed, failed in series:
        label = f"{run.cell.fmt} {run.cell.direction}"
        if passed:
            line = ax.stairs(bin_counts(passed, edges), edges, label=f"{label} ({len(passed)})")
            drawn = True
        finite = [x for x in failed if math.isfinite(x)]
        if finite:
            color = line.get_edgecolor() if passed else None
            ax.plot(np.log10(np.maximum(finite, _FLOOR)), np.zeros(len(finite)), "x", color=color,
                    markersize=9, label=f"{label}: counterexample")
            drawn = True
    ax.axvline(0.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("log10(worst |error| / tolerance); dashed: the tolerance; left edge: exact")
    ax.set_ylabel("examples (as in the table)")
    ax.set_title(op)
    if drawn:
        # Outside the axes, so that it never covers the data.
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    else:
        ax.text(0.5, 0.5, "no examples ran", transform=ax.transAxes, ha="center", va="center")
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # matplotlib's layout warnings are about the picture, not the audit.
        warnings.simplefilter("ignore", UserWarning)
        fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _by_op(runs: Sequence[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for run in runs:
        out.setdefault(run.cell.op, []).append(run)
    return out


def write_report(path: Path, runs: Sequence[Any], *, kernel_name: str, seed: int, elapsed: float) -> None:
    """Write the Markdown or HTML report: the summary, the table, a plot per op, the counterexamples."""
    kind = check_report_path(path)
    status = summary(runs, elapsed, seed)
    plots = {op: _plot(op, op_runs) for op, op_runs in _by_op(runs).items()}
    header = _header(runs)
    rows = _rows(runs)
    examples = counterexamples(runs).strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "markdown":
        folder = path.with_name(path.stem + "_plots")
        folder.mkdir(exist_ok=True)
        lines = ["# exactref audit", "", f"Kernels: {kernel_name}", "", *status.text.splitlines(), "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines += ["", "## Error/tolerance distribution per op", "", PLOT_NOTE, ""]
        for op, png in plots.items():
            (folder / f"{op}.png").write_bytes(png)
            lines += [f"![{op}]({folder.name}/{op}.png)", ""]
        if examples:
            lines += ["## Minimal counterexamples", "", "```text", examples, "```", ""]
        path.write_text("\n".join(lines), encoding="utf-8")
        return
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    images = "".join(f"<h3>{html.escape(op)}</h3><img alt='{html.escape(op)}' "
                     f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>" for op, png in plots.items())
    body = (f"<h1>exactref audit</h1><p>Kernels: {html.escape(kernel_name)}</p>"
            f"<pre>{html.escape(status.text)}</pre>"
            f"<table><tr>{''.join(f'<th>{html.escape(h)}</th>' for h in header)}</tr>{cells}</table>"
            f"<h2>Error/tolerance distribution per op</h2><p>{html.escape(PLOT_NOTE)}</p>{images}"
            + (f"<h2>Minimal counterexamples</h2><pre>{html.escape(examples)}</pre>" if examples else ""))
    style = "body{font-family:sans-serif}td,th{padding:2px 8px;text-align:right}table{border-collapse:collapse}"
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>exactref audit</title>"
                    f"<style>{style}</style></head><body>{body}</body></html>\n", encoding="utf-8")
