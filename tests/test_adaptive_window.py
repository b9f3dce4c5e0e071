"""Adaptive windows (optax_accum/_adaptive_window.py; issue 40).

Every expectation is computed another way: the budgets of a scripted ``B_simple`` sequence by
hand; the windows, budgets and updates of gradient streams by a float64 Python replay of the
rule (McCandlish et al.'s estimator, the EMA, the bounds, the factor limit, the warm-up); the
fixed-bounds policy against ``token_budget``; the scaled learning rate against
``optax.inject_hyperparams`` fed the window means.
"""

from __future__ import annotations

import functools

import _compat
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import testing
from optax_accum._protocols import Outcome, WindowStats

DIM = 2
PARAMS = {"w": jnp.zeros(DIM, jnp.float32)}
# The gradient streams' policy: every rule has a say within a few hundred microbatches.
KW = dict(min_weight=8, max_weight=64, fraction=1.0, max_factor=1.5, warmup=3, decay=0.5)


# ----------------------------------------------------------------------------- the rule by hand


def _window(policy, state, grads, weight=1.0, finite=True, spike=False):
  """Closes one window of scalar-gradient microbatches through the protocol, as the core does."""
  window = policy.init_window()
  for g in grads:
    window = policy.add(window, jnp.float32(weight), {"w": jnp.float32(g)})
  total = weight * len(grads)
  mean = sum(grads) / len(grads) if grads else 0.0
  stats = WindowStats(
    jnp.float32(abs(mean)), jnp.float32(0), jnp.bool_(False), jnp.float32(total), jnp.int32(0)
  )
  empty = total == 0
  applied = finite and not spike and not empty
  outcome = Outcome(
    stats, jnp.bool_(applied), jnp.bool_(finite), jnp.bool_(empty), jnp.bool_(spike),
    jnp.float32(1),
  )  # fmt: skip
  return policy.close(state, window, outcome)


def _pair(b):
  """Two unit-weight gradients (1, t) whose window has ``B_simple = (1 - t)^2 / (2 t) = b``:
  ``S = (1 - t)^2 / 2`` and ``G2 = t`` (t > 0); for ``b < 0``, ``(1, -1)``: ``G2 = -1 < 0``."""
  if b < 0:
    return [1.0, -1.0]
  t = (1 + b) + np.sqrt((1 + b) ** 2 - 1)
  return [1.0, float(t)]


def test_budgets_of_a_scripted_b_simple_sequence():
  """decay=0: each estimate is its window's. Bounds [10, 100], target B/2, factor 2, warm-up 2."""
  policy = optax_accum.adaptive_window(10, 100, fraction=0.5, max_factor=2.0, warmup=2, decay=0.0)
  state = policy.init()
  script = [
    # (window, budget after it, estimates counted): by hand
    (_pair(1000), 10, 1),  # warm-up: 1 estimate of 2
    (_pair(1000), 20, 2),  # target 500, at most 2 x 10
    (_pair(1000), 40, 3),  # 2 x 20
    (_pair(60), 30, 4),  # target 30, inside [20, 80]
    (_pair(2), 15, 5),  # target 1: at most / 2
    (_pair(2), 10, 6),  # 7.5 below the minimum 10
    ([], 10, 6),  # an empty window: nothing counted
    ([1.0], 10, 6),  # one microbatch: no estimate (K < 2)
    (_pair(-1), 20, 7),  # signal <= 0: the noise dominates, toward the maximum
    (_pair(1e5), 40, 8),  # target 5e4: at most 2 x 20
    (_pair(1e5), 80, 9),
    (_pair(1e5), 100, 10),  # the maximum
  ]
  for grads, want, counted in script:
    state = _window(policy, state, grads)
    np.testing.assert_allclose(float(state.budget), want, rtol=1e-4)
    assert int(state.num_estimates) == counted
  for finite, spike in ((False, False), (True, True)):  # skipped and spiked windows do not count
    state = _window(policy, state, _pair(2), finite=finite, spike=spike)
    assert (float(state.budget), int(state.num_estimates)) == (100.0, 10)
  m = optax_accum.metrics(_state_with(policy, state))
  assert float(m.window_budget) == 100.0
  # decay 0: the last window's (in float32, S_est of a near-constant pair is mostly rounding)
  np.testing.assert_allclose(float(m.noise_scale), 1e5, rtol=1e-2)


def _state_with(policy, sub):
  tx = optax_accum.accumulate(optax.sgd(1.0), policy)
  return tx.init({"w": jnp.zeros(())})._replace(policy=sub)


# ----------------------------------------------------------------------------- gradient streams


def _stream(steps, seed=0, devices=1):
  """Weights [steps, devices] in 0..4 and gradients [steps, devices, DIM]: mean (1, 1) plus noise
  of per-example std sigma / sqrt(weight), sigma 1 (B_simple ~ 1), then 12 (~144), then 1."""
  rng = np.random.default_rng(seed)
  w = rng.integers(1, 5, size=(steps, devices)).astype(np.float32)
  w[rng.random((steps, devices)) < 0.05] = 0  # some all-padding microbatches: not samples
  sigma = np.where((np.arange(steps) > steps // 4) & (np.arange(steps) < 3 * steps // 4), 12, 1)
  z = rng.normal(size=(steps, devices, DIM))
  g = 1.0 + sigma[:, None, None] * z / np.sqrt(np.maximum(w, 1))[..., None]
  return w, g.astype(np.float32)


def replay(w, g, min_weight, max_weight, fraction, max_factor, warmup, decay, cap=None):
  """Float64 Python: the step of each boundary, the budget after it, each window's mean."""
  budget, n_est, ema = float(min_weight), 0, np.zeros(3)
  closes, budgets, means, open_ = [], [], [], []
  for i in range(len(w)):
    open_.append(i)
    ws, gs = w[open_].reshape(-1).astype(np.float64), g[open_].reshape(-1, DIM).astype(np.float64)
    if not (ws.sum() >= budget or (cap is not None and len(open_) >= cap)):
      continue
    n, k = ws.sum(), (ws > 0).sum()
    mean = (ws[:, None] * gs).sum(0) / n
    sq = (ws * (gs**2).sum(1)).sum()
    if k >= 2 and n > 0:
      trace = (sq - n * mean @ mean) / (k - 1)
      signal = (k * mean @ mean - sq / n) / (k - 1)
      ema = decay * ema + (1 - decay) * np.array([trace, signal, 1.0])
      n_est += 1
      if n_est >= warmup:
        trace, signal = ema[0] / ema[2], ema[1] / ema[2]
        if signal > 0:
          target = fraction * trace / signal
        else:
          target = max_weight if trace > 0 else budget
        low, high = max(min_weight, budget / max_factor), min(max_weight, budget * max_factor)
        budget = min(max(target, low), high)
    closes.append(i)
    budgets.append(budget)
    means.append(mean)
    open_ = []
  return closes, budgets, means


@functools.cache
def _scan(kw_items, cap=None):
  """Jitted: the stream through accumulate(sgd(1), adaptive_window) at fixed params."""
  policy = optax_accum.adaptive_window(**dict(kw_items), max_microbatches=cap)
  tx = optax_accum.accumulate(optax.sgd(1.0), policy)

  @jax.jit
  def run(w, g):
    def body(state, wg):
      u, state = tx.update({"w": wg[1][0]}, state, PARAMS, weight=wg[0][0])
      m = optax_accum.metrics(state)
      return state, (u["w"], m.updated, m.window_budget, m.window_weight.approx())

    return jax.lax.scan(body, tx.init(PARAMS), (w, g))

  return run


@pytest.mark.parametrize("cap", [None, 12])
def test_windows_budgets_and_updates_follow_the_rule(cap):
  """The bounds, the factor limit (up, then down) and the warm-up, each reached; every applied
  update is minus its window's weighted mean (one physical batch)."""
  w, g = _stream(700, seed=1)
  state, (u, updated, budget, window_weight) = _scan(tuple(KW.items()), cap)(w, g)
  closes, budgets, means = replay(w, g, **KW, cap=cap)
  assert np.flatnonzero(np.asarray(updated)).tolist() == closes
  np.testing.assert_allclose(np.asarray(budget)[closes], budgets, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(u)[closes], -np.asarray(means), rtol=1e-5, atol=1e-6)
  assert not np.any(np.asarray(u)[np.asarray(~updated)])  # exact zeros between boundaries
  starts = [0] + [c + 1 for c in closes[:-1]]
  want_weights = [w[s : c + 1].sum() for s, c in zip(starts, closes, strict=True)]
  np.testing.assert_array_equal(np.asarray(window_weight)[closes], want_weights)
  # The stream reaches every rule: warm-up at the minimum, growth by the factor to the
  # maximum, shrinking by the factor back to the minimum.
  b = np.asarray(budgets)
  assert b[: KW["warmup"] - 1].tolist() == [8.0] * (KW["warmup"] - 1)
  assert np.any(b == 64.0) and b[-1] == 8.0 or cap is not None
  steps = b[1:] / b[:-1]
  assert np.isclose(steps.max(), 1.5) and np.isclose(steps.min(), 1 / 1.5)
  assert steps.max() <= 1.5 * (1 + 1e-6) and steps.min() >= (1 - 1e-6) / 1.5
  assert_state_finite(state)


def test_equal_bounds_are_a_token_budget_bitwise():
  """min == max: token_budget(min)'s windows and updates, bit for bit (through adam), its counts."""
  w, g = _stream(120, seed=2)
  txs = [
    optax_accum.accumulate(optax.adam(1e-2), every_k)
    for every_k in (optax_accum.adaptive_window(16, 16), optax_accum.token_budget(16))
  ]
  states = [tx.init(PARAMS) for tx in txs]
  params = [PARAMS, PARAMS]
  steps = [jax.jit(functools.partial(optax_accum.update_and_apply, tx)) for tx in txs]
  for i in range(len(w)):
    for j, step in enumerate(steps):
      params[j], states[j] = step({"w": g[i, 0]}, states[j], params[j], weight=w[i, 0])
    chex.assert_trees_all_equal(params[0], params[1])
  a, b = (optax_accum.metrics(s) for s in states)
  assert int(a.num_updates) == int(b.num_updates) > 10
  assert (int(a.weight_seen), int(a.window_weight)) == (int(b.weight_seen), int(b.window_weight))
  assert float(a.window_budget) == 16.0 and b.window_budget is None
  assert float(a.noise_trace) > 0  # it measured the noise too


# ----------------------------------------------------------------------------- the learning rate


@pytest.mark.parametrize("rule", ["sqrt", "linear"])
def test_scaled_learning_rate_follows_each_realized_window_weight(rule):
  """Adam through scale_learning_rate equals inject_hyperparams(adam) fed each window mean with
  lr = 1e-2 * (w / 8) ** p, w the window's weight (computed from the stream)."""
  w, g = _stream(400, seed=3)
  policy = optax_accum.adaptive_window(**KW)
  tx = policy.scale_learning_rate(optax_accum.accumulate(optax.adam(1e-2), policy), rule=rule)
  step = jax.jit(tx.update)
  ref = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  ref_state = ref.init(PARAMS)
  closes, _, means = replay(w, g, **KW)
  state, start, sizes = tx.init(PARAMS), 0, set()
  power = 0.5 if rule == "sqrt" else 1.0
  for i in range(len(w)):
    u, state = step({"w": g[i, 0]}, state, PARAMS, weight=w[i, 0])
    if i not in closes:
      assert not np.any(np.asarray(u["w"]))
      continue
    weight = float(w[start : i + 1].sum())
    sizes.add(weight)
    ref_state.hyperparams["learning_rate"] = jnp.float32(1e-2 * (weight / 8) ** power)
    want, ref_state = ref.update({"w": jnp.float32(means[closes.index(i)])}, ref_state, PARAMS)
    np.testing.assert_allclose(u["w"], want["w"], rtol=1e-4, atol=1e-7)
    start = i + 1
  assert max(sizes) >= 64 and min(sizes) < 12  # the windows did grow: the scaling mattered


def test_scale_learning_rate_keeps_dtypes_and_names_its_mistakes():
  policy = optax_accum.adaptive_window(4, 4)
  tx = policy.scale_learning_rate(
    optax_accum.accumulate(optax.sgd(1.0), policy), reference_weight=1, rule="linear"
  )
  params = {"w": jnp.zeros(2, jnp.bfloat16)}
  state = tx.init(params)
  for n in (1, 3):
    u, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params, weight=n)
  assert u["w"].dtype == jnp.bfloat16 and float(u["w"][0]) == -4.0  # lr 1 x 4 / 1
  with pytest.raises(ValueError, match=r"rule must be 'sqrt' .* or 'linear'"):
    policy.scale_learning_rate(tx, rule="cubic")
  with pytest.raises(ValueError, match="reference_weight must be finite and > 0"):
    policy.scale_learning_rate(tx, reference_weight=0)
  other = policy.scale_learning_rate(optax_accum.accumulate(optax.sgd(1.0), 4))
  with pytest.raises(TypeError, match=r"window policy state EmptyState\. Wrap"):
    other.init(PARAMS)  # refused when the state is made, before any update
  with pytest.raises(TypeError, match=r"window policy state EmptyState\. Wrap"):
    other.update({"w": jnp.ones(2)}, optax_accum.accumulate(optax.sgd(1.0), 4).init(PARAMS), PARAMS)
  bare = policy.scale_learning_rate(optax.adam(1e-3))  # the inner optimizer without accumulate
  with pytest.raises(ValueError, match=r"scale_learning_rate\(tx\) .* not the inner optimizer"):
    bare.init(PARAMS)


# ----------------------------------------------------------------------------- shard_map

AXIS, N_DEV = "data", 8


@pytest.mark.slow
def test_global_decision_under_shard_map_one_scalar_all_reduce_per_microstep():
  """8 devices, each adding its own microbatch per step: the windows, budgets and updates of the
  replay over all devices' microbatches (each one a sample); one budget on every device."""
  kw = dict(KW, min_weight=24, max_weight=400)
  policy = optax_accum.adaptive_window(**kw)
  tx = optax_accum.accumulate(optax.sgd(1.0), policy, axis_name=AXIS)
  mesh = _compat.make_mesh((N_DEV,), (AXIS,))
  state = optax_accum.sharding.stack_windows(tx.init(PARAMS), mesh, AXIS)
  specs = optax_accum.sharding.window_specs(state, AXIS)

  def body(params, opt_state, w, g):
    opt_state = optax_accum.sharding.local_state(opt_state)
    grads = {"w": g[0]}  # this device's microbatch: device-varying
    updates, opt_state = tx.update(grads, opt_state, params, weight=w[0])
    return updates, optax_accum.sharding.stacked_state(opt_state)

  f = jax.shard_map(
    chex.assert_max_traces(body, n=1),
    mesh=mesh,
    in_specs=(P(), specs, P(AXIS), P(AXIS)),
    out_specs=(P(), specs),
    check_vma=True,
  )
  chex.clear_trace_counter()
  step = jax.jit(f)
  w, g = _stream(160, seed=4, devices=N_DEV)
  closes, budgets, means = replay(w, g, **kw)
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  place = lambda x: jax.device_put(x, NamedSharding(mesh, P(AXIS)))
  got_closes, got_budgets = [], []
  for i in range(len(w)):
    u, state = step(params, state, place(w[i]), place(g[i]))
    m = optax_accum.metrics(state)
    if bool(m.updated):
      got_closes.append(i)
      got_budgets.append(float(m.window_budget))
      np.testing.assert_allclose(u["w"], -means[closes.index(i)], rtol=1e-5, atol=1e-6)
  assert got_closes == closes and len(closes) > 10
  np.testing.assert_allclose(got_budgets, budgets, rtol=1e-4)
  assert max(budgets) > kw["min_weight"]  # the budget moved
  hlo = step.lower(params, state, place(w[0]), place(g[0])).compile().as_text()
  counts = testing.count_collectives(hlo)
  assert dict(counts["outside"]) == {"all-reduce": 1}, counts  # the budget's scalar
  # The window's sums: grad, weight, value, value weight, weight parts, noise sums (2).
  assert dict(counts["in_conditional"]) == _compat.one_psum(7), counts


# ----------------------------------------------------------------------------- resume, vmap, NaN


@pytest.mark.slow
def test_resume_mid_window_continues_the_same_windows_and_refuses_another_policy():
  w, g = (jnp.asarray(x) for x in _stream(200, seed=5))
  policy = optax_accum.adaptive_window(**KW)
  tx = optax_accum.accumulate(optax.adam(1e-2), policy)
  step = jax.jit(lambda s, i: tx.update({"w": g[i, 0]}, s, PARAMS, weight=w[i, 0]))
  straight, trace = tx.init(PARAMS), []
  for i in range(len(w)):
    u, straight = step(straight, i)
    trace.append(u)
  saved = tx.init(PARAMS)
  save_at = 150
  for i in range(save_at):
    _, saved = step(saved, i)
  m = optax_accum.metrics(saved)
  assert int(m.mini_step) > 0 and float(m.window_budget) > KW["min_weight"]  # mid-window, moved
  restored = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), saved)  # through the host
  fresh = optax_accum.accumulate(optax.adam(1e-2), optax_accum.adaptive_window(**KW))
  restored = optax_accum.sharding.check_compatible(fresh, PARAMS, restored)
  step = jax.jit(lambda s, i: fresh.update({"w": g[i, 0]}, s, PARAMS, weight=w[i, 0]))
  for i in range(save_at, len(w)):
    u, restored = step(restored, i)
    chex.assert_trees_all_equal(u, trace[i])
  chex.assert_trees_all_equal(restored, straight)
  zeros = {"w": jnp.zeros(DIM)}
  budget = optax_accum.accumulate(optax.adam(1e-2), optax_accum.token_budget(8))
  want = r"its policy sub-state is {}, this configuration \(every_k=\) makes {}"
  with pytest.raises(ValueError, match=want.format("AdaptiveWindowState", "TokenBudgetState")):
    budget.update(zeros, saved, PARAMS)
  with pytest.raises(ValueError, match=want.format("TokenBudgetState", "AdaptiveWindowState")):
    tx.update(zeros, budget.init(PARAMS), PARAMS)
  with pytest.raises(ValueError, match=r"policy\.budget: in the restored state"):
    optax_accum.sharding.check_compatible(budget, PARAMS, saved)
  # Between windows, a token budget's state moves to the adaptive policy (migrate_state): the
  # inner state and counters kept, the policy's sub-state fresh (the budget at its minimum).
  state = budget.init(PARAMS)
  for n in (5, 3):  # one window of 8
    _, state = budget.update(zeros, state, PARAMS, weight=n)
  moved = optax_accum.sharding.migrate_state(tx, PARAMS, state)
  chex.assert_trees_all_equal(moved.inner_state, state.inner_state)
  assert int(moved.num_updates) == 1 and float(moved.policy.budget) == KW["min_weight"]


@pytest.mark.slow
def test_vmap_over_states_is_each_run_alone():
  """Two streams side by side (lax.cond becomes a select): each member's windows as alone."""
  streams = [_stream(300, seed=s) for s in (6, 7)]
  run = _scan(tuple(KW.items()))
  alone = [run(w, g) for w, g in streams]
  w, g = (np.stack(x) for x in zip(*streams, strict=True))
  together = jax.vmap(run)(w, g)
  for k in range(2):
    chex.assert_trees_all_close(jax.tree.map(lambda x, k=k: x[k], together), alone[k], rtol=1e-6)
  assert not np.array_equal(alone[0][1][1], alone[1][1][1])  # the members' windows differ


@pytest.mark.slow
def test_no_nan_under_jax_debug_nans():
  """A jitted run under jax_debug_nans (warm-up, empty and one-sample windows, flushes, a negative
  signal estimate, growth and bounds); then the policy's own arithmetic op by op, where every
  intermediate is checked (the core's step itself holds a NaN constant for non-finite windows)."""
  policy = optax_accum.adaptive_window(2, 16, max_factor=2.0, warmup=1, decay=0.0)
  tx = policy.scale_learning_rate(optax_accum.accumulate(optax.adam(1e-2), policy))
  params = {"w": jnp.zeros(DIM)}
  feed = [(0, [1.0, 1.0]), (0, [1.0, 1.0])]  # zero weights: empty, then flushed
  feed += [(1, [1.0, 1.0]), (1, [1.0, -1.0]), (2, [0.0, 0.0])]
  feed += [(1, [1.0, 3.0]), (1, [-5.0, 3.0])] * 6
  with jax.debug_nans(True):
    state = tx.init(params)
    step = jax.jit(lambda g, s, n, f: tx.update({"w": g}, s, params, weight=n, flush=f))
    for i, (n, g) in enumerate(feed):
      _, state = step(jnp.asarray(g), state, jnp.float32(n), jnp.bool_(i == 1))
    state = optax_accum.flush(tx, state, params)[1]
    jax.block_until_ready(state)
  m = optax_accum.metrics(state)
  assert int(m.num_updates) >= 4 and float(m.window_budget) > 2
  assert_state_finite(state)
  with jax.debug_nans(True), jax.disable_jit():
    sub = policy.init()
    for grads in ([], [1.0], [1.0, 1.0], [1.0, -1.0], [0.0, 0.0], [1.0, 3.0], [1.0, 1e-30]):
      sub = _window(policy, sub, grads)
    sub = _window(policy, sub, [1.0, 3.0], finite=False)
  assert_state_finite(sub)


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    (dict(min_weight=0, max_weight=8), ValueError, r"min_weight must be finite and > 0"),
    (dict(min_weight=8, max_weight=4), ValueError, r"max_weight=4 is below min_weight=8"),
    (dict(min_weight=8, max_weight=2**24 + 1), ValueError, r"max_weight=16777217 is not exactly"),
    (dict(min_weight=8, max_weight=9, fraction=0.0), ValueError, r"fraction must be finite"),
    (dict(min_weight=8, max_weight=9, max_factor=1.0), ValueError, r"max_factor must be .* > 1"),
    (dict(min_weight=8, max_weight=9, warmup=0), ValueError, r"warmup must be >= 1"),
    (dict(min_weight=8, max_weight=9, decay=1.0), ValueError, r"decay must be in \[0, 1\)"),
    (dict(min_weight="8", max_weight=9), TypeError, r"min_weight must be a number"),
    (dict(min_weight=8, max_weight=9, max_microbatches=0), ValueError, "max_microbatches must"),
  ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
  with pytest.raises(error, match=match):
    optax_accum.adaptive_window(**kwargs)


def test_a_fixed_denominator_is_refused():
  with pytest.raises(ValueError, match="adaptive_window estimates the noise of a weighted mean"):
    optax_accum.accumulate(
      optax.sgd(1.0),
      optax_accum.adaptive_window(8, 64),
      aggregate=optax_accum.aggregate(denominator=1),
    )
