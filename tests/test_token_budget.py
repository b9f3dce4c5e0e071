"""Token-budget windows and ramps (optax_accum/_token_budget.py, _weight_count.py; issue 15).

Every expectation is computed another way: the window boundaries by a Python
loop over the token counts, each applied update by one ``jax.grad`` over the
window's concatenated microbatches (one physical batch), the counters by
Python's exact integers. Each configuration compiles its scan once.
"""

from __future__ import annotations

import functools

import _compat
import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _weight_count, testing

ROWS = 6  # rows (tokens) per padded microbatch
STEPS = 12  # microbatches per run
PARAMS = {"theta": jnp.array([0.5, -1.0, 2.0], jnp.float32), "b": jnp.array(0.25, jnp.float32)}


def loss_fn(params, batch):
  """Masked mean of 0.5 * residual**2 over the valid rows (0/0 = NaN for none)."""
  r = batch["x"] @ params["theta"] + params["b"] - batch["y"]
  return jnp.sum(jnp.where(batch["mask"], 0.5 * r**2, 0.0)) / jnp.sum(batch["mask"])


def make_data(counts, seed=0):
  """Stacked microbatches [len(counts), ROWS]; microbatch i has counts[i] valid rows."""
  rng = np.random.default_rng(seed)
  n = len(counts)
  mask = np.arange(ROWS)[None, :] < np.asarray(counts)[:, None]
  return {
    "x": rng.normal(size=(n, ROWS, 3)).astype(np.float32),
    "y": rng.normal(size=(n, ROWS)).astype(np.float32),
    "mask": mask,
  }


def at(tree, i):
  """Microbatch ``i`` of a tree stacked by ``lax.scan``."""
  return jax.tree.map(lambda a: a[i], tree)


def expected_windows(counts, budget, cap=None):
  """Python reference: the microbatch indices of each closed window."""
  windows, current, total = [], [], 0
  for i, c in enumerate(counts):
    current.append(i)
    total += c
    if total >= budget(len(windows), sum(counts[: i + 1]) - total) or (
      cap is not None and len(current) >= cap
    ):
      windows.append(current)
      current, total = [], 0
  return windows, current


@functools.cache
def _run(budget, cap, of=None):
  """Jitted: every microbatch through accumulate(sgd(1)) at fixed params, one compilation."""
  fn = budget if not isinstance(budget, tuple) else _RAMPS[budget]
  budget = optax_accum.token_budget(fn, of=of, max_microbatches=cap)
  tx = optax_accum.accumulate(optax.sgd(1.0), budget)

  @jax.jit
  def run(data):
    def body(state, batch):
      g = jax.grad(loss_fn)(PARAMS, batch)
      u, state = tx.update(g, state, PARAMS, weight=batch["mask"].sum())
      m = optax_accum.metrics(state)
      return state, (u, m.updated, m.weight_seen, m.window_weight, m.mini_step)

    return jax.lax.scan(body, tx.init(PARAMS), data)

  return run


@jax.jit
def physical_update(data, rows):
  """sgd(1)'s update for one physical batch: the window's microbatches concatenated."""
  flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), data)
  flat["mask"] = flat["mask"] & rows.reshape(-1)
  return jax.tree.map(jnp.negative, jax.grad(loss_fn)(PARAMS, flat))


def check_run(counts, budget, cap, reference_budget, of=None):
  data = make_data(counts)
  state, (updates, updated, seen, window, _) = _run(budget, cap, of)(data)
  windows, _ = expected_windows(counts, reference_budget, cap)
  closes = {w[-1]: w for w in windows}
  total = 0
  for i in range(len(counts)):
    assert bool(updated[i]) == (i in closes and sum(counts[j] for j in closes[i]) > 0), i
    if i in closes:
      weight = sum(counts[j] for j in closes[i])
      total += weight
      if weight:
        rows = np.zeros((len(counts), ROWS), bool)
        rows[closes[i]] = True
        want = physical_update(data, rows)
        chex.assert_trees_all_close(at(updates, i), want, rtol=1e-5, atol=1e-6)
        assert float(at(window, i)) == weight
    else:
      for leaf in jax.tree.leaves(updates):
        assert not np.any(np.asarray(leaf[i]))  # between boundaries: exact zeros
    assert int(at(seen, i)) == total
  assert_state_finite(state)
  return windows


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
  counts=st.lists(st.integers(0, ROWS), min_size=STEPS, max_size=STEPS),
  config=st.sampled_from([(7, None), (16, 3)]),  # (budget, every_k cap): two compilations
)
@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_windows_close_at_the_first_microbatch_reaching_the_budget(counts, config):
  budget, cap = config
  check_run(counts, budget, cap, lambda n, seen: budget)


_RAMPS = {
  ("updates",): lambda n: jnp.where(n < 2, 4, 10),
  ("seen",): lambda t: jnp.where(t < 10.0, 5.0, 12.0),
}


def test_ramp_of_num_updates_changes_the_window_sizes_as_scheduled():
  counts = [2] * STEPS
  windows = check_run(counts, ("updates",), None, lambda n, seen: 4 if n < 2 else 10, "num_updates")
  assert [len(w) for w in windows] == [2, 2, 5]  # 4, 4 tokens, then 10 tokens per update


def test_ramp_of_weight_seen_changes_the_window_sizes_as_scheduled():
  counts = [3, 1, 2, 3, 3, 4, 4, 5, 1, 1, 6, 2]
  windows = check_run(
    counts, ("seen",), None, lambda n, seen: 5 if seen < 10 else 12, "weight_seen"
  )
  # Windows of >= 5 tokens until 10 tokens were seen (at a boundary), then >= 12.
  assert [sum(counts[j] for j in w) for w in windows] == [
    6,
    6,
    13,
  ]  # the last 10 tokens: still open


def test_sqrt_scaled_schedule_follows_the_ramp_through_the_inner_count():
  ramp = lambda n: jnp.where(n < 2, 4, 16)
  budget = optax_accum.token_budget(ramp, of="num_updates")
  lr = budget.sqrt_scaled_schedule(optax.linear_schedule(1.0, 0.5, 4), 4)
  tx = optax_accum.accumulate(optax.sgd(lr), budget)
  params = {"w": jnp.zeros(())}
  state = tx.init(params)
  step = jax.jit(lambda s: tx.update({"w": jnp.ones(())}, s, params, weight=2))
  got = []
  for _ in range(2 + 2 + 8):  # windows of 2, 2 and 8 microbatches
    u, state = step(state)
    if bool(optax_accum.metrics(state).updated):
      got.append(-float(u["w"]))
  want = [1.0 * 1, 0.875 * 1, 0.75 * 2]  # linear schedule at count 0, 1, 2; sqrt(16/4) = 2
  np.testing.assert_allclose(got, want, rtol=1e-6)


# ----------------------------------------------------------------------------- exact counters


def test_weight_seen_is_exact_past_2_24_and_2_31_and_near_1e15():
  tx = optax_accum.accumulate(
    optax.sgd(1.0), optax_accum.token_budget(1)
  )  # every microbatch closes
  params = {"w": jnp.zeros(())}
  step = jax.jit(lambda s, w: tx.update({"w": jnp.ones(())}, s, params, weight=w)[1])
  weights = [2**24, 1, 1, 2**31, 3, 2**32 - 256, 5, 2**49, 2**49, 2**48, 7, 0, 2**46 + 2**23]
  state, total = tx.init(params), 0
  for w in weights:
    state = step(state, jnp.float32(w))
    total += w
    m = optax_accum.metrics(state)
    assert int(m.weight_seen) == total and float(m.weight_seen) == float(total)
  assert total > 1e15 and float(np.float32(total)) != total  # float32 would not hold it
  assert str(m.weight_seen) == str(total) and m.weight_seen.item() == total


def test_a_window_past_2_24_tokens_is_counted_exactly():
  """float32's weight_sum rounds 2**24 + 1; the window's exact parts do not."""
  tx = optax_accum.accumulate(optax.sgd(1.0), optax_accum.token_budget(2**26))
  params = {"w": jnp.zeros(())}
  step = jax.jit(lambda s, w: tx.update({"w": jnp.ones(())}, s, params, weight=w)[1])
  state = tx.init(params)
  weights = [2**24, 1, 2**24 + 2, 3, 2**25 + 4]  # 2**26 + 10: closes at the last one
  for w in weights:
    state = step(state, jnp.float32(w))
  m = optax_accum.metrics(state)
  assert bool(m.updated) and float(np.float32(2**24) + np.float32(1)) != 2**24 + 1
  assert int(m.window_weight) == int(m.weight_seen) == sum(weights)


def test_metrics_weight_seen_is_a_pytree_under_jit():
  tx = optax_accum.accumulate(optax.sgd(1.0), optax_accum.token_budget(3))
  params = {"w": jnp.zeros(())}

  step = jax.jit(lambda s: tx.update({"w": jnp.ones(())}, s, params, weight=2)[1])
  state = tx.init(params)
  for _ in range(4):
    state = step(state)

  @jax.jit
  def f(state):
    m = optax_accum.metrics(state)
    return m, m.weight_seen.approx()

  m, approx = f(state)
  assert isinstance(m.weight_seen, _weight_count.WeightCount)
  assert (float(m.weight_seen), float(m.window_weight), float(approx)) == (8.0, 4.0, 8.0)
  doubled = jax.tree.map(lambda x: x + x, m.weight_seen)
  assert int(doubled) == 16


# ----------------------------------------------------------------------------- with the rest


@pytest.mark.slow
def test_flush_skip_loss_scale_and_clip_with_a_budget():
  tx = optax_accum.accumulate(
    optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0)),
    optax_accum.token_budget(10),
    loss_scale=optax_accum.dynamic_loss_scale(init_scale=2.0**4),
  )
  params = PARAMS
  data = make_data([4, 4, 5, 3], seed=3)
  state = tx.init(params)

  @jax.jit
  def step(state, batch, scale_by):
    scale = optax_accum.metrics(state).loss_scale * scale_by
    g = jax.grad(lambda p: loss_fn(p, batch) * scale)(params)
    return tx.update(g, state, params, weight=batch["mask"].sum())

  mb = lambda i: jax.tree.map(lambda a: a[i], data)
  _, state = step(state, mb(0), 1.0)
  _, state = step(state, mb(1), np.inf)  # a non-finite gradient: 8 tokens, not yet 10
  u, state = step(state, mb(2), 1.0)  # 13 >= 10: closes, skipped
  m = optax_accum.metrics(state)
  assert (int(m.num_skipped), int(m.num_updates), int(m.weight_seen)) == (1, 0, 13)
  assert float(optax_accum.metrics(state).loss_scale) == 2.0**3  # backed off
  _, state = step(state, mb(3), 1.0)  # 3 tokens, then flushed
  u, state = jax.jit(lambda s: optax_accum.flush(tx, s, params))(state)
  m = optax_accum.metrics(state)
  assert (int(m.num_updates), int(m.weight_seen), int(m.window_weight)) == (1, 16, 3)
  rows = np.zeros((4, ROWS), bool)
  rows[3] = True
  want = optax.clip_by_global_norm(0.5).update(physical_update(data, rows), None)[0]
  chex.assert_trees_all_close(u, want, rtol=1e-5, atol=1e-6)
  assert_state_finite(state)


def test_resume_mid_window_with_a_budget():
  tx = optax_accum.accumulate(optax.adam(1e-2), optax_accum.token_budget(9))
  data = make_data([4, 3, 5, 2, 6, 1], seed=4)
  step = jax.jit(
    lambda s, b: tx.update(jax.grad(loss_fn)(PARAMS, b), s, PARAMS, weight=b["mask"].sum())
  )
  mb = lambda i: jax.tree.map(lambda a: a[i], data)
  straight = tx.init(PARAMS)
  for i in range(6):
    straight = step(straight, mb(i))[1]
  saved = tx.init(PARAMS)
  for i in range(4):  # 4 + 3 + 5 closes, then 2 pending
    saved = step(saved, mb(i))[1]
  restored = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), saved)  # through the host
  optax_accum.sharding.check_compatible(tx, PARAMS, restored)
  for i in range(4, 6):
    restored = step(restored, mb(i))[1]
  chex.assert_trees_all_equal(restored, straight)
  m = optax_accum.metrics(restored)
  assert (int(m.weight_seen), int(m.window_weight)) == (4 + 3 + 5 + 2 + 6 + 1, 2 + 6 + 1)
  zeros = jax.tree.map(jnp.zeros_like, PARAMS)
  # Into every_k=4 without a budget: the budget's sub-state is not in that state's leaves.
  plain = optax_accum.accumulate(optax.adam(1e-2), 4)
  with pytest.raises(ValueError, match=r"policy\.weight_seen\.low: in the restored state"):
    optax_accum.sharding.check_compatible(plain, PARAMS, saved)
  with pytest.raises(
    ValueError, match=r"its policy sub-state is TokenBudgetState, this configuration \(every_k="
  ):
    plain.update(zeros, saved, PARAMS)
  # Into a budget capped at 4 microbatches: the same leaves; the cap is configuration.
  capped = optax_accum.accumulate(optax.adam(1e-2), optax_accum.token_budget(9, max_microbatches=4))
  optax_accum.sharding.check_compatible(capped, PARAMS, saved)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
  ("args", "kwargs", "error", "match"),
  [
    ((lambda n: 8,), {}, ValueError, r"of= must say .*'num_updates'"),
    ((8,), {"of": "num_updates"}, ValueError, "only meaningful"),
    ((8,), {"of": "tokens"}, ValueError, "only meaningful"),
    ((0,), {}, ValueError, r"finite and > 0"),
    ((float("nan"),), {}, ValueError, r"finite and > 0"),
    ((True,), {}, TypeError, "must be a number"),
    ((2**24 + 1,), {}, ValueError, r"not exactly representable in float32"),
    ((8,), {"max_microbatches": 0}, ValueError, r"max_microbatches must be >= 1"),
  ],
)
def test_bad_budgets_name_the_argument(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    optax_accum.token_budget(*args, **kwargs)


def test_every_k_none_names_the_token_budget():
  with pytest.raises(TypeError, match=r"every_k=None is not a window policy.*token_budget"):
    optax_accum.accumulate(optax.sgd(1.0), None)


def test_bad_ramp_and_lr_arguments():
  budget = optax_accum.token_budget(lambda n: jnp.ones(2), of="num_updates")
  tx = optax_accum.accumulate(optax.sgd(1.0), budget)
  params = {"w": jnp.zeros(())}
  with pytest.raises(TypeError, match="ramp must return a real scalar"):
    tx.update({"w": jnp.ones(())}, tx.init(params), params)
  with pytest.raises(ValueError, match="reference_weight must be finite and > 0"):
    optax_accum.token_budget(8).sqrt_scaled_schedule(1e-3, 0)
  with pytest.raises(TypeError, match=r"schedule must be a number \(or a callable"):
    optax_accum.token_budget(8).sqrt_scaled_schedule("1e-3", 8)
  with pytest.raises(ValueError, match=r"Rewrite the ramp in num_updates"):
    optax_accum.token_budget(lambda t: 8.0, of="weight_seen").sqrt_scaled_schedule(1e-3, 8)


# ----------------------------------------------------------------------------- shard_map

AXIS, N_DEV = "data", 8


def test_global_budget_under_shard_map_one_scalar_all_reduce_per_microstep():
  """8 devices; the window closes when the tokens of all devices reach 20."""
  tx = optax_accum.accumulate(optax.sgd(1.0), optax_accum.token_budget(20), axis_name=AXIS)
  mesh = _compat.make_mesh((N_DEV,), (AXIS,))
  state = optax_accum.sharding.stack_windows(tx.init(PARAMS), mesh, AXIS)
  specs = optax_accum.sharding.window_specs(state, AXIS)

  def body(params, opt_state, batch):
    opt_state = optax_accum.sharding.local_state(opt_state)
    local = _compat.pcast_varying(params, AXIS)
    grads = jax.grad(loss_fn)(local, batch)
    updates, opt_state = tx.update(grads, opt_state, params, weight=jnp.sum(batch["mask"]))
    return updates, optax_accum.sharding.stacked_state(opt_state)

  f = jax.shard_map(
    chex.assert_max_traces(body, n=1),
    mesh=mesh,
    in_specs=(P(), specs, P(AXIS)),
    out_specs=(P(), specs),
    check_vma=True,
  )
  chex.clear_trace_counter()
  step = jax.jit(f)
  rng = np.random.default_rng(5)
  device_counts = rng.integers(0, 3, size=(6, N_DEV))  # microbatch i, device d
  data = make_data(device_counts.reshape(-1), seed=5)  # rows: [6 * N_DEV, ROWS]
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  batches = [jax.tree.map(lambda a, i=i: a[i * N_DEV : (i + 1) * N_DEV], data) for i in range(6)]
  place = lambda b: jax.device_put(b, NamedSharding(mesh, P(AXIS)))
  windows, _ = expected_windows(list(device_counts.sum(1)), lambda n, seen: 20)
  closes = {w[-1]: w for w in windows}
  assert closes  # the data reach the budget at least once
  for i, batch in enumerate(batches):
    updates, state = step(params, state, place(batch))
    m = optax_accum.metrics(state)
    assert bool(m.updated) == (i in closes)
    if i in closes:
      rows = np.zeros((6 * N_DEV, ROWS), bool)
      rows[[j * N_DEV + d for j in closes[i] for d in range(N_DEV)]] = True
      want = physical_update(data, rows)
      chex.assert_trees_all_close(updates, want, rtol=1e-5, atol=1e-6)
      assert int(m.window_weight) == device_counts[closes[i]].sum()
  hlo = step.lower(params, state, place(batches[0])).compile().as_text()
  counts = testing.count_collectives(hlo)
  assert dict(counts["outside"]) == {"all-reduce": 1}, counts  # the budget's scalar, per microstep
  assert dict(counts["in_conditional"]) == _compat.one_psum(6), counts  # the window's 6 sums
