"""Boundary guards (``accumulate(..., skip_if=...)``): spikes skipped whole, exactly."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import make_mesh
from hypothesis import given, settings
from hypothesis import strategies as st
from models import linear_regression_data, linear_regression_loss, linear_regression_params

import optax_accum

K = 2  # microbatches per window
SPIKE = 40  # the window with the injected spike
RULE = dict(history=16, threshold=6.0, warmup=8)


def _windows(num_windows, spike=None, removed=False):
  """``num_windows`` windows of ``K`` microbatches: (batch, loss factor, grad factor) each."""
  data = linear_regression_data(num_windows * K * 4, dim=3, seed=3)
  x, y = data["x"], data["y"]
  out = []
  for i in range(num_windows):
    if removed and i == SPIKE:
      continue
    for j in range(K):
      s = slice((i * K + j) * 4, (i * K + j + 1) * 4)
      loss_f, grad_f = (100.0, 1.0) if spike == "loss" else (1.0, 100.0)
      f = (loss_f, grad_f) if spike and i == SPIKE else (1.0, 1.0)
      out.append(({"x": x[s], "y": y[s]}, *f))
  return out


def _run(rule, microbatches, fused, start=None):
  """The microbatches through one jitted step, from ``start`` ((params, state)) or a fresh one."""
  tx = optax_accum.accumulate(optax.adam(0.05), every_k=K, skip_if=rule)
  params = linear_regression_params(3)
  params, state = start if start is not None else (params, tx.init(params))

  @jax.jit
  def step(params, state, batch, loss_f, grad_f):
    loss, grads = jax.value_and_grad(linear_regression_loss)(params, batch)
    grads = jax.tree.map(lambda g: g * grad_f, grads)
    if fused:
      return optax_accum.update_and_apply(tx, grads, state, params, value=loss * loss_f)
    updates, state = tx.update(grads, state, params, value=loss * loss_f)
    return optax.apply_updates(params, updates), state

  for batch, loss_f, grad_f in microbatches:
    params, state = step(params, state, batch, loss_f, grad_f)
  return params, state


@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
@pytest.mark.parametrize("spike", ["loss", "grad_norm"])
def test_a_spike_is_skipped_exactly_as_if_its_window_were_removed(spike, fused):
  rule = optax_accum.spike_rule(spike, **RULE)
  params, state = _run(rule, _windows(50, spike), fused)
  ref_params, ref_state = _run(rule, _windows(50, spike, removed=True), fused)
  m, ref = optax_accum.metrics(state), optax_accum.metrics(ref_state)
  assert (int(m.num_spikes), int(ref.num_spikes)) == (1, 0)
  assert int(m.num_updates) == int(ref.num_updates) == 49
  assert int(m.num_skipped) == 0
  jax.tree.map(np.testing.assert_array_equal, params, ref_params)
  jax.tree.map(np.testing.assert_array_equal, state.inner_state, ref_state.inner_state)
  jax.tree.map(np.testing.assert_array_equal, state.guard.rules, ref_state.guard.rules)


@pytest.mark.parametrize("spike", ["loss", "grad_norm"])
def test_the_default_rule_watches_both(spike):
  rule = optax_accum.spike_rule(**RULE)
  _, state = _run(rule, _windows(45, spike), fused=False)
  assert int(optax_accum.metrics(state).num_spikes) == 1


def test_no_spike_no_skip_and_the_same_params_as_without_a_guard():
  params, state = _run(optax_accum.spike_rule(**RULE), _windows(45), fused=False)
  ref_params, _ = _run(None, _windows(45), fused=False)
  assert int(optax_accum.metrics(state).num_spikes) == 0
  jax.tree.map(np.testing.assert_array_equal, params, ref_params)


def _reference_skips(norms, history, threshold, warmup):
  """Which windows the rule skips, in float64: the history holds applied windows only."""
  seen, skips = [], []
  for x in norms:
    recent = np.asarray(seen[-history:], np.float64)
    spike = len(seen) >= warmup and x > recent.mean() + threshold * recent.std(ddof=1)
    skips.append(bool(spike))
    if not spike:
      seen.append(x)
  return skips


@functools.lru_cache
def _norm_step():
  rule = optax_accum.spike_rule("grad_norm", history=5, threshold=1.5, warmup=3)
  tx = optax_accum.accumulate(optax.sgd(0.0), every_k=1, skip_if=rule)
  return tx, jax.jit(lambda g, s, p: tx.update(g, s, p))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.5, 20.0, width=32), min_size=4, max_size=24))
def test_the_rule_matches_a_float64_reference(norms):
  tx, step = _norm_step()
  params = {"w": jnp.zeros(())}
  state, got = tx.init(params), []
  for x in norms:
    before = int(optax_accum.metrics(state).num_spikes)
    _, state = step({"w": jnp.asarray(x, jnp.float32)}, state, params)
    got.append(int(optax_accum.metrics(state).num_spikes) > before)
  # float32 and float64 may disagree within rounding of the threshold: skip such draws.
  seen = []
  for x, skipped in zip(norms, got, strict=True):
    recent = np.asarray(seen[-5:], np.float64)
    if len(seen) >= 3:
      bound = recent.mean() + 1.5 * recent.std(ddof=1)
      if abs(x - bound) < 1e-4 * max(1.0, bound):
        return
    if not skipped:
      seen.append(x)
  assert got == _reference_skips(norms, 5, 1.5, 3)


def test_a_predicate_reproduces_optax_skip_large_updates():
  # optax's own test values: norm^2 of [11, 0] is 121 > 100 (skip), [9, 0] 81 (apply).
  max_sq = 100.0
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, skip_if=lambda s: s.grad_norm**2 > max_sq)
  params = {"a": jnp.zeros(()), "b": jnp.zeros(())}
  state = tx.init(params)
  for a in (11.0, 9.0, float("inf"), float("nan"), 12.0, 3.0):
    mean = [jnp.asarray(a), jnp.zeros(())]
    optax_skip = bool(optax.skip_large_updates(mean, jnp.zeros((), jnp.int32), None, max_sq)[0])
    m = optax_accum.metrics(state)
    before = int(m.num_spikes) + int(m.num_skipped)
    for g in (a - 1.0, a + 1.0):  # two microbatches whose mean is [a, 0]
      updates, state = tx.update({"a": jnp.asarray(g), "b": jnp.zeros(())}, state, params)
    m = optax_accum.metrics(state)
    assert (int(m.num_spikes) + int(m.num_skipped) > before) == optax_skip, a
    expected = 0.0 if optax_skip else -a
    np.testing.assert_array_equal(updates["a"], expected)


def test_the_predicate_sees_the_windows_statistics():
  seen = []

  def record(s):
    jax.debug.callback(lambda *v: seen.append(v), s.grad_norm, s.loss, s.weight, s.num_updates)
    return s.weight > 10.0

  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, skip_if=record)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for g, w, v in ((3.0, 1.0, 2.0), (0.0, 3.0, 6.0), (1.0, 8.0, 1.0), (1.0, 4.0, 1.0)):
    _, state = tx.update({"w": jnp.full(2, g)}, state, params, weight=w, value=v)
  jax.effects_barrier()
  # Window 1: mean 3/4 per element (norm 0.75 * sqrt 2), loss (2 + 18) / 4 = 5, weight 4.
  np.testing.assert_allclose(seen[0], (0.75 * np.sqrt(2), 5.0, 4.0, 0), rtol=1e-6)
  np.testing.assert_allclose(seen[1], (np.sqrt(2), 1.0, 12.0, 1), rtol=1e-6)
  m = optax_accum.metrics(state)
  assert (int(m.num_updates), int(m.num_spikes)) == (1, 1)


def test_resume_continues_bitwise():
  rule = optax_accum.spike_rule("grad_norm", **RULE)
  windows = _windows(46, "grad_norm")
  params, state = _run(rule, windows, fused=False)
  half_params, half_state = _run(rule, windows[:60], fused=False)
  # Continue, in a fresh transformation, from a host copy (what a checkpoint restores).
  host = jax.tree.map(np.asarray, (half_params, half_state))
  p, s = _run(rule, windows[60:], fused=False, start=host)
  jax.tree.map(np.testing.assert_array_equal, (p, s), (params, state))


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match="watch must name"):
    optax_accum.spike_rule("norm")
  with pytest.raises(ValueError, match="history must be >= 2"):
    optax_accum.spike_rule(history=1)
  with pytest.raises(ValueError, match="threshold must be finite"):
    optax_accum.spike_rule(threshold=0.0)
  with pytest.raises(ValueError, match="warmup must be in"):
    optax_accum.spike_rule(history=8, warmup=9)
  with pytest.raises(TypeError, match="skip_if takes optax_accum.spike_rule"):
    optax_accum.accumulate(optax.sgd(1.0), 2, skip_if=3.0)
  params = {"w": jnp.zeros(2)}
  tx = optax_accum.accumulate(optax.sgd(1.0), 2, skip_if=optax_accum.spike_rule())
  with pytest.raises(ValueError, match="needs the microbatch loss: pass value=loss"):
    tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  tx = optax_accum.accumulate(optax.sgd(1.0), 1, skip_if=lambda s: s.grad_norm)
  with pytest.raises(TypeError, match="must return a boolean scalar"):
    tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  plain = optax_accum.accumulate(optax.sgd(1.0), 1)
  with pytest.raises(
    ValueError,
    match=r"its guard sub-state is EmptyState, this configuration \(skip_if=\) makes GuardState",
  ):
    tx.update({"w": jnp.ones(2)}, plain.init(params), params)


def test_rules_combine_and_the_state_stays_finite():
  rules = (optax_accum.spike_rule("grad_norm", **RULE), lambda s: s.loss > 1e6)
  _, state = _run(rules, _windows(45, "loss"), fused=False)  # loss x100: not above 1e6
  assert int(optax_accum.metrics(state).num_spikes) == 0
  _, state = _run(rules, _windows(45, "grad_norm"), fused=False)
  assert int(optax_accum.metrics(state).num_spikes) == 1
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state.guard))


def test_global_under_axis_name():
  n = jax.device_count()
  mesh = make_mesh((n,), ("data",))
  rule = optax_accum.spike_rule("grad_norm", history=4, threshold=3.0, warmup=2)
  tx = optax_accum.accumulate(optax.sgd(0.0), every_k=1, skip_if=rule, axis_name="data")
  params = {"w": jnp.zeros(())}
  P = jax.sharding.PartitionSpec

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(None, "data"), P()), out_specs=P())
  def run(gs, params):
    state = tx.init(params)
    for g in gs:  # the windows' state stays inside: its window is per device
      state = tx.update({"w": g[0]}, state, params)[1]
    m = optax_accum.metrics(state)
    return m.num_spikes, m.num_updates, m.grad_norm

  # Only device 0 sees a large gradient in window 4; the global mean is 1 + 99 / n.
  gs = jnp.ones((4, n)).at[3, 0].add(99.0)
  gs = jax.device_put(gs, jax.NamedSharding(mesh, P(None, "data")))
  num_spikes, num_updates, grad_norm = jax.jit(run)(gs, params)
  assert (int(num_spikes), int(num_updates)) == (1, 3)
  np.testing.assert_allclose(float(grad_norm), 1 + 99 / n, rtol=1e-6)
