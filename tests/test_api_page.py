"""docs/api.md, the API reference, has one mkdocstrings entry per public name, and no other.

The page is built by ``mkdocs build --strict`` (in ``.ci/run``), which fails
on an entry that does not resolve; this test makes sure that a name added to
an ``__all__`` gets its entry, and a name removed loses it.
"""

from __future__ import annotations

import re
from pathlib import Path

import exactref
import exactref.harness
import exactref.models
import strategies

PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.M)


def entries(text: str) -> list[str]:
    return DIRECTIVE.findall(text)


def test_entries_reads_the_directives_and_nothing_else():
    assert entries("# t\n\n::: exactref.matmul\n\ntext ::: no\n::: strategies.shapes\n") == [
        "exactref.matmul", "strategies.shapes"]


def test_the_api_page_lists_every_public_name_once():
    public = ([f"exactref.{n}" for n in exactref.__all__ if n != "models"]
              + [f"exactref.models.{n}" for n in exactref.models.__all__]
              + [f"exactref.harness.{n}" for n in exactref.harness.__all__]
              + [f"strategies.{n}" for n in strategies.__all__])
    listed = entries(PAGE.read_text(encoding="utf-8"))
    assert sorted(listed) == sorted(public)
    assert len(set(listed)) == len(listed)
