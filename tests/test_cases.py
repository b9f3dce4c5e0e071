"""Reference cases C1-C14 (reported accumulation faults with their correct values), one test each
(C13, the weights a loss implies, is in tests/test_testing.py beside the pre-flight check).

Every expected value is computed independently of ``accumulate``: a number
worked out by hand from the case, one ``jax.grad`` over the concatenated batch
fed once to the inner optimizer, or a float64 NumPy reference. Every transform
call runs under ``jax.jit`` (one jitted step with traced ``weight`` and
``flush``).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import _compat
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite
from _steps import call, make_step

import optax_accum

# ----------------------------------------------------------------------------- helpers


def m1_masked_loss(w, y, mask):
  """M1: mean over the valid items of ``0.5 * (w - y)**2``."""
  per_item = 0.5 * (w - y) ** 2
  return jnp.sum(jnp.where(mask, per_item, 0.0)) / jnp.sum(mask)


def m2_loss(params, x, y):
  """M2: mean squared error of ``x @ theta + b``."""
  pred = x @ params["theta"] + params["b"]
  return jnp.mean(0.5 * (pred - y) ** 2)


def m2_data(n, seed=0, dtype=np.float32):
  rng = np.random.RandomState(seed)
  x = rng.normal(size=(n, 3)).astype(dtype)
  y = (x @ np.array([1.0, -2.0, 0.5]) + 0.3 + 0.1 * rng.normal(size=n)).astype(dtype)
  return x, y


def m2_params(dtype=jnp.float32):
  return {"theta": jnp.array([0.1, 0.2, -0.3], dtype), "b": jnp.array(0.05, dtype)}


def m2_microbatches(n_steps, size=4, seed=1):
  """``n_steps`` M2 microbatches of ``size`` examples each."""
  x, y = m2_data(n_steps * size, seed=seed)
  return [(x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(n_steps)]


def m2_run(tx, params, batches, state=None):
  """Runs M2 microbatches through ``tx``; returns (params, state, list of updates)."""
  step = make_step(tx)
  state = tx.init(params) if state is None else state
  grad_fn = jax.jit(jax.grad(m2_loss))
  emitted = []
  for x, y in batches:
    g = grad_fn(params, x, y)
    u, state, params = call(step, g, state, params, weight=len(y))
    emitted.append(u)
  return params, state, emitted


def acc_state(opt_state):
  return optax_accum._state.find_state(opt_state)


# ----------------------------------------------------------------------------- C1


def test_c1_mean_of_means_over_padded_microbatches():
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=3)
  w = jnp.zeros(())
  state = tx.init(w)
  step = make_step(tx)
  # (valid tokens, y), padded to length 6; padding has y = 100 to expose a wrong mask.
  micro = [(1, 1.0), (3, 3.0), (6, 0.5)]
  grad_fn = jax.jit(jax.grad(m1_masked_loss))
  for n, yv in micro:
    mask = jnp.arange(6) < n
    y = jnp.where(mask, yv, 100.0)
    g = grad_fn(w, y, mask)
    _, state, w = call(step, g, state, w, weight=mask.sum())
  # Hand-worked: -(1*1 + 3*3 + 6*0.5) / 10 = -1.3, so w = 1.3 (not 1.5, not 0.722).
  np.testing.assert_allclose(w, 1.3, rtol=1e-6)
  # Independently: one jax.grad over the concatenated valid tokens.
  y_all = jnp.concatenate([jnp.full((n,), yv) for n, yv in micro])
  full = jax.grad(lambda w: jnp.mean(0.5 * (w - y_all) ** 2))(jnp.zeros(()))
  np.testing.assert_allclose(w, -full, rtol=1e-6)


# ----------------------------------------------------------------------------- C2


@pytest.mark.parametrize(
  "inner",
  [optax.sgd(1.0), optax.adamw(1e-2, weight_decay=1e-2)],
  ids=["sgd", "adamw"],
)
def test_c2_unequal_microbatches_8_8_8_2(inner):
  x, y = m2_data(26)
  params = m2_params()
  sizes = [8, 8, 8, 2]
  bounds = np.cumsum([0, *sizes])
  tx = optax_accum.accumulate(inner, every_k=4)
  batches = [(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
  new_params, state, emitted = m2_run(tx, params, batches)
  # Reference: one inner step on the gradient of the mean loss over all 26 examples.
  g_full = jax.grad(m2_loss)(params, jnp.asarray(x), jnp.asarray(y))
  ref_u, ref_inner = jax.jit(inner.update)(g_full, inner.init(params), params)
  chex.assert_trees_all_close(emitted[-1], ref_u, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(new_params, optax.apply_updates(params, ref_u), rtol=1e-5)
  chex.assert_trees_all_close(state.inner_state, ref_inner, rtol=1e-5, atol=1e-8)
  for u in emitted[:-1]:
    chex.assert_trees_all_equal(u, optax.tree.zeros_like(params))
  # The implied weights are 8/26, 8/26, 8/26, 2/26, not 1/4 each: a plain mean differs.
  per_mb = [jax.grad(m2_loss)(params, jnp.asarray(a), jnp.asarray(b)) for a, b in batches]
  plain = jax.tree.map(lambda *g: sum(g) / 4, *per_mb)
  np.testing.assert_allclose(state.grad_norm, optax.tree.norm(g_full), rtol=1e-5)
  assert abs(float(optax.tree.norm(plain)) / float(state.grad_norm) - 1) > 1e-2


# ----------------------------------------------------------------------------- C3


@pytest.mark.parametrize("how", ["flush_fn", "flush_arg"])
def test_c3_last_incomplete_window(how):
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=4)
  w = jnp.zeros(())
  state = tx.init(w)
  step = make_step(tx)
  grad_fn = jax.jit(jax.grad(lambda w, y: 0.5 * (w - y) ** 2))
  boundary_updates = []
  for i, yv in enumerate(range(1, 11)):
    last = i == 9
    u, state, w = call(
      step, grad_fn(w, jnp.float32(yv)), state, w, flush=last and how == "flush_arg"
    )
    if i in (3, 7) or (last and how == "flush_arg"):
      boundary_updates.append(u)
  if how == "flush_fn":
    u, state = jax.jit(lambda s, p: optax_accum.flush(tx, s, p))(state, w)
    w = optax.apply_updates(w, u)
    boundary_updates.append(u)
  # Hand-worked: SGD(1) on a window mean of (w - y) moves w to the window's mean y:
  # w = 2.5, then 6.5, then 9.5 (the mean of 9 and 10, not 8.0 from dividing by 4).
  np.testing.assert_allclose(boundary_updates, [2.5, 4.0, 3.0], rtol=1e-6)
  np.testing.assert_allclose(w, 9.5, rtol=1e-6)
  s = acc_state(state)
  assert int(s.num_updates) == 3
  assert int(s.num_microbatches) == 10
  # After a flush the window is empty.
  chex.assert_trees_all_equal(s.window_sum, jnp.zeros((), jnp.float32))
  assert float(s.window.weight_sum) == 0.0 and int(s.mini_step) == 0
  # A second flush in a row is a no-op.
  u2, state2 = jax.jit(lambda s, p: optax_accum.flush(tx, s, p))(state, w)
  chex.assert_trees_all_equal(u2, jnp.zeros((), jnp.float32))
  chex.assert_trees_all_equal(state2.inner_state, state.inner_state)
  assert int(state2.num_updates) == 3 and int(state2.num_skipped) == 0
  assert int(state2.num_microbatches) == 10


def test_c3_second_flush_keeps_adam_state():
  """The no-op flush with a stateful inner: Adam's moments and count are untouched."""
  tx = optax_accum.accumulate(optax.adam(0.1), every_k=4)
  w = jnp.zeros(())
  state = tx.init(w)
  step = make_step(tx)
  for yv in (1.0, 2.0):
    _, state, w = call(step, jnp.float32(-yv), state, w)
  do_flush = jax.jit(lambda s, p: optax_accum.flush(tx, s, p))
  u1, state = do_flush(state, w)
  # Adam's first step with mean gradient -1.5: -lr * g / (|g| + eps) ~= +0.1.
  np.testing.assert_allclose(u1, 0.1, rtol=1e-5)
  u2, state2 = do_flush(state, w)
  chex.assert_trees_all_equal(u2, jnp.zeros((), jnp.float32))
  chex.assert_trees_all_equal(state2.inner_state, state.inner_state)
  assert int(state2.num_updates) == 1


# ----------------------------------------------------------------------------- C4


def test_c4_schedule_counts_updates_not_microbatches():
  inner = optax.sgd(learning_rate=lambda n: 0.1 * (n + 1))
  tx = optax_accum.accumulate(inner, every_k=4)
  w = jnp.zeros(())
  state = tx.init(w)
  step = make_step(tx)
  boundary = []
  for i in range(12):
    u, state, w = call(step, jnp.float32(1.0), state, w)
    if i % 4 == 3:
      boundary.append(u)
    else:
      assert float(u) == 0.0
  np.testing.assert_allclose(boundary, [-0.1, -0.2, -0.3], rtol=1e-6)
  counts = optax.tree.get_all_with_path(state.inner_state, "count")
  assert [int(c) for _, c in counts] == [3]


# ----------------------------------------------------------------------------- C5


def test_c5a_weight_decay_only_on_real_updates():
  inner = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(1.0))
  tx = optax_accum.accumulate(inner, every_k=3)
  w = jnp.ones(())
  state = tx.init(w)
  step = make_step(tx)
  for _ in range(3):
    _, state, w = call(step, jnp.float32(0.0), state, w)
  np.testing.assert_allclose(w, 0.9, rtol=1e-6)  # not 0.9**3 = 0.729


def test_c5b_adamw_count_only_on_real_updates():
  inner = optax.adamw(0.05, weight_decay=0.1)
  tx = optax_accum.accumulate(inner, every_k=3)
  p0 = jnp.array([1.0, -2.0])
  grads = np.array([[0.3, -1.0], [0.5, 2.0], [-0.2, 0.1], [1.0, 1.0], [0.0, -0.5], [2.0, 0.3]])
  state, p = tx.init(p0), p0
  step = make_step(tx)
  for g in grads:
    _, state, p = call(step, jnp.asarray(g, jnp.float32), state, p)
  # Reference: adamw fed the two window means directly.
  ref_p, ref_s = p0, inner.init(p0)
  for win in (grads[:3], grads[3:]):
    u, ref_s = jax.jit(inner.update)(jnp.asarray(win.mean(axis=0), jnp.float32), ref_s, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
  chex.assert_trees_all_close(p, ref_p, rtol=1e-6)
  chex.assert_trees_all_close(state.inner_state, ref_s, rtol=1e-6)
  counts = optax.tree.get_all_with_path(state.inner_state, "count")
  assert [int(c) for _, c in counts] == [2]


# ----------------------------------------------------------------------------- C6


def test_c6_accumulate_gradients_not_updates():
  lr = 0.1
  tx = optax_accum.accumulate(optax.adam(lr), every_k=2)
  w = jnp.zeros(())
  state = tx.init(w)
  step = make_step(tx)
  us = []
  for g in (1.0, -1.0):
    u, state, w = call(step, jnp.float32(g), state, w)
    us.append(u)
  # The window mean is exactly 0, so Adam's update is exactly 0 (not -0.947 * lr).
  assert float(us[1]) == 0.0 and float(w) == 0.0
  counts = optax.tree.get_all_with_path(state.inner_state, "count")
  assert [int(c) for _, c in counts] == [1]


# ----------------------------------------------------------------------------- C7


def test_c7_low_precision_accumulator():
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=128)
  w = jnp.zeros((), jnp.bfloat16)
  state = tx.init(w)
  assert state.window.grad_sum.dtype == jnp.float32
  step = make_step(tx)
  g_small = jnp.asarray(0.003, jnp.bfloat16)
  assert float(g_small) == pytest.approx(0.0030059814, abs=1e-10)
  u, state, w2 = call(step, jnp.asarray(1.0, jnp.bfloat16), state, w)
  for _ in range(127):
    u, state, w2 = call(step, g_small, state, w)
  mean64 = (1.0 + 127 * np.float64(float(g_small))) / 128
  assert mean64 == pytest.approx(0.010795, abs=5e-7)
  # The float32 window mean (its norm is logged in grad_norm) is within 1e-6 of it.
  assert abs(float(state.grad_norm) - mean64) < 1e-6
  # The emitted update is bfloat16, that mean rounded to bfloat16 (not 0.0078125).
  assert u.dtype == jnp.bfloat16
  assert float(u) == float(jnp.asarray(-mean64, jnp.bfloat16))
  assert float(u) == pytest.approx(-0.010803, abs=1e-6)


# ----------------------------------------------------------------------------- C10


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "dynamic_scale"])
def test_c10_nonfinite_microbatch_does_not_poison(scaled):
  inner = optax.adam(0.1)
  ls = optax_accum.dynamic_loss_scale(init_scale=2.0**10) if scaled else None
  tx = optax_accum.accumulate(inner, every_k=3, loss_scale=ls)
  ys = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [-1.0, 0.5, 2.0]]  # windows 1..3
  w = jnp.zeros(())
  state = tx.init(w)

  @jax.jit
  def step(g, state, w, value):  # passes the loss as `value`, so window_loss is tracked too
    u, state = tx.update(g, state, w, value=value)
    return u, state, optax.apply_updates(w, u)

  loss_and_grad = jax.jit(jax.value_and_grad(lambda w, y: 0.5 * (w - y) ** 2))
  scales = []
  for k, window in enumerate(ys):
    scales.append(float(optax_accum.metrics(state).loss_scale))
    inner_before = state.inner_state
    for j, yv in enumerate(window):
      loss, g = loss_and_grad(w, jnp.float32(yv))
      if k == 0 and j == 1:
        g = jnp.float32(jnp.nan)
      g = g * optax_accum.metrics(state).loss_scale
      u, state, w = step(g, state, w, loss)
      assert np.all(np.isfinite(u)), "no NaN in emitted updates"
      if j < 2:
        assert float(u) == 0.0 and not np.signbit(u), "exact zeros between boundaries"
    if k == 0:
      assert float(w) == 0.0
      chex.assert_trees_all_equal(state.inner_state, inner_before)
      assert int(state.num_skipped) == 1 and int(state.num_updates) == 0
      chex.assert_trees_all_equal(state.window.grad_sum, jnp.zeros((), jnp.float32))
      assert float(state.window.weight_sum) == 0.0 and int(state.mini_step) == 0
  assert_state_finite(state)  # no NaN left behind by the skipped window (issue 11, item 1)
  assert int(state.num_skipped) == 1 and int(state.num_updates) == 2
  # Reference: Adam run on windows 2 and 3 only (window 1 never happened).
  ref_w, ref_s = jnp.zeros(()), inner.init(jnp.zeros(()))
  for window in ys[1:]:
    y = jnp.asarray(window)
    g = jax.grad(lambda w, y: jnp.mean(0.5 * (w - y) ** 2))(ref_w, y)
    u, ref_s = jax.jit(inner.update)(g, ref_s, ref_w)
    ref_w = optax.apply_updates(ref_w, u)
  np.testing.assert_allclose(w, ref_w, rtol=1e-6)
  chex.assert_trees_all_close(state.inner_state, ref_s, rtol=1e-6)
  if scaled:
    # Halved once after window 1, then two applied windows (growth interval 2000).
    assert scales == [1024.0, 512.0, 512.0]
    assert float(optax_accum.metrics(state).loss_scale) == 512.0


# ----------------------------------------------------------------------------- C11


def _c11_run(dtype):
  x, y = m2_data(8, seed=3, dtype=np.dtype(dtype))
  params = m2_params(dtype)
  out = {}
  for k in (1, 2, 4, 8):
    size = 8 // k
    tx = optax_accum.accumulate(optax.sgd(1.0), every_k=k)
    batches = [(x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(k)]
    _, state, emitted = m2_run(tx, params, batches)
    out[k] = (emitted[-1], state.grad_norm)
  g_full = jax.grad(m2_loss)(params, jnp.asarray(x), jnp.asarray(y))
  return out, g_full


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
@pytest.mark.slow
def test_c11_window_length_does_not_change_update(x64):
  with _compat.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    rtol = 1e-12 if x64 else 1e-6
    out, g_full = _c11_run(dtype)
    ref_norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(g_full)))
    ref_u = jax.tree.map(lambda g: -g, g_full)

    def rel_diff(a, b):  # relative difference of two trees, in the global L2 norm
      diff = jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y, np.float64), a, b)
      return float(optax.tree.norm(diff)) / float(optax.tree.norm(b))

    for k, (u, norm) in out.items():
      chex.assert_trees_all_equal_dtypes(u, ref_u)
      assert norm.dtype == dtype, k
      assert rel_diff(u, ref_u) <= rtol, k
      assert rel_diff(u, out[1][0]) <= rtol, k
      np.testing.assert_allclose(norm, ref_norm, rtol=rtol)


# ----------------------------------------------------------------------------- C12

C12_INNER = lambda: optax.adamw(1e-2, weight_decay=1e-2)  # noqa: E731


def c12_tx():
  return optax_accum.accumulate(C12_INNER(), every_k=4)


def c12_resume(path_in, path_out):
  """Runs in a fresh process: restores the state and params, runs microbatches 7..12."""
  data = np.load(path_in)
  tx = c12_tx()
  params0 = m2_params()
  treedef = jax.tree.structure(tx.init(params0))
  n_state = treedef.num_leaves
  state = jax.tree.unflatten(treedef, [jnp.asarray(data[f"s{i}"]) for i in range(n_state)])
  params = {"theta": jnp.asarray(data["theta"]), "b": jnp.asarray(data["b"])}
  batches = m2_microbatches(12)[6:]
  params, state, emitted = m2_run(tx, params, batches, state=state)
  out = {"theta": np.asarray(params["theta"]), "b": np.asarray(params["b"])}
  out.update({f"s{i}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(state))})
  for j, u in enumerate(emitted):
    out[f"u{j}_theta"], out[f"u{j}_b"] = np.asarray(u["theta"]), np.asarray(u["b"])
  np.savez(path_out, **out)


def test_c12_resume_mid_window_in_fresh_process(tmp_path):
  tx = c12_tx()
  params0 = m2_params()
  batches = m2_microbatches(12)
  # Run A: straight through.
  a_params, a_state, a_emitted = m2_run(tx, params0, batches)
  # Run B: first six microbatches here, then save mid-window (mini_step == 2).
  b_params, b_state, b_emitted = m2_run(tx, params0, batches[:6])
  assert int(b_state.mini_step) == 2
  saved = {f"s{i}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(b_state))}
  saved.update(theta=np.asarray(b_params["theta"]), b=np.asarray(b_params["b"]))
  path_in, path_out = tmp_path / "mid.npz", tmp_path / "out.npz"
  np.savez(path_in, **saved)
  tests_dir = pathlib.Path(__file__).resolve().parent
  code = (
    f"import sys; sys.path.insert(0, {str(tests_dir)!r}); import test_cases; "
    f"test_cases.c12_resume({str(path_in)!r}, {str(path_out)!r})"
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = np.load(path_out)
  np.testing.assert_array_equal(out["theta"], a_params["theta"])
  np.testing.assert_array_equal(out["b"], a_params["b"])
  a_leaves = jax.tree.leaves(a_state)
  assert len(a_leaves) == len([k for k in out.files if k.startswith("s")])
  for i, leaf in enumerate(a_leaves):
    assert out[f"s{i}"].dtype == np.asarray(leaf).dtype
    np.testing.assert_array_equal(out[f"s{i}"], np.asarray(leaf), err_msg=f"state leaf {i}")
  for j, u in enumerate(a_emitted[6:]):
    np.testing.assert_array_equal(out[f"u{j}_theta"], u["theta"])
    np.testing.assert_array_equal(out[f"u{j}_b"], u["b"])
  # Three applied windows, and run B's first half matches run A's.
  assert int(a_state.num_updates) == 3
  chex.assert_trees_all_equal(b_emitted, a_emitted[:6])


# ----------------------------------------------------------------------------- C14


def _m1_window_update(ys_by_microbatch):
  """sgd(1)'s update at w = 0 for the physical batch of these items: +mean(y) (M1)."""
  flat = np.concatenate([np.asarray(y, np.float64) for y in ys_by_microbatch])
  return float(flat.mean())


@pytest.mark.slow
def test_c14_a_weight_never_disappears_on_the_way():
  # (a) lookahead around accumulate passes no weight=: refused, naming the wrapper, instead
  # of weighing 1 and 3 as 1 and 1 (the mean of means).
  lookahead = optax.with_extra_args_support(
    optax.lookahead(optax_accum.accumulate(optax.sgd(0.1), every_k=2), 4, 0.5)
  )
  params = optax.LookaheadParams.init_synced({"w": jnp.zeros(())})
  state = lookahead.init(params)
  g = {"w": jnp.asarray(1.0)}
  with pytest.raises(ValueError, match=r"weight= did not reach accumulate.*optax.LookaheadState"):
    optax_accum.update_and_apply(lookahead, g, state, params, weight=1)
  plain = optax.lookahead(optax_accum.accumulate(optax.sgd(0.1), every_k=2), 4, 0.5)
  with pytest.raises(TypeError, match=r"flush= did not reach accumulate: tx takes no extra"):
    optax_accum.update_and_apply(plain, g, plain.init(params), params, flush=True)

  # (b) Two LoRA adapters in one multi_transform, one weight per call: a PitfallWarning; one
  # weight per adapter gives each adapter its own physical batch.
  counts = {"a1": [3, 0, 5], "a2": [1, 4, 0]}
  rng = np.random.default_rng(14)
  ys = {k: [rng.normal(size=n).astype(np.float32) for n in c] for k, c in counts.items()}
  acc = lambda: optax_accum.accumulate(optax.sgd(1.0), every_k=3)
  shared = optax.multi_transform({"a1": acc(), "a2": acc()}, {"a1": "a1", "a2": "a2"})
  params = {"a1": jnp.zeros(()), "a2": jnp.zeros(())}
  with pytest.warns(optax_accum.pitfalls.PitfallWarning, match="one weight= reaches 2"):
    optax_accum.update_and_apply(
      shared, params, shared.init(params), params, weight=jnp.float32(3.0)
    )
  # One accumulate per adapter, each with its own weights (docs/porting.md).
  for k in counts:
    tx = acc()
    p, s = jnp.zeros(()), tx.init(jnp.zeros(()))
    for y in ys[k]:
      n = len(y)
      grad = jax.grad(m1_masked_loss)(p, jnp.asarray(np.pad(y, (0, 6 - n))), jnp.arange(6) < n)
      grad = jnp.where(n > 0, grad, 0.0)  # an adapter with no example in this microbatch
      p, s = optax_accum.update_and_apply(tx, grad, s, p, weight=n)
    np.testing.assert_allclose(float(p), _m1_window_update(ys[k]), rtol=1e-6)

  # (c) In-step with denominator=1 and a loss already divided by the window's 8 rows: with the
  # weight said explicitly (1 per microbatch), the gradient is jax.grad of that loss.
  y = jnp.asarray(rng.normal(size=8), jnp.float32)
  loss = lambda w, mb: 0.5 * jnp.sum((w - mb) ** 2) / 8
  f = optax_accum.microbatched_value_and_grad(
    loss, 4, weight_fn=lambda mb: 1, aggregate=optax_accum.aggregate(denominator=1)
  )
  np.testing.assert_allclose(f(0.25, y)[1], jax.grad(loss)(0.25, y), rtol=1e-6)
  with pytest.raises(ValueError, match="needs weight_fn="):  # rows would multiply it by 2
    optax_accum.microbatched_value_and_grad(loss, 4, aggregate=optax_accum.aggregate(denominator=1))
