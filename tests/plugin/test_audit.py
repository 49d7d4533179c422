"""``exactref audit`` on PyTorch's CPU kernels and on the sample's broken ones, its flags, and its report."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from .conftest import Repo, output


@pytest.fixture(scope="module")
def default_audit(tmp_path_factory) -> subprocess.CompletedProcess[str]:
    """The default run, once: every op exactref has, every format, forward and backward, on PyTorch's
    CPU kernels (the directory has no [tool.exactref], so nothing else is configured)."""
    # How long it takes is benchmarks/bench_audit.py's to say; the timeout only stops a hang.
    return Repo(tmp_path_factory.mktemp("plain")).audit("--seed", "0", timeout=900)


def test_the_default_audit_covers_every_op_format_and_direction(default_audit):
    import torch

    from exactref.backends.torch import _float8

    result = default_audit
    text = output(result)
    # 86 cells, and the float8 ones, forward only: matmul in the four formats torch.matmul computes on
    # the CPU, scaled_matmul in those _scaled_mm takes on this CPU, as the backend's probe finds them:
    # the two oneDNN takes with AMX, all four on the emulated path (tests/plugin/test_float8_audit.py).
    scaled = _float8("cpu", bool(torch.backends.mkldnn.enabled))[1]
    assert len(scaled) in (2, 4)
    cells = 86 + 4 + len(scaled)
    assert "exactref.backends.torch (PyTorch" in text and f"{cells} cells" in text
    for op, formats in [("matmul", 6), ("gemm", 6), ("add", 6), ("multiply", 6), ("sum", 6),
                        ("scaled_dot_product_attention", 4), ("matrix_exp", 6)]:
        rows = re.findall(rf"^{op} +(?!float8)\S+ +(forward|backward) +\d+ ", text, re.M)
        assert sorted(rows) == ["backward"] * formats + ["forward"] * formats, (op, rows)
    assert len(re.findall(r"^matrix_exp_frechet +\S+ +forward ", text, re.M)) == 6
    assert re.findall(r"^matmul +(float8\S+) +(forward|backward) ", text, re.M) == [
        (f, "forward") for f in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")]
    assert re.findall(r"^scaled_matmul +(\S+) +(forward|backward) ", text, re.M) == [
        (f, "forward") for f in scaled]
    assert scaled[:2] == ("float8_e4m3fn", "float8_e5m2")
    # PyTorch's half-format matrix_exp is wrong (docs/matrix-exp.md): reported, but as known.
    assert re.search(r"^matrix_exp +float16 +forward +\d+ +[1-9]\d* .* known failure$", text, re.M), text
    assert f"2/{cells}" not in result.stdout  # the progress bar goes to stderr, the table to stdout
    assert f"{cells}/{cells} cells" in result.stderr


def test_the_default_audit_passes_on_pytorchs_cpu_kernels(default_audit):
    result = default_audit
    assert "PASSED: no mismatches." in result.stdout, output(result)
    assert result.returncode == 0


def test_the_audit_fails_on_broken_kernels_with_minimal_counterexamples(repo: Repo):
    repo.plant("fp16_accumulation", "missing_conj")
    result = repo.audit("--ops", "matmul", "--dtypes", "float16,complex64", "--examples", "100", "--seed", "3")
    text = output(result)
    assert result.returncode == 1, text
    # The configured kernels ([tool.exactref] kernels) are the ones audited.
    assert "mykernels.exactref_kernels; 4 cells" in text
    header = text[text.index("op "):].splitlines()[0].split()
    assert header == ["op", "format", "direction", "examples", "failures", "worst", "err/tol", "time", "result"]
    assert re.search(r"^matmul +float16 +forward +\d+ +[1-9]\d* +\S+ +[\d.]+s +FAIL", text, re.M), text
    assert re.search(r"^matmul +complex64 +backward +\d+ +[1-9]\d* +\S+ +[\d.]+s +FAIL", text, re.M), text
    assert re.search(r"^matmul +float16 +backward +\d+ +0 ", text, re.M), text
    assert "Minimal counterexamples" in text
    assert "== matmul[float16-forward]" in text and "-- OutOfToleranceError in matmul.grad_A" in text
    assert re.search(r"Inputs, exactly:\n  A: float16 \(\d, \d\) \[\[0x", text), text
    assert "FAILED: 2 cells with mismatches" in text


def test_the_audit_is_reproducible_with_a_seed(repo: Repo):
    repo.plant("add_raises")
    args = ("--ops", "add,matmul", "--dtypes", "float32", "--examples", "30", "--seed", "11")
    runs = []
    for _ in range(2):
        runs.append(output(repo.audit(*args)))
        # The first run saves its cases, which the second would replay before searching.
        shutil.rmtree(repo.regressions, ignore_errors=True)

    def without_times(text: str) -> str:
        return re.sub(r"\d+\.\ds\b", "T", text[text.index("op "):])

    assert without_times(runs[0]) == without_times(runs[1])
    assert "seed 11" in runs[0] and "KernelRaisedError in add.forward" in runs[0]


@pytest.mark.parametrize("suffix", [".html", ".md"])
def test_report_writes_its_file_with_plots(repo: Repo, tmp_path, suffix):
    pytest.importorskip("matplotlib")
    target = tmp_path / f"audit{suffix}"
    result = repo.audit("--kernels", "exactref.backends.torch", "--ops", "matmul,sum", "--dtypes", "float32",
                        "--examples", "10", "--seed", "1", "--report", str(target))
    assert result.returncode == 0, output(result)
    text = target.read_text()
    assert "exactref audit" in text and "matmul" in text and "sum" in text
    if suffix == ".html":
        assert text.count("<img alt=") == 2 and "data:image/png;base64,iVBOR" in text
    else:
        plots = sorted(p.name for p in (tmp_path / "audit_plots").iterdir())
        assert plots == ["matmul.png", "sum.png"]
        assert (tmp_path / "audit_plots" / "matmul.png").read_bytes()[:4] == b"\x89PNG"
        assert "![matmul](audit_plots/matmul.png)" in text
        table = [line for line in text.splitlines() if line.startswith("|")]
        assert table[0].startswith("| op |") and len(table) == 2 + 4  # header, rule, 2 ops x 2 directions
        assert len({line.count("|") for line in table}) == 1, table  # every row as wide as the header


def test_report_without_matplotlib_is_a_clear_error(repo: Repo, tmp_path):
    blocked = ("import sys\nsys.modules['matplotlib'] = None\nfrom exactref.cli import main\n"
               f"sys.exit(main(['audit', '--ops', 'add', '--report', {str(tmp_path / 'r.html')!r}]))\n")
    result = repo.command(sys.executable, "-c", blocked)
    assert result.returncode == 2
    assert "pip install 'exactref[report]'" in output(result)
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("args, message", [
    (("--device", "cuda"), "--device cuda: no CUDA device is available here"),
    (("--ops", "matmull"), "ops names 'matmull' (on the command line), which is not an op; "
                           "use names from: matmul, gemm"),
    (("--dtypes", "float8"), "formats names 'float8' (on the command line), which is not a format"),
    (("--report", "out.txt"), "--report out.txt: the file must end in .md (Markdown) or .html"),
    (("--kernels", "mykernels.nowhere"), "could not import the kernel module 'mykernels.nowhere'"),
    (("--strategies", "mykernels.nowhere"),
     "could not import the strategy module 'mykernels.nowhere'"),
])
def test_bad_flags_are_clear_errors(repo: Repo, args, message):
    pytest.importorskip("matplotlib")
    if args[0] == "--device":
        torch = pytest.importorskip("torch")
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    result = repo.audit(*args)
    assert result.returncode == 2, output(result)
    assert message in output(result)
    assert "Traceback" not in output(result)


def test_the_installed_command_runs(repo: Repo):
    command = shutil.which("exactref")
    assert command, "the exactref console script is not installed (pip install -e .)"
    result = repo.command(command, "audit", "--kernels", "exactref.backends.torch", "--ops", "sum",
                          "--dtypes", "float64", "--examples", "5", "--seed", "0")
    assert result.returncode == 0, output(result)
    assert "PASSED: no mismatches." in result.stdout
    assert "2/2 cells" in result.stderr  # the progress bar
