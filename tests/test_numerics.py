"""Tests of optax_accum/_numerics.py: dtype rules, weights, guarded division, finite check."""

from __future__ import annotations

import _compat
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum import _checks, _numerics


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
  with _compat.enable_x64(x64):
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


def test_weighted_add_zero_weight_ignores_nan():
  with _compat.enable_x64(True):
    acc = {"a": jnp.array([1.0, 2.0], jnp.float32), "b": jnp.array(3.0, jnp.float64)}
    nan = {"a": jnp.array([jnp.nan, jnp.inf], jnp.bfloat16), "b": jnp.array(jnp.nan)}
    out = jax.jit(_numerics.weighted_add)(acc, nan, _checks.weight(0))
    np.testing.assert_array_equal(out["a"], [1.0, 2.0])
    np.testing.assert_array_equal(out["b"], 3.0)
    assert out["a"].dtype == jnp.float32 and out["b"].dtype == jnp.float64


def test_weighted_add_accumulates_in_acc_dtype():
  acc = {"a": jnp.zeros(2, jnp.float32)}
  g = {"a": jnp.asarray([0.003, 1.0], jnp.bfloat16)}
  out = jax.jit(_numerics.weighted_add)(acc, g, _checks.weight(3))
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


def _one_window(grads_list, weights, inner=None, **kwargs):
  inner = optax.sgd(1.0) if inner is None else inner
  tx = optax_accum.accumulate(inner, every_k=len(grads_list), **kwargs)
  params = {"a": jnp.zeros(4), "b": jnp.zeros((2, 3))}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g, w in zip(grads_list, weights, strict=True):
    u, state = update(g, state, params, weight=w)
  return u, optax_accum.metrics(state)


def _tree(a, b):
  return {"a": jnp.asarray(a, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


def test_norm_fast_path_matches_float64():
  g1 = _tree([1.0, -2.0, 3.0, 0.5], np.arange(6.0).reshape(2, 3))
  g2 = _tree([0.25, 2.0, -1.0, 4.0], -np.ones((2, 3)))
  u, m = _one_window([g1, g2], [3, 1])
  mean = [
    (3 * np.float64(x) + np.float64(y)) / 4
    for x, y in zip(*(jax.tree.leaves(t) for t in (g1, g2)), strict=True)
  ]
  expect = np.sqrt(sum(np.sum(x**2) for x in mean))
  np.testing.assert_allclose(float(m.grad_norm), expect, rtol=1e-6)
  assert bool(m.updated)
  chex.assert_trees_all_close(jax.tree.leaves(u), [-x for x in mean], rtol=1e-6)


def test_a_mean_whose_squares_overflow_is_skipped_before_adam_sees_it():
  """Issue 47: one sum of squares of the mean decides. Elements near 1e30 square past float32's
  max, so the window counts as not finite (as under shard_optimizer=True): Adam, given that
  mean, would hold an Inf second moment (optax's own update, checked here). Until issue 47 a
  rescaled second pass applied such a window."""
  big = _tree([1e30, -2e30, 0.0, 1.0], np.full((2, 3), 3e30))
  adam = optax.adam(1e-3)
  _, adam_state = adam.update(big, adam.init(big))
  nu = adam_state[0].nu  # ScaleByAdamState inside the chain
  assert not all(np.all(np.isfinite(x)) for x in jax.tree.leaves(nu))
  u, m = _one_window([big], [1])
  assert not bool(m.updated) and int(m.num_skipped) == 1 and not bool(m.has_grad_norm)
  chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, u))
  norm, finite = _numerics.norm_and_finite(big, jnp.float32(1.0))
  assert float(norm) == np.inf and not bool(finite)
  # Just below: |mean| = 2**62 per element, 10 elements square to 10 * 2**124 < float32's max.
  edge = jax.tree.map(lambda x: jnp.full_like(x, 2.0**62), big)
  norm, finite = _numerics.norm_and_finite(edge, jnp.float32(1.0))
  assert bool(finite) and np.isclose(float(norm), np.sqrt(10) * 2.0**62, rtol=1e-6)


@pytest.mark.parametrize("bad, norm_is", [(np.inf, np.isinf), (np.nan, np.isnan)])
def test_non_finite_window_skipped(bad, norm_is):
  g = _tree([1.0, bad, 0.0, 1.0], np.ones((2, 3)))
  u, m = _one_window([g, _tree(np.ones(4), np.ones((2, 3)))], [1, 1])
  assert not bool(m.updated) and int(m.num_skipped) == 1
  # The boundary's norm is Inf/NaN; the state keeps no such value (issue 11, item 1).
  norm, finite = _numerics.norm_and_finite(jax.tree.map(jnp.asarray, g), jnp.float32(2.0))
  assert norm_is(float(norm)) and not bool(finite)
  assert not bool(m.has_grad_norm) and float(m.grad_norm) == 0.0
  chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, u))


def test_mean_that_overflows_only_after_division_is_skipped():
  """A finite sum divided by a tiny weight sum overflows: exactly the old rule."""
  g = _tree(np.full(4, 1e10), np.ones((2, 3)))
  _, m = _one_window([g], [1e-10])  # weight 1e-10: mean = g (gradient of the mean loss)
  assert bool(m.updated)  # the weighted sum is 1, the mean 1e10: finite
  np.testing.assert_allclose(float(m.grad_norm), np.sqrt(4e20 + 6), rtol=1e-6)
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=1, loss_scale=optax_accum.static_loss_scale(1e-20)
  )
  params = {"a": jnp.zeros(4), "b": jnp.zeros((2, 3))}
  _, state = jax.jit(tx.update)(g, tx.init(params), params)
  m = optax_accum.metrics(state)  # mean = g / 1e-20 = 1e50: not finite in float32
  assert not bool(m.updated) and int(m.num_skipped) == 1 and not bool(m.has_grad_norm)


@pytest.mark.parametrize("clip", [0.5, 100.0])
def test_clip_matches_optax(clip):
  g1 = _tree([1.0, -2.0, 3.0, 0.5], np.arange(6.0).reshape(2, 3))
  g2 = _tree([0.25, 2.0, -1.0, 4.0], -np.ones((2, 3)))
  # The clip inside the inner chain clips the window's mean, not each microbatch.
  u, _ = _one_window(
    [g1, g2], [1, 3], inner=optax.chain(optax.clip_by_global_norm(clip), optax.sgd(1.0))
  )
  mean = jax.tree.map(lambda a, b: (a + 3 * b) / 4, g1, g2)
  ref, _ = optax.clip_by_global_norm(clip).update(mean, optax.EmptyState())
  chex.assert_trees_all_close(u, jax.tree.map(lambda x: -x, ref), rtol=1e-6)


@pytest.mark.parametrize("scale", [1e-25, 1e-30, 1e-35])  # squares: 0 in float32
def test_norm_of_tiny_sums_does_not_underflow(scale):
  """Issue 11, item 6: sum(g**2) of a window summed with weight 1e-25 underflowed to 0.

  The fast path reported a norm of 0 (so no clipping). The norm of the mean does not
  depend on the weight: |(3, 4)| = 5 by hand.
  """
  g_sum = {"a": jnp.array([3.0, 0.0], jnp.float32) * scale, "b": jnp.array(4.0 * scale)}
  denom = jnp.asarray(scale, jnp.float32)
  norm, finite = jax.jit(_numerics.norm_and_finite)(g_sum, denom)
  assert bool(finite)
  np.testing.assert_allclose(norm, 5.0, rtol=1e-5)


@pytest.mark.parametrize(
  "value, dtype, denom, norm",
  [
    (300.0, jnp.float16, 1.0, 600.0),  # squares overflow float16: 4 * 300**2 > 65504
    (1e-4, jnp.float16, 1.0, 2e-4),  # squares underflow float16's tiny / eps
    (1e-20, jnp.float32, 1e-37, 2e17),  # squares underflow, a tiny divisor: 2e-20 / 1e-37
    (1e-10, jnp.float32, 1e-20, 2e10),  # the sum's squares underflow, the mean's do not
  ],
)
def test_the_norm_of_the_mean_by_hand(value, dtype, denom, norm):
  """|(v, v, v, v)| / d = 2 v / d where a sum of squares of the window's sum (divided after)
  overflows or underflows: the mean is squared, in float32 for float16 leaves."""
  got, finite = jax.jit(_numerics.norm_and_finite)(
    {"a": jnp.full(4, value, dtype)}, jnp.float32(denom)
  )
  assert bool(finite)
  np.testing.assert_allclose(float(got), norm, rtol=2e-3 if dtype == jnp.float16 else 1e-6)


def test_tiny_weights_are_clipped_in_accumulate():
  """Issue 11, item 6: weight=1e-25 with a 0.5 clip: grad_norm was 0 and nothing clipped.

  With fp16 params an Inf was applied. Expected by hand: mean (3, 4), norm 5, clipped to
  0.5 * (0.6, 0.8) = (0.3, 0.4); an SGD(1) step is its negative.
  """
  for dtype in (jnp.float32, jnp.float16):
    tx = optax_accum.accumulate(optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0)), 2)
    params = {"w": jnp.zeros(2, dtype)}
    grads = {"w": jnp.array([3.0, 4.0], dtype)}
    u, state = tx.update(grads, tx.init(params), params, weight=1e-25, flush=True)
    np.testing.assert_allclose(np.asarray(u["w"], np.float64), [-0.3, -0.4], rtol=1e-3)
    np.testing.assert_allclose(state.grad_norm, 5.0, rtol=1e-5)
    assert bool(state.has_grad_norm) and int(state.num_updates) == 1


def test_mean_dtypes_are_the_wider_of_grads_and_params():
  """Issue 11, item 3: the mean's dtype, leafwise, against numpy's promotion by hand."""
  names = ["float16", "bfloat16", "float32"]
  wider = {("float16", "bfloat16"): "float32", ("bfloat16", "float16"): "float32"}
  for g in names:
    for p in names:
      got = _numerics.mean_dtypes(jnp.zeros(2, g), jnp.zeros(2, p)).dtype
      rank = {"float16": 1, "bfloat16": 1, "float32": 2}
      want = wider.get((g, p), g if rank[g] >= rank[p] else p)
      assert got == jnp.dtype(want), (g, p, got)
  assert _numerics.mean_dtypes(jnp.zeros(2, jnp.bfloat16), None).dtype == jnp.bfloat16
