"""Tests of optax_accum/_checks.py: the argument and input checks and their messages."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import _compat
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
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


# Issue 11, item 5: no weight, window length or interval is ever wrapped through int32.


@pytest.mark.parametrize(
  "weight,expected",
  [
    (np.int64(3_000_000_000), 3e9),  # became negative through int32
    (np.uint64(2**63), 2.0**63),  # became 0
    (2**40, 2.0**40),  # a Python int above int32
    (np.int64(2**24), 2.0**24),
  ],
)
def test_large_integer_weights_are_exact(weight, expected):
  """Issue 11, item 5: large integer weights are kept exactly (float32 holds these values)."""
  out = _checks.weight(weight)
  assert out.dtype == _numerics.scalar_dtype() and float(out) == expected


@pytest.mark.parametrize(
  "weight,match",
  [
    (2**24 + 1, r"weight=16777217 is not exactly representable in float32"),
    (np.int64(2**62 + 1), r"not exactly representable"),
    (10**40, r"overflows float32"),
    (1e39, r"weight=1e\+39 overflows float32"),
    (1e-46, r"weight=1e-46 rounds to 0 in float32"),  # issue 22: was silently 0
    (np.float64(-3e9), r"finite and non-negative"),
    (np.int64(-3_000_000_000), r"finite and non-negative"),
  ],
)
def test_weights_that_would_wrap_or_overflow_raise(weight, match):
  """Issue 11, item 5: raise, naming the weight and the limit (1e39 was inf in the weight sum)."""
  with pytest.raises(ValueError, match=match):
    _checks.weight(weight)


def test_weight_sum_of_large_weights_in_update():
  """Issue 11, item 5: int64 weights of 3e9 and 1e9 weight the window 3:1 (no wrap)."""
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  params = {"w": jnp.zeros(())}
  state = tx.init(params)
  _, state = tx.update({"w": jnp.array(1.0)}, state, params, weight=np.int64(3_000_000_000))
  assert float(state.window.weight_sum) == 3e9
  u, _ = tx.update({"w": jnp.array(5.0)}, state, params, weight=np.int64(1_000_000_000))
  assert float(u["w"]) == -(3 * 1.0 + 1 * 5.0) / 4


@pytest.mark.parametrize("weight", [Fraction(1, 3), Decimal("2.5")], ids=["Fraction", "Decimal"])
def test_fraction_and_decimal_weights_are_refused(weight):
  """Issue 11, item 7: a named TypeError that says to convert with float."""
  with pytest.raises(
    TypeError,
    match=rf"weight must be an int, a float or an array, got "
    rf"{type(weight).__name__}.*float\(w\)",
  ):
    _checks.weight(weight)


@pytest.mark.parametrize("k", [2**31, np.int64(2**40)])
def test_every_k_above_int32_raises_at_construction(k):
  """Issue 11, item 5: every_k=2**31 raises, naming every_k and the limit 2**31 - 1."""
  with pytest.raises(ValueError, match=r"every_k must be <= 2\*\*31 - 1 = 2147483647"):
    optax_accum.accumulate(optax.sgd(1.0), every_k=k)
  optax_accum.accumulate(optax.sgd(1.0), every_k=2**31 - 1)  # the limit itself is fine


def test_every_k_schedule_values_are_not_wrapped():
  """Issue 11, item 5: a schedule returning 2**32 + 2 gave a window of 2."""
  params = {"w": jnp.zeros(())}
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=lambda n: np.int64(2**32 + 2))
  with pytest.raises(ValueError, match=r"every_k schedule returned 4294967298, above the int32"):
    tx.update({"w": jnp.array(1.0)}, tx.init(params), params)
  # A traced int64 value (x64) saturates at 2**31 - 1 instead of wrapping: no boundary.
  with _compat.enable_x64(True):
    tx = optax_accum.accumulate(optax.sgd(1.0), every_k=lambda n: n.astype(jnp.int64) + (2**32 + 2))
    state = tx.init(params)
    step = jax.jit(tx.update)
    for _ in range(3):
      u, state = step({"w": jnp.array(1.0, jnp.float32)}, state, params)
      assert float(u["w"]) == 0.0
    assert int(state.mini_step) == 3 and int(state.num_updates) == 0


def test_growth_interval_above_int32_raises():
  """Issue 11, item 5: the streak is int32; 2**31 could never be reached."""
  with pytest.raises(ValueError, match=r"growth_interval must be <= 2\*\*31 - 1 = 2147483647"):
    optax_accum.dynamic_loss_scale(growth_interval=2**31)
  optax_accum.dynamic_loss_scale(growth_interval=2**31 - 1)


def test_float64_accumulator_without_x64_is_a_clear_error():
  """Issue 11, item 7: the old message read "is float32 but the accumulator is float32"."""
  with _compat.enable_x64(False):
    with pytest.raises(
      TypeError, match=r"accumulator_dtype=float64 needs 64-bit JAX.*jax_enable_x64"
    ):
      optax_accum.accumulate(optax.sgd(1.0), 2, accumulator_dtype=jnp.float64)
  with _compat.enable_x64(True):
    tx = optax_accum.accumulate(optax.sgd(1.0), 2, accumulator_dtype=jnp.float64)
    assert tx.init({"w": jnp.zeros(2, jnp.float32)}).window.grad_sum["w"].dtype == jnp.float64


@pytest.mark.parametrize("axis_name", [0, ("data", 1), (), ["data"], b"data"])
def test_axis_name_must_be_str_or_tuple_of_str(axis_name):
  """Issue 11, item 7: a bad axis_name raised deep inside psum at the first boundary."""
  with pytest.raises(TypeError, match=r"axis_name must be None, a mesh axis name"):
    optax_accum.accumulate(optax.sgd(1.0), 2, axis_name=axis_name)


# Issue 11, item 4: a state made with or without a loss scale is refused by the other; issue 48:
# the policy is configuration, the scale in force is data (the state's).

LOSS_SCALES = {
  "none": lambda: None,
  "static128": lambda: optax_accum.static_loss_scale(128.0),
  "static1024": lambda: optax_accum.static_loss_scale(1024.0),
  "dynamic": lambda: optax_accum.dynamic_loss_scale(init_scale=2.0**8),
}


@pytest.mark.parametrize("saved", sorted(LOSS_SCALES))
@pytest.mark.parametrize("resumed", sorted(LOSS_SCALES))
def test_eager_update_refuses_a_state_with_or_without_a_loss_scale(saved, resumed):
  """Issue 11, item 4: dynamic(2**8) into no scale divided every mean by 256, silently: the
  sub-states differ, so it is refused. Between two scales the state's value is in force: the
  window's gradients (scaled by it, as metrics(state).loss_scale says) come back unscaled."""
  params = {"w": jnp.zeros(2)}
  state = optax_accum.accumulate(optax.sgd(1.0), 2, loss_scale=LOSS_SCALES[saved]()).init(params)
  tx = optax_accum.accumulate(optax.sgd(1.0), 2, loss_scale=LOSS_SCALES[resumed]())
  if (saved == "none") != (resumed == "none"):
    with pytest.raises(ValueError, match="loss_scale="):
      tx.update({"w": jnp.ones(2)}, state, params)
    return
  scale = float(optax_accum.metrics(state).loss_scale)  # what the user scales the loss by
  for _ in range(2):
    u, state = tx.update({"w": jnp.full(2, 3.0 * scale)}, state, params)
  np.testing.assert_array_equal(u["w"], [-3.0, -3.0])  # sgd(1) of the unscaled mean, 3
