"""What the runners of Alpa's upstream suites share: loading an upstream file as a module under
the alias's name, walking a unittest suite, and running one test case."""

from __future__ import annotations

import importlib.util
import sys
import time
import types
import unittest


def load_file(name: str, path: str) -> types.ModuleType:
    """The file ``path`` run as module ``name`` (a submodule of an alias package already in
    ``sys.modules``), e.g. Alpa's own ``alpa/testing.py`` as ``alpa.testing``."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, mod)
    spec.loader.exec_module(mod)
    return mod


def test_cases(suite):
    """The test cases of a (nested) unittest suite, in order."""
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from test_cases(t)
        else:
            yield t


def run_case(test) -> tuple[str, str, float]:
    """(outcome, text, seconds) of one test case: outcome ``pass``, ``skip``, ``fail`` (an
    assertion) or ``error``; text the skip reason or the traceback."""
    result = unittest.TestResult()
    t0 = time.perf_counter()
    test.run(result)
    seconds = time.perf_counter() - t0
    if result.skipped:
        return "skip", result.skipped[0][1], seconds
    if result.failures:
        return "fail", result.failures[0][1], seconds
    if result.errors:
        return "error", result.errors[0][1], seconds
    return "pass", "", seconds
