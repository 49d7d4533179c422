"""Every code block of the user's page (spec/backward.txt) runs verbatim and prints exactly its Output.

The page lives in ../shared/spec/ beside the repository; tests/spec/ keeps a
copy so that a clean checkout can run it, and a test checks the copy is
current whenever the original is present.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
COPY = HERE / "spec" / "backward.txt"
ORIGINAL = HERE.parent.parent / "shared" / "spec" / "backward.txt"


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(code, output) pairs: a 'Code' line, the code, an 'Output' line, the output up to a blank line."""
    pattern = re.compile(r"^Code\n\n(.*?)\n\nOutput\n\n(.*?)(?:\n\n|\Z)", re.S | re.M)
    return [(m.group(1) + "\n", m.group(2).rstrip("\n") + "\n") for m in pattern.finditer(text)]


def test_copy_matches_original():
    if not ORIGINAL.exists():
        pytest.skip("the shared spec is not beside this checkout")
    assert COPY.read_text() == ORIGINAL.read_text()


def test_parser_finds_every_block():
    blocks = code_blocks(COPY.read_text())
    assert len(blocks) == COPY.read_text().count("\nCode\n") + COPY.read_text().startswith("Code\n")
    assert len(blocks) == 3


def test_spec_blocks_print_their_output():
    namespace: dict = {"__name__": "__spec__"}
    for i, (code, expected) in enumerate(code_blocks(COPY.read_text())):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, f"backward.txt block {i + 1}", "exec"), namespace)  # noqa: S102
        assert buf.getvalue() == expected, f"block {i + 1}"
