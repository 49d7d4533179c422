"""The examples in every public docstring run and print what they show."""

import doctest
import importlib
import os
import pkgutil

import pytest
from hypothesis import settings

import strategies

MODULES = ["strategies"] + [f"strategies.{m.name}" for m in pkgutil.iter_modules(strategies.__path__)]

# find() takes its settings from the loaded profile; the examples are shrunk
# results, which are the same on every run only when derandomized.
settings.register_profile("strategies-docstrings", derandomize=True, database=None, deadline=None)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    settings.load_profile("strategies-docstrings")
    try:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    finally:
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed; run doctest for details"


def test_every_public_function_has_an_example():
    missing = [name for name in strategies.__all__
               if callable(getattr(strategies, name)) and not isinstance(getattr(strategies, name), type)
               and ">>>" not in (getattr(strategies, name).__doc__ or "")]
    assert not missing, f"no docstring example: {missing}"
