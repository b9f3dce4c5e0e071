"""Tests of optax_accum/_numerics.py: dtype rules, weights, guarded division, finite check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_accum import _numerics


@pytest.mark.parametrize(
  "grad_dtype,x64,expected",
  [
    (jnp.bfloat16, False, jnp.float32),
    (jnp.float16, False, jnp.float32),
    (jnp.float32, False, jnp.float32),
    (jnp.float32, True, jnp.float32),
    (jnp.float64, True, jnp.float64),
    (jnp.complex64, False, jnp.complex64),
    (jnp.complex128, True, jnp.complex128),
  ],
)
def test_accumulator_dtype_default_rule(grad_dtype, x64, expected):
  with jax.enable_x64(x64):
    assert _numerics.accumulator_dtype(grad_dtype) == jnp.dtype(expected)
    assert _numerics.scalar_dtype() == jnp.dtype(jnp.float64 if x64 else jnp.float32)


def test_accumulator_dtype_override_and_errors():
  assert _numerics.accumulator_dtype(jnp.bfloat16, jnp.bfloat16) == jnp.dtype(jnp.bfloat16)
  assert _numerics.accumulator_dtype(jnp.complex64, jnp.complex64) == jnp.dtype(jnp.complex64)
  with pytest.raises(TypeError, match="filter them out of the params tree"):
    _numerics.accumulator_dtype(jnp.int32)
  with pytest.raises(TypeError, match="must be a float or complex dtype"):
    _numerics.accumulator_dtype(jnp.float32, jnp.int32)
  with pytest.raises(TypeError, match="would drop the imaginary part"):
    _numerics.accumulator_dtype(jnp.complex64, jnp.float32)


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
def test_check_weight_errors(weight, exc, match):
  with pytest.raises(exc, match=match):
    _numerics.check_weight(weight)


def test_check_weight_valid_and_traced():
  for w in (0, 3, 2.5, np.int64(7), jnp.asarray(4, jnp.int32), jnp.asarray(1.5, jnp.bfloat16)):
    out = _numerics.check_weight(w)
    assert out.shape == () and out.dtype == _numerics.scalar_dtype()
    assert float(out) == float(w)
  # Traced: shape and dtype are checked at trace time, the value cannot be.
  f = jax.jit(_numerics.check_weight)
  assert float(f(jnp.asarray(2.0))) == 2.0
  f(jnp.asarray(-2.0))  # no error
  with pytest.raises(TypeError, match="boolean"):
    f(jnp.asarray(True))
  with pytest.raises(ValueError, match="scalar"):
    f(jnp.ones(2))


def test_weighted_add_zero_weight_ignores_nan():
  with jax.enable_x64(True):
    acc = {"a": jnp.array([1.0, 2.0], jnp.float32), "b": jnp.array(3.0, jnp.float64)}
    nan = {"a": jnp.array([jnp.nan, jnp.inf], jnp.bfloat16), "b": jnp.array(jnp.nan)}
    out = jax.jit(_numerics.weighted_add)(acc, nan, _numerics.check_weight(0))
    np.testing.assert_array_equal(out["a"], [1.0, 2.0])
    np.testing.assert_array_equal(out["b"], 3.0)
    assert out["a"].dtype == jnp.float32 and out["b"].dtype == jnp.float64


def test_weighted_add_accumulates_in_acc_dtype():
  acc = {"a": jnp.zeros(2, jnp.float32)}
  g = {"a": jnp.asarray([0.003, 1.0], jnp.bfloat16)}
  out = jax.jit(_numerics.weighted_add)(acc, g, _numerics.check_weight(3))
  assert out["a"].dtype == jnp.float32
  expected = 3 * np.asarray(g["a"].astype(jnp.float32), np.float64)
  np.testing.assert_allclose(out["a"], expected, rtol=1e-7)


def test_guarded_divide():
  tree = {"a": jnp.array([2.0, -4.0]), "b": jnp.array(0.0), "c": jnp.array(1.0 + 1.0j)}
  div = jax.jit(_numerics.guarded_divide)
  out = div(tree, jnp.float32(4.0))
  np.testing.assert_array_equal(out["a"], [0.5, -1.0])
  assert complex(out["c"]) == 0.25 + 0.25j
  # A zero denominator gives zeros, never 0/0 = NaN (not even for a zero numerator).
  out = div(tree, jnp.float32(0.0))
  for leaf in jax.tree.leaves(out):
    assert np.all(np.asarray(leaf) == 0) and not np.any(np.signbit(np.asarray(leaf).real))
  # The gradient through the guard is finite too (no NaN from the untaken branch).
  g = jax.grad(lambda d: _numerics.guarded_divide(jnp.array(3.0), d))(jnp.float32(0.0))
  assert float(g) == 0.0


def test_all_finite():
  f = jax.jit(_numerics.all_finite)
  assert bool(f({"a": jnp.ones(3), "b": jnp.zeros((2, 2), jnp.bfloat16)}))
  assert not bool(f({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
  assert not bool(f({"a": jnp.array(jnp.nan), "b": jnp.ones(2)}))
  assert not bool(f({"c": jnp.array(1.0 + 1j * jnp.nan)}))
  assert bool(f({}))
  assert bool(f({"a": None}))


def test_saturating_increment():
  top = jnp.asarray(_numerics.COUNTER_MAX, jnp.int32)
  inc = jax.jit(_numerics.saturating_increment)
  assert int(inc(top)) == _numerics.COUNTER_MAX
  assert int(inc(top - 1)) == _numerics.COUNTER_MAX
  assert int(inc(jnp.int32(5), False)) == 5
  assert int(inc(jnp.int32(5), jnp.asarray(True))) == 6
