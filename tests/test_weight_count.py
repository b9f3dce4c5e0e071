"""Exact weight totals (optax_accum/_weight_count.py), checked against Python's exact integers."""

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _weight_count


def test_window_parts_carry_and_count_exactly():
  rng = np.random.default_rng(0)
  weights = [int(np.float32(x)) for x in rng.integers(0, 2**40, size=50)]  # float32 values
  parts, add = _weight_count.zero_parts(), jax.jit(_weight_count.add_parts)
  for w in weights:
    parts = add(parts, jnp.float32(w))
  assert np.all(np.asarray(parts[1:-1]) < 2**12) and float(parts[0]) == 0
  assert int(_weight_count.count_parts(_weight_count.zeros(), parts)) == sum(weights)


def test_fractional_weights_add_within_float32_rounding():
  count, exact = _weight_count.zeros(), 0.0
  add = jax.jit(_weight_count.add)
  for w in [0.25, 0.5, 0.1, 2**30 + 0.75, 0.3, 7.5]:
    count = add(count, jnp.float32(w))
    exact += float(np.float32(w))
    assert abs(float(count) - exact) <= 1e-6
    assert 0 <= float(count.frac) < 1


def test_weight_count_carries_and_saturates():
  count = _weight_count.zeros()
  for _ in range(3):
    count = _weight_count.add(count, jnp.float32(2**32 - 256))
  assert int(count) == 3 * (2**32 - 256) and int(count.high) == 2
  big = _weight_count.add(
    _weight_count.add(count, jnp.float32(2.0**64)), jnp.float32(2.0**64)
  )  # saturates, never wraps
  assert int(big) == 2**64 - 1
  for bad in (-5.0, np.nan, np.inf):  # adds nothing
    assert int(_weight_count.add(count, jnp.float32(bad))) == int(count)
