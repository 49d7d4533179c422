"""Reproducible searches: the same examples on every run, and no example database between runs.

HYPOTHESIS_PROFILE=triton-quick leaves out shrinking: Triton's interpreter is
slow, and a CI job that only needs to know whether the kernels pass (or that
a known failure still fails) need not wait for minimal cases.
"""

import os
from pathlib import Path

from hypothesis import Phase, settings

settings.register_profile("triton", derandomize=True, database=None, deadline=None)
settings.register_profile("triton-quick", settings.get_profile("triton"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])


def pytest_configure(config):
    # Only in this repository's own runs: a project that holds it as a test fixture keeps its profile.
    if config.rootpath == Path(__file__).resolve().parents[1]:
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "triton"))
