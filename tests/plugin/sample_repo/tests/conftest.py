"""Reproducible searches: the same examples on every run, and no example database between runs."""

from hypothesis import settings

settings.register_profile("sample", derandomize=True, database=None, deadline=None)
settings.load_profile("sample")
