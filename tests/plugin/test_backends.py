"""``exactref audit --backend NAME``: a library's own kernels, and a clear line when the library is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _audit(*args: str, block: str | None = None) -> subprocess.CompletedProcess[str]:
    code = "import sys\n"
    if block is not None:
        code += ("class Block:\n"
                 "    def find_spec(self, name, path=None, target=None):\n"
                 f"        if name.split('.')[0] == {block!r}:\n"
                 "            raise ImportError(f'No module named {name!r}')\n"
                 "sys.meta_path.insert(0, Block())\n")
    code += "from exactref.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, "audit", *args], capture_output=True, text=True, timeout=600)


def test_the_numpy_backend_audits_numpy_and_lists_its_known_failure():
    result = _audit("--backend", "numpy", "--examples", "20", "--seed", "1")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.startswith("exactref audit: exactref.backends.numpy; 23 cells"), out
    rows = {tuple(line.split()[:3]): line for line in out.splitlines() if line.split()[:1] in
            (["matmul"], ["add"], ["multiply"], ["sum"])}
    assert ("matmul", "bfloat16", "forward") not in rows and ("sum", "bfloat16", "forward") in rows
    assert not [line for line in rows.values() if line.endswith("FAIL")], out
    assert rows[("add", "complex64", "forward")].endswith(("known failure", "known failure did not show")), out


@pytest.mark.parametrize(("args", "message"), [
    (("--backend", "fortran"),
     "--backend 'fortran': the backends are torch, numpy, scipy, jax; pass --kernels MODULE for another kernel module"),
    (("--backend", "numpy", "--kernels", "m"), "--backend numpy and --kernels m: pass one of them"),
])
def test_a_bad_backend_is_one_line(args, message):
    result = _audit(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == f"exactref audit: error: {message}", result.stderr


def test_a_backend_whose_library_is_missing_says_how_to_install_it():
    result = _audit("--backend", "torch", "--ops", "add", block="torch")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert 'exactref.backends.torch needs torch' in result.stderr
    assert 'pip install "exactref[torch]"' in result.stderr, result.stderr


def test_the_jax_backend_audits_jax_eagerly_and_prints_a_table():
    pytest.importorskip("jax")
    result = _audit("--backend", "jax", "--ops", "sum", "--dtypes", "float32,complex64", "--examples", "10",
                    "--seed", "1")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.startswith("exactref audit: exactref.backends.jax; 4 cells"), out
    rows = [line.split() for line in out.splitlines() if line.startswith("sum ")]
    assert [r[:3] for r in rows] == [["sum", "float32", "forward"], ["sum", "float32", "backward"],
                                     ["sum", "complex64", "forward"], ["sum", "complex64", "backward"]], out
    assert all(r[-1] == "ok" for r in rows), out


def test_the_jax_backend_without_jax_says_how_to_install_it():
    result = _audit("--backend", "jax", block="jax")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert 'exactref.backends.jax needs jax' in result.stderr and 'pip install "exactref[jax]"' in result.stderr
