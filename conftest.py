"""Test configuration: 8 fake CPU devices, doctest namespace."""

import os

# Must be set before jax initializes its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
  doctest_namespace["jax"] = jax
  doctest_namespace["jnp"] = jax.numpy
