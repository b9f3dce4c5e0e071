"""optax_accum/_step.py under mixed precision: loss scaling, clip-after-accumulate, non-finite.

The pure loss-scale rule is tested in ``tests/test_loss_scale.py``. Reference cases C4, C5, C8,
C9 and C10 appear here with a loss scale. Expected values are hand-worked numbers, ``jax.grad``
over the concatenated batch, or a run without the feature under test (bitwise, where scaling by
a power of two is exact).
"""

import functools
import math
import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite

import optax_accum

ROOT = pathlib.Path(__file__).resolve().parents[1]
INF, NAN = float("inf"), float("nan")


def _scaled_value_and_grad(loss_fn):
  """``(loss, grad of loss * scale)`` with the scale in force read from the state (the loss in
  float32), as a gradient helper hands them to ``accumulate(loss_scale=...)``."""

  def scaled(params, scale, *args):
    loss = jnp.asarray(loss_fn(params, *args)).astype(jnp.float32)
    return loss * scale, loss

  def value_and_grad(state, params, *args):
    scale = optax_accum.metrics(state).loss_scale
    (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params, scale, *args)
    return loss, grads

  return value_and_grad


def _jit_update(tx):
  """``tx.update(grads, state, params, weight=weight)`` under jit."""

  @jax.jit
  def step(grads, state, params, weight):
    return tx.update(grads, state, params, weight=weight)

  return step


def _scaled(grads, state):
  """What ``jax.grad(loss * scale)`` would be for a model whose loss gradient is ``grads``."""
  scale = optax_accum.metrics(state).loss_scale
  return jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) * scale, grads)


def _all_finite(tree):
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


def _window_is_reset(state):
  s = optax_accum._state.find_state(state)
  assert int(s.mini_step) == 0 and float(s.window.weight_sum) == 0.0
  for leaf in jax.tree.leaves(s.window.grad_sum):
    np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


# ---------------------------------------------------------------------------------------------
# C8: the loss scale changes only at boundaries.


def test_c8_loss_scale_changes_only_at_boundaries():
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**10, growth_interval=2)
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, loss_scale=rule)
  step = _jit_update(tx)
  params = jnp.zeros((), jnp.float32)
  state = tx.init(params)
  windows = [[1.0, 3.0], [2.0, 2.0], [INF, 1.0], [4.0, 0.0]]
  in_force = []
  for window in windows:
    in_force.append(float(optax_accum.metrics(state).loss_scale))
    for g in window:
      assert float(optax_accum.metrics(state).loss_scale) == in_force[-1]  # not inside a window
      updates, state = step(_scaled(g, state), state, params, 1.0)
      params = optax.apply_updates(params, updates)
  m = optax_accum.metrics(state)
  assert float(params) == -6.0  # updates of -2 at windows 1, 2 and 4
  assert in_force == [1024.0, 1024.0, 2048.0, 1024.0]
  assert float(m.loss_scale) == 1024.0
  assert (int(m.num_updates), int(m.num_skipped)) == (3, 1)


# ---------------------------------------------------------------------------------------------
# C9: clip the accumulated gradient, not each microbatch.


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "dynamic-scale"])
def test_c9_clip_after_accumulate(scaled):
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**10) if scaled else None
  clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  tx = optax_accum.accumulate(clipped, every_k=2, loss_scale=rule)
  step = _jit_update(tx)
  params = jnp.zeros(2, jnp.float32)
  state = tx.init(params)
  for g in ([3.0, 0.0], [0.0, 4.0]):
    updates, state = step(_scaled(jnp.asarray(g), state), state, params, 1.0)
  # Mean (1.5, 2.0), norm 2.5, clipped (0.6, 0.8); sgd(1) emits minus that.
  np.testing.assert_allclose(updates, [-0.6, -0.8], rtol=1e-6)
  m = optax_accum.metrics(state)
  np.testing.assert_allclose(m.grad_norm, 2.5, rtol=1e-6)  # recorded before clipping
  assert int(m.num_updates) == 1

  # The fault this catches: clipping each microbatch first gives (0.5, 0.5).
  wrong = optax.chain(optax.clip_by_global_norm(1.0), optax_accum.accumulate(optax.sgd(1.0), 2))
  wstate = wrong.init(params)
  for g in ([3.0, 0.0], [0.0, 4.0]):
    wupdates, wstate = jax.jit(wrong.update)(jnp.asarray(g), wstate, params)
  np.testing.assert_allclose(wupdates, [-0.5, -0.5], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# M2: linear regression on padded microbatches (masked mean loss, weight = unmasked count).


def _m2_data(num_windows, every_k, seed=0, size=6):
  rng = np.random.default_rng(seed)
  n = num_windows * every_k
  x = rng.normal(size=(n, size, 3)).astype(np.float32)
  y = rng.normal(size=(n, size)).astype(np.float32)
  mask = (rng.random((n, size)) < 0.6).astype(np.float32)
  mask[:, 0] = 1.0
  return [
    {"x": jnp.asarray(x[i]), "y": jnp.asarray(y[i]), "mask": jnp.asarray(mask[i])} for i in range(n)
  ]


def _m2_loss(params, batch):
  err = (batch["x"] @ params["theta"] + params["b"] - batch["y"]) ** 2
  return 0.5 * (err * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1.0)


def _m2_params():
  return {"theta": jnp.asarray([0.5, -1.0, 0.25], jnp.float32), "b": jnp.asarray(0.1, jnp.float32)}


def _concat(batches):
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches)


def _run_m2(tx, batches, scaled):
  """Runs ``tx`` over ``batches``; returns params, every emitted update and the state."""
  grad_fn = _scaled_value_and_grad(_m2_loss) if scaled else None

  @jax.jit
  def step(params, state, batch):
    if scaled:
      loss, grads = grad_fn(state, params, batch)
    else:
      loss, grads = jax.value_and_grad(_m2_loss)(params, batch)
    updates, state = tx.update(grads, state, params, weight=batch["mask"].sum(), value=loss)
    return optax.apply_updates(params, updates), state, updates

  params = _m2_params()
  state = tx.init(params)
  emitted = []
  for batch in batches:
    params, state, updates = step(params, state, batch)
    emitted.append(updates)
  return params, emitted, state


_ADAMW = optax.adamw(1e-2, weight_decay=1e-2)


@functools.cache
def _unscaled_adamw_run():
  return _run_m2(optax_accum.accumulate(_ADAMW, 3), _m2_data(num_windows=3, every_k=3), False)


@pytest.mark.parametrize(
  "rule",
  [
    optax_accum.static_loss_scale(2.0**7),
    optax_accum.dynamic_loss_scale(init_scale=2.0**12, growth_interval=1),
  ],
  ids=["static-2**7", "dynamic-growing"],
)
def test_power_of_two_scale_is_bitwise_invisible(rule):
  ref_params, ref_updates, ref_state = _unscaled_adamw_run()
  tx = optax_accum.accumulate(_ADAMW, 3, loss_scale=rule)
  params, updates, state = _run_m2(tx, _m2_data(num_windows=3, every_k=3), True)
  chex.assert_trees_all_equal(params, ref_params)
  chex.assert_trees_all_equal(updates, ref_updates)
  chex.assert_trees_all_equal(state.inner_state, ref_state.inner_state)
  chex.assert_trees_all_equal(
    (state.grad_norm, state.window_loss, state.num_updates),
    (ref_state.grad_norm, ref_state.window_loss, ref_state.num_updates),
  )
  if isinstance(rule, optax_accum._loss_scale.DynamicLossScale):
    assert float(state.loss_scale.scale) == 2.0**15  # grew once per window: the scale did move


def test_the_clip_in_the_inner_chain_records_the_preclip_norm():
  batches = _m2_data(num_windows=2, every_k=3, seed=1)
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**8, growth_interval=1)
  inner_clip = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))
  chained = optax_accum.accumulate(inner_clip, 3, loss_scale=rule)
  _, _, s1 = _run_m2(chained, batches, True)

  # The recorded norm is that of the unscaled, unclipped mean of the last window, computed
  # independently: one jax.grad over its concatenated microbatches at the params it started from.
  p_mid = _run_m2(optax_accum.accumulate(inner_clip, 3), batches[:3], False)[0]
  g = jax.grad(_m2_loss)(p_mid, _concat(batches[3:]))
  want = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(g)))
  assert want > 0.5  # the clip was active
  m = optax_accum.metrics(s1)
  np.testing.assert_allclose(m.grad_norm, want, rtol=1e-5)
  assert (float(m.loss_scale), int(m.num_skipped), int(m.num_updates)) == (2.0**10, 0, 2)


# ---------------------------------------------------------------------------------------------
# C10: one non-finite microbatch must not poison later windows (with a dynamic scale).


def test_c10_nan_window_skipped_scale_halved_once():
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**10, growth_interval=1000)
  inner = optax.sgd(0.5, momentum=0.9)
  tx = optax_accum.accumulate(inner, every_k=3, loss_scale=rule)
  step = _jit_update(tx)
  ys = [[1.0, 2.0, 3.0], [4.0, 6.0, 11.0], [-2.0, 0.5, 7.0]]

  def m1_grad(w, y):  # per-item loss 0.5 * (w - y)**2
    return jax.grad(lambda w: 0.5 * (w - y) ** 2)(w)

  params = jnp.zeros((), jnp.float32)
  state = tx.init(params)
  init_inner = state.inner_state
  for window, window_ys in enumerate(ys):
    for j, y in enumerate(window_ys):
      g = jnp.asarray(NAN) if (window, j) == (0, 1) else m1_grad(params, y)
      updates, state = step(_scaled(g, state), state, params, 1.0)
      params = optax.apply_updates(params, updates)
      assert _all_finite((params, updates, state.inner_state))
      if j == 2:  # after the boundary the window holds nothing, NaN included
        assert _all_finite((state.window.grad_sum, state.window.weight_sum, state.window.value_sum))
      else:
        assert float(updates) == 0.0  # exact zeros between boundaries, NaN input or not
    if window == 0:
      assert float(params) == 0.0
      chex.assert_trees_all_equal(state.inner_state, init_inner)
      assert (int(state.num_skipped), int(state.num_updates)) == (1, 0)
      assert float(state.loss_scale.scale) == 2.0**9
      _window_is_reset(state)

  # Reference: windows 2 and 3 alone, each the gradient of its concatenated batch's mean loss.
  w, ref_state = jnp.zeros(()), inner.init(jnp.zeros(()))
  for window_ys in ys[1:]:
    y = jnp.asarray(window_ys)
    g = jax.grad(lambda w, y=y: jnp.mean(0.5 * (w - y) ** 2))(w)
    u, ref_state = inner.update(g, ref_state, w)
    w = optax.apply_updates(w, u)
  np.testing.assert_allclose(params, w, rtol=1e-6)
  chex.assert_trees_all_close(state.inner_state, ref_state, rtol=1e-6)
  m = optax_accum.metrics(state)
  assert (int(m.num_updates), int(m.num_skipped), float(m.loss_scale)) == (2, 1, 2.0**9)


# ---------------------------------------------------------------------------------------------
# Overflow at every position of a window, Inf and NaN.

_OVERFLOW_RULE = optax_accum.dynamic_loss_scale(init_scale=2.0**10, growth_interval=1000)
_OVERFLOW_TX = optax_accum.accumulate(optax.adam(0.1), every_k=3, loss_scale=_OVERFLOW_RULE)
_overflow_step = jax.jit(
  chex.assert_max_traces(lambda g, s, p: _OVERFLOW_TX.update(g, s, p, weight=jnp.float32(2.0)), n=1)
)


@pytest.mark.parametrize("bad", [INF, -INF, NAN], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("position", [0, 1, 2], ids=["first", "middle", "last"])
def test_overflow_anywhere_in_window_skips_it_and_halves_once(position, bad):
  params = {"w": jnp.asarray([1.0, -2.0], jnp.float32)}
  state = _OVERFLOW_TX.init(params)
  init_inner = state.inner_state
  window1 = [[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]]
  window1[position] = [0.25, bad]
  window2 = [[2.0, 4.0], [-6.0, 1.0], [1.0, 1.0]]
  for g in window1:
    updates, state = _overflow_step(_scaled({"w": jnp.asarray(g)}, state), state, params)
    assert float(optax_accum.metrics(state).loss_scale) in (2.0**10, 2.0**9)
    chex.assert_trees_all_equal(updates, {"w": jnp.zeros(2)})
  chex.assert_trees_all_equal(state.inner_state, init_inner)  # bitwise untouched
  assert (int(state.num_skipped), int(state.num_updates)) == (1, 0)
  assert float(state.loss_scale.scale) == 2.0**9 and int(state.loss_scale.growth_streak) == 0
  _window_is_reset(state)
  for g in window2:
    updates, state = _overflow_step(_scaled({"w": jnp.asarray(g)}, state), state, params)
  # Reference: adam fed the mean of window 2 directly, from a fresh state.
  mean = {"w": jnp.asarray(np.mean(window2, axis=0), jnp.float32)}
  ref_updates, ref_inner = optax.adam(0.1).update(mean, optax.adam(0.1).init(params), params)
  chex.assert_trees_all_close(updates, ref_updates, rtol=1e-6)
  chex.assert_trees_all_close(state.inner_state, ref_inner, rtol=1e-6)
  assert (int(state.num_skipped), int(state.num_updates)) == (1, 1)
  assert float(state.loss_scale.scale) == 2.0**9  # the clean window did not back off again


# ---------------------------------------------------------------------------------------------
# The dynamic rule through accumulate: a hand table, the floor and the ceiling under jit.


def test_dynamic_rule_through_accumulate_hand_table():
  # init 2**6, grow x2 after 2 applied windows, back off x0.5, floor 2**4, ceiling 2**8.
  rule = optax_accum.dynamic_loss_scale(
    init_scale=2.0**6, growth_interval=2, min_scale=2.0**4, max_scale=2.0**8
  )
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, loss_scale=rule)
  step = _jit_update(tx)
  params = jnp.zeros((), jnp.float32)
  state = tx.init(params)
  # (window finite?, scale in force during the window, streak after it)
  table = [
    (True, 64, 1),
    (True, 64, 0),  # grows to 128
    (False, 128, 0),  # backs off to 64
    (False, 64, 0),  # 32
    (False, 32, 0),  # 16
    (False, 16, 0),  # floor: stays 16
    (True, 16, 1),
    (True, 16, 0),  # 32
    (True, 32, 1),
    (True, 32, 0),  # 64
    (True, 64, 1),
    (True, 64, 0),  # 128
    (True, 128, 1),
    (True, 128, 0),  # 256
    (True, 256, 1),
    (True, 256, 0),  # ceiling: stays 256
    (True, 256, 1),
  ]
  applied = skipped = 0
  for finite, want_scale, want_streak in table:
    assert float(optax_accum.metrics(state).loss_scale) == want_scale
    for g in [1.0, 3.0] if finite else [1.0, NAN]:
      updates, state = step(_scaled(g, state), state, params, 1.0)
    applied += finite
    skipped += not finite
    assert float(updates) == (-2.0 if finite else 0.0)  # the scale never shows in updates
    assert int(state.loss_scale.growth_streak) == want_streak
    assert (int(state.num_updates), int(state.num_skipped)) == (applied, skipped)
  assert float(state.loss_scale.scale) == 256.0


def test_long_run_stops_growing_at_max_scale():
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**2, growth_interval=2, max_scale=2.0**5)
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, loss_scale=rule)
  step = _jit_update(tx)
  params = jnp.zeros((), jnp.float32)
  state = tx.init(params)
  in_force = []
  for _ in range(12):
    in_force.append(float(state.loss_scale.scale))
    for _ in range(2):
      updates, state = step(_scaled(1.0, state), state, params, 1.0)
    assert float(updates) == -1.0
  assert in_force == [4, 4, 8, 8, 16, 16, 32, 32, 32, 32, 32, 32]


def test_floor_survives_jit_many_overflow_windows():
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**10, min_scale=3.0)
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, loss_scale=rule)
  step = jax.jit(chex.assert_max_traces(tx.update, n=1))
  params = {"w": jnp.zeros(3, jnp.float32)}
  state = tx.init(params)
  in_force = []
  for _ in range(14):
    in_force.append(float(state.loss_scale.scale))
    for g in (1.0, INF):
      _, state = step(_scaled({"w": jnp.full(3, g)}, state), state, params)
  assert in_force == [1024, 512, 256, 128, 64, 32, 16, 8, 4, 3, 3, 3, 3, 3]
  assert float(state.loss_scale.scale) == 3.0
  assert (int(state.num_skipped), int(state.num_updates)) == (14, 0)


def test_static_scale_is_constant_forever():
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=2, loss_scale=optax_accum.static_loss_scale(2.0**8)
  )
  step = _jit_update(tx)
  params = jnp.zeros((), jnp.float32)
  state = tx.init(params)
  for window in range(10):
    for g in (1.0, NAN if window % 3 == 1 else 3.0):
      updates, state = step(_scaled(g, state), state, params, 1.0)
      assert float(state.loss_scale.scale) == 256.0
    params = optax.apply_updates(params, updates)
  m = optax_accum.metrics(state)
  assert (int(m.num_updates), int(m.num_skipped)) == (7, 3)
  assert float(params) == -2.0 * 7
  assert int(state.loss_scale.growth_streak) == 0


def test_empty_flush_with_dynamic_scale_changes_nothing():
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**10, growth_interval=3)
  tx = optax_accum.accumulate(optax.adam(0.1), every_k=2, loss_scale=rule)
  step = _jit_update(tx)
  flush = jax.jit(lambda s, p: optax_accum.flush(tx, s, p))
  params = {"w": jnp.asarray([1.0, 2.0], jnp.float32)}
  state = tx.init(params)
  for g in ([1.0, 2.0], [3.0, -4.0]):
    _, state = step(_scaled({"w": jnp.asarray(g)}, state), state, params, 1.0)
  assert int(state.loss_scale.growth_streak) == 1 and int(state.num_updates) == 1
  for _ in range(2):  # an empty window, then again
    before = state
    updates, state = flush(state, params)
    chex.assert_trees_all_equal(updates, {"w": jnp.zeros(2)})
    keep = ("loss_scale", "num_updates", "num_skipped", "num_microbatches")  # scale and streak
    for field in keep + ("grad_norm", "inner_state", "window_sum", "mini_step"):
      chex.assert_trees_all_equal(getattr(state, field), getattr(before, field))
    chex.assert_trees_all_equal(state.window.weight_sum, before.window.weight_sum)
  assert float(state.loss_scale.scale) == 2.0**10 and not bool(state.updated)


# ---------------------------------------------------------------------------------------------
# C4 and C5 with a dynamic scale in force: the scale must not show in the results.


def test_c4_schedule_counts_updates_with_dynamic_scale():
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**4, growth_interval=1)
  tx = optax_accum.accumulate(optax.sgd(lambda n: 0.1 * (n + 1)), every_k=4, loss_scale=rule)
  step = _jit_update(tx)
  params = jnp.zeros((), jnp.float32)
  state = tx.init(params)
  emitted, in_force = [], []
  for i in range(12):
    if i % 4 == 0:
      in_force.append(float(state.loss_scale.scale))
    updates, state = step(_scaled(1.0, state), state, params, 1.0)
    emitted.append(float(updates))
  np.testing.assert_allclose(emitted[3::4], [-0.1, -0.2, -0.3], rtol=1e-6)
  assert [u for i, u in enumerate(emitted) if i % 4 != 3] == [0.0] * 9
  assert int(optax.tree.get(state.inner_state, "count")) == 3
  assert in_force == [16.0, 32.0, 64.0]


def test_c5a_weight_decay_once_per_window_with_dynamic_scale():
  inner = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(1.0))
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**10, growth_interval=1)
  tx = optax_accum.accumulate(inner, every_k=3, loss_scale=rule)
  step = _jit_update(tx)
  params = jnp.ones((), jnp.float32)
  state = tx.init(params)
  for _ in range(3):
    updates, state = step(_scaled(0.0, state), state, params, 1.0)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(params, 0.9, rtol=1e-6)  # not 0.9**3 = 0.729


def test_c5b_adamw_counts_windows_with_dynamic_scale():
  inner = optax.adamw(0.1, weight_decay=0.01)
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**10, growth_interval=1)
  tx = optax_accum.accumulate(inner, every_k=3, loss_scale=rule)
  step = _jit_update(tx)
  params = {"w": jnp.asarray([1.0, -1.0], jnp.float32)}
  state = tx.init(params)
  windows = [[[1.0, 2.0], [3.0, -1.0], [2.0, 0.5]], [[-4.0, 1.0], [0.5, 0.5], [2.0, 3.0]]]
  for window in windows:
    for g in window:
      updates, state = step(_scaled({"w": jnp.asarray(g)}, state), state, params, 1.0)
      params = optax.apply_updates(params, updates)
  ref = {"w": jnp.asarray([1.0, -1.0], jnp.float32)}
  ref_state = inner.init(ref)
  for window in windows:
    mean = {"w": jnp.asarray(np.mean(window, axis=0), jnp.float32)}
    u, ref_state = inner.update(mean, ref_state, ref)
    ref = optax.apply_updates(ref, u)
  chex.assert_trees_all_close(params, ref, rtol=1e-6)
  chex.assert_trees_all_close(state.inner_state, ref_state, rtol=1e-6)
  assert int(optax.tree.get(state.inner_state, "count")) == 2  # not 6
  assert float(state.loss_scale.scale) == 2.0**12


# ---------------------------------------------------------------------------------------------
# fp16 compute with float32 master params: gradients of about 1e-8 underflow without a scale.

_LOSS_WEIGHT = 1e-7  # makes the true gradients about 1e-8: below fp16's smallest subnormal / 2


def _fp16_loss(params, batch, compute_dtype=jnp.float16):
  p = jax.tree.map(lambda a: a.astype(compute_dtype), params)  # fp16 copy for compute
  pred = batch["x"].astype(compute_dtype) @ p["w"] + p["b"]
  r = pred.astype(jnp.float32) - batch["y"]  # the loss reduction in float32
  return _LOSS_WEIGHT * 0.5 * jnp.mean(r**2)


def _fp16_data():
  rng = np.random.default_rng(3)
  x = rng.integers(-4, 5, size=(6, 4, 3)).astype(np.float32) / 4  # exact in fp16
  y = rng.uniform(-0.1, 0.1, size=(6, 4)).astype(np.float32)
  return [{"x": jnp.asarray(x[i]), "y": jnp.asarray(y[i])} for i in range(6)]


@pytest.mark.parametrize("scaled", [False, True], ids=["no-scale-underflows", "dynamic-scale"])
def test_fp16_compute_small_gradients_need_the_scale(scaled):
  rule = optax_accum.dynamic_loss_scale(growth_interval=1) if scaled else None
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, loss_scale=rule)
  grad_fn = _scaled_value_and_grad(_fp16_loss)

  @jax.jit
  def step(params, state, batch):
    _, grads = grad_fn(state, params, batch)
    updates, state = tx.update(grads, state, params, weight=batch["x"].shape[0])
    return updates, state

  params = {"w": jnp.asarray([0.25, -0.125, 0.5], jnp.float32), "b": jnp.float32(0.125)}
  state = tx.init(params)
  batches = _fp16_data()
  for w in range(3):
    window = batches[2 * w : 2 * w + 2]
    for batch in window:
      updates, state = step(params, state, batch)
    # float32 reference: one jax.grad over the window's concatenated batch.
    ref = jax.grad(_fp16_loss)(params, _concat(window), jnp.float32)
    ref_updates = jax.tree.map(jnp.negative, ref)
    biggest = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref))
    assert 1e-9 < biggest < 3e-8  # about 1e-8: fp16 flushes these to zero
    if scaled:
      chex.assert_trees_all_close(updates, ref_updates, rtol=1e-2, atol=1e-2 * biggest)
    else:
      chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
    params = optax.apply_updates(params, updates)
  m = optax_accum.metrics(state)
  assert (int(m.num_updates), int(m.num_skipped)) == (3, 0)
  assert float(m.loss_scale) == (2.0**19 if scaled else 1.0)


def test_fp16_loss_at_scale_2_16_overflows_once_then_backs_off():
  # An fp16 loss has an fp16 cotangent: scale 2**16 = 65536 > 65504 is inf in fp16 however the
  # loss value is cast, so the first window is skipped and the scale settles at 2**15.
  def loss16(params):
    p = params.astype(jnp.float16)
    return jnp.float16(100.0) + jnp.float16(0.5) * jnp.sum(p * p)

  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=1, loss_scale=optax_accum.dynamic_loss_scale()
  )
  grad_fn = _scaled_value_and_grad(loss16)

  @jax.jit
  def step(params, state):
    loss, grads = grad_fn(state, params)
    updates, state = tx.update(grads, state, params)
    return loss, optax.apply_updates(params, updates), state

  params = jnp.asarray([0.5, 0.5], jnp.float32)
  loss, params1, state = step(params, tx.init(params))
  assert loss.dtype == jnp.float32 and float(loss) == 100.25  # unscaled, no overflow
  assert (int(state.num_skipped), float(state.loss_scale.scale)) == (1, 2.0**15)
  chex.assert_trees_all_equal(params1, params)
  loss, params2, state = step(params1, state)
  assert (int(state.num_updates), int(state.num_skipped)) == (1, 1)
  np.testing.assert_array_equal(params2, [0.0, 0.0])  # sgd(1) on gradient p = (0.5, 0.5)


# ---------------------------------------------------------------------------------------------
# metrics inside a chain.


def test_metrics_inside_a_chain():
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**10, growth_interval=1000)
  tx = optax.chain(
    optax.identity(),
    optax_accum.accumulate(
      optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), 2, loss_scale=rule
    ),
  )
  params = {"w": jnp.zeros(2, jnp.float32)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  assert float(optax_accum.metrics(state).loss_scale) == 1024.0
  for g in ([1.0, 1.0], [INF, 0.0]):
    _, state = step(_scaled({"w": jnp.asarray(g)}, state), state, params)
  m = optax_accum.metrics(state)
  assert float(optax_accum.metrics(state).loss_scale) == 512.0 == float(m.loss_scale)
  assert int(m.num_skipped) == 1 and not bool(m.has_grad_norm)  # no NaN/Inf kept (item 1)
  for g in ([3.0, 0.0], [0.0, 4.0]):
    updates, state = step(_scaled({"w": jnp.asarray(g)}, state), state, params)
  m = optax_accum.metrics(state)
  np.testing.assert_allclose(m.grad_norm, 2.5, rtol=1e-6)
  np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-6)
  assert (int(m.num_skipped), int(m.num_updates), float(m.loss_scale)) == (1, 1, 512.0)
  assert bool(m.updated)


# ---------------------------------------------------------------------------------------------
# Precision: float32 accumulators, finite check / norm / clip before the cast, dtypes.


def test_fp16_grads_whose_sum_overflows_fp16_accumulate_in_float32():
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=2, loss_scale=optax_accum.static_loss_scale(2.0**10)
  )
  step = _jit_update(tx)
  params = jnp.zeros((), jnp.float16)
  state = tx.init(params)
  assert state.window.grad_sum.dtype == jnp.float32
  for _ in range(2):  # 60000 + 60000 is inf in fp16
    updates, state = step(jnp.asarray(60000.0, jnp.float16), state, params, 1.0)
  assert updates.dtype == jnp.float16
  assert float(updates) == -60000.0 / 1024  # -58.59375, exact in fp16
  assert (int(state.num_updates), int(state.num_skipped)) == (1, 0)


def test_norm_and_clip_are_computed_before_the_cast_to_fp16():
  """fp16 gradients, float32 master params: the window's mean reaches the inner chain in
  float32, so optax's clip sees the norm 84853 (an fp16 norm would be inf and clip to 0)."""
  tx = optax_accum.accumulate(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), 1)
  params = jnp.zeros(2, jnp.float32)
  state = tx.init(params)
  grads = jnp.asarray([60000.0, 60000.0], jnp.float16)  # norm 84853 > fp16 max 65504
  updates, state = _jit_update(tx)(grads, state, params, 1.0)
  np.testing.assert_allclose(state.grad_norm, 60000.0 * math.sqrt(2.0), rtol=1e-6)
  assert updates.dtype == jnp.float16  # plain inner's dtype rule: like the gradients
  np.testing.assert_array_equal(updates, np.full(2, -1 / math.sqrt(2.0), np.float16))


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_updates_have_param_dtype_and_accumulator_is_float32(param_dtype):
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**4)
  clipped = optax.chain(optax.clip_by_global_norm(10.0), optax.sgd(1.0))
  tx = optax_accum.accumulate(clipped, every_k=2, loss_scale=rule)
  params = {"a": jnp.zeros(2, param_dtype), "b": jnp.zeros((), jnp.float32)}
  state = tx.init(params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.window.grad_sum))
  step = _jit_update(tx)
  grads = {"a": jnp.asarray([16.0, 48.0], param_dtype), "b": jnp.float32(32.0)}
  for _ in range(2):
    updates, state = step(grads, state, params, 1.0)
  chex.assert_trees_all_equal_dtypes(updates, params)
  np.testing.assert_array_equal(updates["a"].astype(np.float32), [-1.0, -3.0])
  assert float(updates["b"]) == -2.0


def test_cast_overflow_of_the_window_mean_is_not_applied():
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=2, loss_scale=optax_accum.static_loss_scale(0.5)
  )
  step = _jit_update(tx)
  params = jnp.zeros((), jnp.float16)
  state = tx.init(params)
  for _ in range(2):  # gradients of 0.5 * loss: the true mean is 80000 > fp16 max
    updates, state = step(jnp.asarray(40000.0, jnp.float16), state, params, 1.0)
  assert math.isfinite(float(updates))
  assert (int(state.num_updates), int(state.num_skipped)) == (0, 1)


# ---------------------------------------------------------------------------------------------
# Strict dtype promotion: our own arithmetic must not rely on implicit promotion.


@pytest.mark.parametrize(
  "dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=["bf16", "fp16", "f32"]
)
@pytest.mark.parametrize("clip_inside", [False, True], ids=["sgd", "chain-clip-sgd"])
def test_strict_dtype_promotion(dtype, clip_inside):
  inner = optax.sgd(0.5)
  if clip_inside:
    inner = optax.chain(optax.clip_by_global_norm(4.0), inner)
  rule = optax_accum.dynamic_loss_scale(init_scale=2.0**4, growth_interval=1)
  with jax.numpy_dtype_promotion("strict"):
    tx = optax_accum.accumulate(
      optax.chain(optax.clip_by_global_norm(2.0), inner), every_k=2, loss_scale=rule
    )
    params = {"w": jnp.ones(3, dtype), "b": jnp.zeros((), dtype)}
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p, weight=jnp.float32(3.0), value=1.5))
    flush = jax.jit(lambda s, p: optax_accum.flush(tx, s, p))
    for _ in range(3):
      grads = _scaled(jax.tree.map(lambda p: jnp.full_like(p, 1.0, jnp.float32), params), state)
      grads = jax.tree.map(lambda g: g.astype(dtype), grads)
      updates, state = step(grads, state, params)
      params = optax.apply_updates(params, updates)
    updates, state = flush(state, params)
    params = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal_dtypes(updates, params)
  m = optax_accum.metrics(state)
  assert (int(m.num_updates), int(m.num_skipped), float(m.loss_scale)) == (2, 0, 64.0)
  # Windows of gradient (1, 1, 1, 1): norm 2 <= clip 2, so sgd(0.5) moves w from 1 to 0.
  np.testing.assert_array_equal(np.asarray(params["w"], np.float32), [0.0, 0.0, 0.0])


# ---------------------------------------------------------------------------------------------
# The documentation's example runs and does what it says.


def test_docs_example_runs():
  text = (ROOT / "docs" / "mixed_precision.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
  assert blocks, "docs/mixed_precision.md has no python example"
  ns: dict = {}
  exec(compile(blocks[0], "docs/mixed_precision.md", "exec"), ns)
  m = optax_accum.metrics(ns["opt_state"])
  # The example's gradients overflow fp16 at the default 2**16: some windows are skipped, the
  # scale backs off, later windows are applied.
  assert int(m.num_skipped) >= 1 and int(m.num_updates) >= 1
  assert float(m.loss_scale) == 2.0**16 * 0.5 ** int(m.num_skipped)
  assert _all_finite(ns["params"]) and not np.all(np.asarray(ns["params"]["w"]) == 0)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(ns["params"]))


# ---------------------------------------------------------------------------------------------
# Issue 11, item 3: the inner optimizer computes in the wider of the grads' and params' dtypes,
# and the updates have the dtypes plain `inner` returns (optax's test_multi_steps_mixed_precision).

DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
DTYPE_IDS = ["f16", "bf16", "f32"]


@pytest.mark.parametrize("param_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("inner_name", ["sgd", "adam"])
def test_updates_have_the_dtypes_plain_inner_returns(param_dtype, grad_dtype, inner_name):
  """Issue 11, item 3: every (params, grads) dtype pair; every_k=1 with weight 1 is plain inner.

  The reference is the plain inner optimizer on the same gradients, and for the values
  on the gradients cast to the wider dtype (the dtype the window mean is handed over in).
  """
  make = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-3)}[inner_name]
  params = {"w": jnp.zeros(3, param_dtype), "b": jnp.zeros((), jnp.float32)}
  # Values that fp16 Adam survives (plain adam on fp16 grads of 1e-3 divides by 0).
  grads = {"w": jnp.asarray([0.5, 1.0, -2.0], grad_dtype), "b": jnp.asarray(0.5, grad_dtype)}
  tx = optax_accum.accumulate(make(), every_k=1)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  plain, _ = make().update(grads, make().init(params), params)
  chex.assert_trees_all_equal_dtypes(updates, plain)
  wide = jax.tree.map(lambda g, p: g.astype(jnp.promote_types(g.dtype, p.dtype)), grads, params)
  ref, _ = make().update(wide, make().init(params), params)
  ref = jax.tree.map(lambda r, u: r.astype(u.dtype), ref, updates)
  chex.assert_trees_all_close(updates, ref, rtol=1e-6)
  assert _all_finite(updates) and int(state.num_updates) == 1


def test_fp16_params_with_float32_grads_adam_is_finite():
  """Issue 11, item 3: adam on fp16 params with float32 grads [1e-3, 1] applied [-inf, -0.001].

  Plain optax.adam gives -lr * g / (|g| + eps) ~ -1e-3 for both (float32), and so must we.
  """
  tx = optax_accum.accumulate(optax.adam(1e-3), 1)
  params = jnp.zeros(2, jnp.float16)
  grads = jnp.asarray([1e-3, 1.0], jnp.float32)
  updates, state = tx.update(grads, tx.init(params), params)
  plain, _ = optax.adam(1e-3).update(grads, optax.adam(1e-3).init(params), params)
  assert updates.dtype == plain.dtype == jnp.float32
  np.testing.assert_allclose(updates, plain, rtol=1e-6)
  assert (int(state.num_updates), int(state.num_skipped)) == (1, 0)


def test_non_finite_inner_updates_skip_the_window():
  """Issue 11, item 3: a finite mean whose inner updates overflow fp16 is skipped, not applied.

  sgd(1e4) on fp16 params and grads of 10: the update -1e5 does not fit fp16 (max 65504).
  The inner state stays untouched (its count), the window is counted as skipped, the
  dynamic scale backs off; the next window (grads 1: update -1e4) applies.
  """
  rule = optax_accum.dynamic_loss_scale(init_scale=1.0, min_scale=2.0**-4)
  inner = optax.chain(optax.scale_by_schedule(lambda n: jnp.ones(())), optax.sgd(1e4))
  tx = optax_accum.accumulate(inner, every_k=1, loss_scale=rule)
  params = jnp.zeros(2, jnp.float16)
  state = tx.init(params)
  updates, state = tx.update(jnp.full(2, 10.0, jnp.float16), state, params)
  np.testing.assert_array_equal(np.asarray(updates), [0.0, 0.0])
  assert (int(state.num_updates), int(state.num_skipped)) == (0, 1) and not bool(state.updated)
  assert int(state.inner_state[0].count) == 0  # the inner state is untouched
  assert float(state.loss_scale.scale) == 0.5
  assert_state_finite(state)
  updates, state = tx.update(jnp.full(2, 0.5, jnp.float16), state, params)  # 0.5 = 1 * scale
  np.testing.assert_array_equal(np.asarray(updates, np.float32), [-1e4, -1e4])
  assert (int(state.num_updates), int(state.num_skipped)) == (1, 1)
  assert int(state.inner_state[0].count) == 1


@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
def test_fp16_params_a_finite_float32_update_that_overflows_them_is_skipped(fused):
  """Issue 22: fp16 params, float32 gradients, a window mean of 1e5 (fp16 max 65504).

  ``optax.apply_updates`` gives ``(p + u).astype(float16) = -inf``; the window is
  counted as non-finite instead: params unchanged, ``num_skipped`` 1, the scale backed off.
  """
  policy = optax_accum.dynamic_loss_scale(init_scale=4.0)
  tx = optax_accum.accumulate(optax.sgd(1.0), 1, loss_scale=policy)
  params = {"w": jnp.zeros(2, jnp.float16)}
  state = tx.init(params)
  grads = {"w": jnp.full(2, 4.0 * 1e5, jnp.float32)}  # scaled by 4
  if fused:
    new, state = optax_accum.update_and_apply(tx, grads, state, params)
  else:
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(new["w"], params["w"])
  assert int(optax_accum.metrics(state).num_skipped) == 1
  assert float(optax_accum.metrics(state).loss_scale) == 4.0 * 0.5  # the default backoff_factor
  # A representable one (1e4) is applied: params -1e4 in fp16.
  small = {"w": jnp.full(2, 2.0 * 1e4, jnp.float32)}  # scaled by the new scale, 2
  updates, state = tx.update(small, state, params)
  np.testing.assert_array_equal(optax.apply_updates(params, updates)["w"], np.float16(-1e4))
