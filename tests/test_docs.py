"""Every code block of docs/*.md and README.md runs, and prints what the page shows under it.

A ```python block followed directly by a ```text block must print exactly
that text; a ```python block with no ```text block after it must print
nothing.  The blocks of one page run in order in one namespace.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("**/*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)


def blocks(text: str) -> list[tuple[str, str | None, int]]:
    """(code, expected output or None, line) for each python block of a page."""
    found = [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1, m.start(), m.end())
             for m in FENCE.finditer(text)]
    out = []
    for i, (lang, body, line, _, end) in enumerate(found):
        if lang != "python":
            continue
        expected = None
        if i + 1 < len(found):
            nlang, nbody, _, nstart, _ = found[i + 1]
            if nlang == "text" and text[end:nstart].strip() == "":
                expected = nbody
        out.append((body, expected, line))
    return out


def test_blocks_parser_pairs_code_with_its_output():
    page = "intro\n```python\nprint(1)\n```\n\n```text\n1\n```\n```python\nx = 2\n```\n"
    assert blocks(page) == [("print(1)\n", "1\n", 2), ("x = 2\n", None, 9)]


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_print_what_the_page_shows(page: Path):
    namespace: dict = {"__name__": "__docs__"}
    found = blocks(page.read_text())
    for code, expected, line in found:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)  # noqa: S102
        assert buf.getvalue() == (expected or ""), f"{page.name}, block at line {line}"
