"""Tests of optax_accum/_checks.py: the argument and input checks and their messages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_accum import _checks, _numerics


@pytest.mark.parametrize(
  "weight,exc,match",
  [
    (np.ones(3), ValueError, r"Sum it first"),
    (True, TypeError, r"got a boolean"),
    (np.bool_(True), TypeError, r"got a boolean"),
    (-1, ValueError, r"finite and non-negative"),
    (float("nan"), ValueError, r"finite and non-negative"),
    (float("inf"), ValueError, r"finite and non-negative"),
    (1j, TypeError, r"real number"),
  ],
  ids=["vector", "bool", "np_bool", "negative", "nan", "inf", "complex"],
)
def test_weight_errors(weight, exc, match):
  with pytest.raises(exc, match=match):
    _checks.weight(weight)


def test_weight_valid_and_traced():
  for w in (0, 3, 2.5, np.int64(7), jnp.asarray(4, jnp.int32), jnp.asarray(1.5, jnp.bfloat16)):
    out = _checks.weight(w)
    assert out.shape == () and out.dtype == _numerics.scalar_dtype()
    assert float(out) == float(w)
  # Traced: shape and dtype are checked at trace time, the value cannot be.
  f = jax.jit(_checks.weight)
  assert float(f(jnp.asarray(2.0))) == 2.0
  f(jnp.asarray(-2.0))  # no error
  with pytest.raises(TypeError, match="boolean"):
    f(jnp.asarray(True))
  with pytest.raises(ValueError, match="scalar"):
    f(jnp.ones(2))
