"""Triton kernels judged through the plugin, on a CPU, in Triton's interpreter (TRITON_INTERPRET=1).

Each test runs pytest (or a script) in a fresh copy of ``triton_repo``: a
tiled matmul (forward and backward) and a FlashAttention-2 style attention
whose backward is the tutorial's, judged under TRITON_FLASH_ATTENTION.  Bugs
are planted through ``tritonkernels/bugs.py``.  Triton is an optional test dependency: without it
these tests are skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Repo, output

pytest.importorskip("triton", reason="the Triton example needs triton (pip install 'triton>=3.0')")

TRITON_REPO = Path(__file__).resolve().parent / "triton_repo"
# Few examples: the interpreter runs each kernel program in Python.
EXAMPLES = ("--exactref", "--exactref-examples", "20")


class TritonRepo(Repo):
    """The Triton example repository, run with the interpreter and without shrinking (slow there)."""

    def plant(self, *bugs: str) -> None:
        """Switch on exactly these planted bugs (none: the kernels are the tutorial's)."""
        (self.root / "tritonkernels" / "bugs.py").write_text(f"BUGS = {set(bugs)!r}\n" if bugs else "BUGS = set()\n")

    def command(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "TRITON_INTERPRET": "1", "HYPOTHESIS_PROFILE": "triton-quick", "COLUMNS": "250"}
        return subprocess.run(argv, cwd=self.root, capture_output=True, text=True, timeout=timeout, env=env, check=False)


@pytest.fixture
def triton_repo(tmp_path: Path) -> TritonRepo:
    root = tmp_path / "triton_repo"
    shutil.copytree(TRITON_REPO, root, ignore=shutil.ignore_patterns("__pycache__", ".hypothesis",
                                                                      "exactref_regressions"))
    r = TritonRepo(root)
    r.plant()
    return r


def test_the_kernels_pass_forward_and_backward(triton_repo: TritonRepo):
    # The tutorial's backward (K * sm_scale / ln 2 and dS rounded to float16) is covered by
    # TRITON_FLASH_ATTENTION: no known failure is left.
    result = triton_repo.run(*EXAMPLES, "-rA")
    text = output(result)
    assert result.returncode == 0, text
    for item in ("matmul[float16-forward]", "matmul[float16-backward]", "matmul[float32-forward]",
                 "matmul[float32-backward]", "scaled_dot_product_attention[float16-forward]",
                 "scaled_dot_product_attention[float16-backward]"):
        assert f"PASSED exactref::{item}" in text, text
    assert "6 passed" in text, text
    assert not triton_repo.cases()


def test_the_tutorial_cases_are_covered_and_need_the_class(triton_repo: TritonRepo):
    # Triton's own test shapes (N_CTX 128 and 256, causal or not, q scaled by 8) and a dS that
    # overflows float16: covered under TRITON_FLASH_ATTENTION, while FLASH_ATTENTION, which does
    # not budget the pre-scaled K rounded to float16, rejects grad_value.
    result = triton_repo.command(sys.executable, "-m", "tritonkernels.tutorial_cases", "TRITON_FLASH_ATTENTION",
                                 "FLASH_ATTENTION")
    text = output(result)
    assert result.returncode == 0, text
    lines = [line for line in text.splitlines() if " not covered" in line]
    cases = ("N_CTX=128 causal=False", "N_CTX=128 causal=True", "N_CTX=256 causal=False",
             "N_CTX=256 causal=True", "dS overflow")
    assert len(lines) == len(cases) * 2 * 4, text
    for case in cases:
        for which in ("out", "grad_query", "grad_key", "grad_value"):
            assert f"{case} TRITON_FLASH_ATTENTION {which}: 0 not covered" in text, text
    rejected = [line for line in lines if "N_CTX" in line and " FLASH_ATTENTION grad_value" in line
                and ": 0 not covered" not in line]
    assert rejected, text


@pytest.mark.parametrize("bugs, failing", [
    # One matmul bug and one attention bug per run: they fail different items.
    (("fp16_accumulation", "pv_fp16_accumulation"),
     ["matmul[float16-forward]", "scaled_dot_product_attention[float16-forward]"]),
    (("drop_last_k_block", "missing_rescale"),
     ["matmul[float16-forward]", "matmul[float32-forward]", "scaled_dot_product_attention[float16-forward]"]),
    (("strict_causal",), ["scaled_dot_product_attention[float16-forward]"]),
], ids=lambda v: "+".join(v) if isinstance(v, tuple) else None)
def test_planted_bugs_are_caught(triton_repo: TritonRepo, bugs: tuple[str, ...], failing: list[str]):
    # The attention items are judged under TRITON_FLASH_ATTENTION (exactref_kernels' model).
    triton_repo.plant(*bugs)
    result = triton_repo.run(*EXAMPLES, "-k", "forward")
    text = output(result)
    assert result.returncode == 1, text
    failed = sorted(line.split(" ")[1] for line in text.splitlines() if line.startswith("FAILED"))
    assert failed == sorted(f"exactref::{item}" for item in failing), text
    # Every failure is saved as a regression case, to replay first on the next run.
    assert {case["test"] for case in triton_repo.cases()} == {f"exactref::{item}" for item in failing}


def test_this_file_is_skipped_cleanly_without_triton(tmp_path: Path):
    # This very file, run where importing triton fails: every test is skipped, none errors.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None  # import triton fails\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                             str(Path(__file__).relative_to(root))],
                            cwd=root, capture_output=True, text=True, timeout=120, env=env, check=False)
    text = result.stdout + result.stderr
    # Skipped whole at import, the module has no tests to collect: pytest's exit status 5.
    assert result.returncode == 5, text
    assert "1 skipped" in text and "the Triton example needs triton" in text, text
