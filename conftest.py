"""Test configuration: 8 fake CPU devices and the classic CPU code generator (tests/_xla.py),
one JAX compilation cache per run, doctest namespace."""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
import _xla  # noqa: E402

# Must be set before jax initializes its backends.
os.environ.setdefault("XLA_FLAGS", _xla.flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _compilation_cache_dir() -> str:
  """One JAX compilation cache per test run, shared by the xdist workers and subprocesses.

  Many tests compile the same program (the demo's step in the planner, CLI, demo and
  notebook tests); with the cache each is compiled once per run. A fresh run (CI's clean
  clone) starts empty, so nothing carries over between runs.
  """
  run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
  return os.path.join(tempfile.gettempdir(), f"optax_accum_tests_jax_cache_{run}")


os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _compilation_cache_dir())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
  doctest_namespace["jax"] = jax
  doctest_namespace["jnp"] = jax.numpy
