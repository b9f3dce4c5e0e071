"""Aggregation rules (optax_accum/_aggregation.py): a fixed denominator, per-leaf reductions.

Every expected value is computed another way: a float64 numpy sum of the microbatches, a
numpy max or last, ``jax.grad`` of the concatenated batch's loss with the same divisor, or a
single device accumulating what the devices of a ``shard_map`` saw.
"""

import _compat
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.testing import count_collectives

RNG = np.random.default_rng(0)


def run(tx, grads, weights, params, *, fused=True, flush_last=False):
  """Feeds the microbatches; returns (params, state, emitted) after the last."""
  state, emitted = tx.init(params), []
  for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
    flush = flush_last and i == len(grads) - 1
    if fused:
      params, state = optax_accum.update_and_apply(tx, g, state, params, weight=w, flush=flush)
    else:
      u, state = tx.update(g, state, params, weight=w, flush=flush)
      params = optax.apply_updates(params, u)
      emitted.append(u)
  return params, state, emitted


# ------------------------------------------------------------------ the denominator


def test_fixed_denominator_gives_the_weighted_sum_over_n_exactly():
  """sgd(1): the update is -sum_i w_i g_i / N, whatever the realized weight (here 7, N=8)."""
  grads = [{"w": np.array([3.0, -1.0])}, {"w": np.array([1.0, 5.0])}, {"w": np.array([2.0, 2.0])}]
  weights = [2, 4, 1]
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=3, aggregate=optax_accum.aggregate(denominator=8)
  )
  params, state, emitted = run(tx, grads, weights, {"w": jnp.zeros(2)}, fused=False)
  expected = -sum(w * g["w"] for g, w in zip(grads, weights, strict=True)) / 8  # float64
  np.testing.assert_array_equal(emitted[-1]["w"], expected.astype(np.float32))
  assert not np.any(emitted[0]["w"]) and not np.any(emitted[1]["w"])  # exact zeros between
  assert int(state.num_updates) == 1
  assert_state_finite(state)


def test_denominator_one_is_the_sum_and_a_schedule_is_read_per_window():
  grads = [{"w": np.array([1.5])}, {"w": np.array([-0.5])}] * 2
  weights = [3, 2, 3, 2]
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=2, aggregate=optax_accum.aggregate(denominator=lambda n: 2.0 ** (n + 1))
  )
  _, _, emitted = run(tx, grads, weights, {"w": jnp.zeros(1)}, fused=False)
  window = 3 * 1.5 + 2 * -0.5
  np.testing.assert_array_equal(emitted[1]["w"], [-window / 2])  # num_updates 0: N = 2
  np.testing.assert_array_equal(emitted[3]["w"], [-window / 4])  # num_updates 1: N = 4
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=2, aggregate=optax_accum.aggregate(denominator=1)
  )
  _, _, emitted = run(tx, grads[:2], weights[:2], {"w": jnp.zeros(1)}, fused=False)
  np.testing.assert_array_equal(emitted[1]["w"], [-window])


@pytest.mark.parametrize("apply_empty", [False, True])
def test_empty_window_with_a_fixed_denominator(apply_empty):
  """DP-SGD with Poisson sampling: a window may be empty. apply_empty runs the inner on zeros
  (its count and weight decay advance, as its noise would be added); else it is skipped."""
  inner = optax.chain(optax.add_decayed_weights(0.5), optax.scale_by_adam(), optax.scale(-0.1))
  tx = optax_accum.accumulate(
    inner, every_k=2, aggregate=optax_accum.aggregate(denominator=4, apply_empty=apply_empty)
  )
  params = {"w": jnp.array([1.0, -2.0])}
  zeros = {"w": np.zeros(2)}
  new, state, _ = run(tx, [zeros, zeros], [0, 0], params)
  if apply_empty:  # the inner once on a zero gradient: the decayed weights through Adam
    ref_state = inner.init(params)
    u, _ = inner.update(jax.tree.map(jnp.zeros_like, params), ref_state, params)
    np.testing.assert_allclose(new["w"], params["w"] + u["w"], rtol=1e-6)
    assert int(state.num_updates) == 1
  else:
    np.testing.assert_array_equal(new["w"], params["w"])
    assert int(state.num_updates) == 0 and int(state.num_skipped) == 0
  assert_state_finite(state)


def test_flush_of_a_window_without_microbatches_is_a_no_op_with_apply_empty():
  """An epoch's-end flush adds no DP-SGD step when the last window closed on its own; a window
  of weight-0 microbatches is one (Poisson sampling drew nothing) and is applied."""
  tx = optax_accum.accumulate(
    optax.adam(0.1), every_k=2, aggregate=optax_accum.aggregate(denominator=4.0, apply_empty=True)
  )
  params = {"w": jnp.array([1.0, -2.0])}
  ones = {"w": np.ones(2)}
  params, state, _ = run(tx, [ones, ones], [1, 1], params)  # one full window
  updates, flushed = optax_accum.flush(tx, state, params)
  assert not np.any(updates["w"])
  assert not flushed.updated  # nothing applied by this call; all else as it was:
  jax.tree.map(np.testing.assert_array_equal, flushed._replace(updated=state.updated), state)
  # One empty microbatch open, then a flush: that window was drawn, so it is applied.
  _, state = tx.update({"w": np.zeros(2)}, state, params, weight=0)
  updates, state = optax_accum.flush(tx, state, params)
  assert int(state.num_updates) == 2 and int(state.inner_state[0].count) == 2
  assert np.all(updates["w"] != 0)  # Adam on a zero gradient still moves: its momentum


def test_a_schedule_value_that_cannot_divide_raises_eagerly_and_skips_under_jit():
  """A denominator schedule's value must be finite and > 0, like a fixed one: concrete, it
  raises; traced (under jit), the window is skipped and counted, nothing else changes."""
  params, ones = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=1, aggregate=optax_accum.aggregate(denominator=lambda n: 4.0 - 4.0 * n)
  )
  state = tx.init(params)
  params, state = optax_accum.update_and_apply(tx, ones, state, params)  # N = 4
  np.testing.assert_array_equal(params["w"], [-0.25, -0.25])
  with pytest.raises(ValueError, match="the denominator schedule's value must be finite and > 0"):
    optax_accum.update_and_apply(tx, ones, state, params)  # N = 0
  step = jax.jit(lambda p, s: optax_accum.update_and_apply(tx, ones, s, p))
  new, state = step(params, state)
  np.testing.assert_array_equal(new["w"], params["w"])
  assert int(state.num_skipped) == 1 and int(state.num_updates) == 1
  assert_state_finite(state)
  negative = optax_accum.accumulate(
    optax.sgd(1.0), every_k=1, aggregate=optax_accum.aggregate(denominator=lambda n: -2.0)
  )
  with pytest.raises(ValueError, match="got -2.0"):  # a constant: concrete under jit too
    jax.jit(lambda s: negative.update(ones, s, params))(negative.init(params))


def test_in_step_fixed_denominator_needs_an_explicit_weight_fn():
  """Issue 37, item 2: in-step weighted microbatches by rows, accumulate by 1, under the same
  denominator; the default would differ, so the choice is asked for, and both paths agree."""
  loss = lambda w, mb: jnp.sum((mb - w) ** 2) / 8  # at the batch's scale: 8 rows in all
  agg = optax_accum.aggregate(denominator=1)
  with pytest.raises(ValueError, match=r"needs weight_fn=.*lambda mb: 1"):
    optax_accum.microbatched_value_and_grad(loss, 4, aggregate=agg)
  batch = jnp.arange(8.0)
  value, grad = optax_accum.microbatched_value_and_grad(
    loss, 4, weight_fn=lambda mb: 1, aggregate=agg
  )(0.5, batch)
  want_value, want_grad = jax.value_and_grad(loss)(0.5, batch)  # one physical batch
  np.testing.assert_allclose([value, grad], [want_value, want_grad], rtol=1e-6)
  # Across steps: the default weight 1, the same denominator, the same gradient.
  tx = optax_accum.accumulate(optax.sgd(1.0), 4, aggregate=agg)
  state, params = tx.init(jnp.asarray(0.5)), jnp.asarray(0.5)
  for mb in batch.reshape(4, 2):
    u, state = tx.update(jax.grad(loss)(params, mb), state, params)
  np.testing.assert_allclose(-u, want_grad, rtol=1e-6)


def test_in_step_denominator_arrays_are_checked():
  loss = lambda w, mb: jnp.mean((mb - w) ** 2)
  for bad in (jnp.asarray(0.0), jnp.asarray(-2.0), np.float32(np.inf)):
    with pytest.raises(ValueError, match="denominator must be finite and > 0"):
      optax_accum.microbatched_value_and_grad(
        loss, 2, aggregate=optax_accum.aggregate(denominator=bad)
      )
  with pytest.raises(TypeError, match=r"denominator must be a real scalar \(0-d\)"):
    optax_accum.microbatched_value_and_grad(
      loss, 2, aggregate=optax_accum.aggregate(denominator=jnp.asarray([2.0, 4.0]))
    )
  batch = jnp.arange(4.0)
  rows = lambda mb: mb.shape[0]  # explicit: with a fixed denominator the weight is a choice
  f = lambda d: optax_accum.microbatched_value_and_grad(
    loss, 2, weight_fn=rows, aggregate=optax_accum.aggregate(denominator=d)
  )(0.0, batch)
  value, grad = jax.jit(f)(jnp.asarray(8.0))  # traced: used as it is
  sq = np.arange(4.0) ** 2  # each microbatch's mean loss has weight 2 (its rows): sum / 8
  np.testing.assert_allclose(float(value), 2 * (sq[:2].mean() + sq[2:].mean()) / 8, rtol=1e-6)
  np.testing.assert_allclose(float(grad), -2 * np.arange(4.0).sum() / 8, rtol=1e-6)


def test_apply_empty_needs_a_denominator_and_bad_values_raise():
  with pytest.raises(ValueError, match="apply_empty=True needs a fixed denominator"):
    optax_accum.accumulate(
      optax.sgd(1.0), every_k=2, aggregate=optax_accum.aggregate(apply_empty=True)
    )
  for bad in (0, -1.0, float("inf")):
    with pytest.raises(ValueError, match="denominator must be finite and > 0"):
      optax_accum.accumulate(
        optax.sgd(1.0), every_k=2, aggregate=optax_accum.aggregate(denominator=bad)
      )
  with pytest.raises(ValueError, match="each must be one of"):
    optax_accum.accumulate(
      optax.sgd(1.0), every_k=2, aggregate=optax_accum.aggregate(reduce={"w": "median"})
    )
  with pytest.raises(ValueError, match="noise_scale estimates the noise of a weighted mean"):
    optax_accum.accumulate(
      optax.sgd(1.0),
      2,
      observe=(optax_accum.noise_scale(0.9),),
      aggregate=optax_accum.aggregate(denominator=4),
    )


def test_flush_loss_and_clip_with_a_fixed_denominator():
  """An incomplete window is divided by N too (not by what it holds); the window loss is
  sum_i w_i v_i / N; the clip acts on the unscaled window value (C9's rule)."""
  tx = optax_accum.accumulate(
    optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)),
    every_k=4,
    loss_scale=optax_accum.static_loss_scale(64.0),
    aggregate=optax_accum.aggregate(denominator=10),
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  g1, g2 = np.array([30.0, 0.0]), np.array([0.0, 40.0])  # unscaled grads, weights 1 and 1
  for g, v in ((g1, 2.0), (g2, 4.0)):
    u, state = tx.update({"w": 64.0 * g}, state, params, weight=1, value=v)
  u, state = optax_accum.flush(tx, state, params)
  mean = (g1 + g2) / 10  # (3, 4): norm 5, clipped to 1
  np.testing.assert_allclose(u["w"], -mean / 5, rtol=1e-6)
  m = optax_accum.metrics(state)
  np.testing.assert_allclose(float(m.window_loss), (2.0 + 4.0) / 10, rtol=1e-6)
  np.testing.assert_allclose(float(m.grad_norm), 5.0, rtol=1e-6)


@settings(max_examples=12, deadline=None)
@given(
  st.lists(st.integers(0, 9), min_size=1, max_size=6),
  st.floats(0.5, 100.0),
  st.integers(0, 2**16),
)
@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_denominator_matches_a_float64_reference(weights, n, seed):
  rng = np.random.default_rng(seed)
  grads = [{"w": rng.normal(size=3)} for _ in weights]
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=len(weights), aggregate=optax_accum.aggregate(denominator=n)
  )
  _, _, emitted = run(tx, grads, weights, {"w": jnp.zeros(3)}, fused=False)
  expected = -sum(w * g["w"] for g, w in zip(grads, weights, strict=True)) / n
  np.testing.assert_allclose(emitted[-1]["w"], expected, rtol=2e-6, atol=1e-6)


# ------------------------------------------------------------------ per-leaf rules


def rule_data(k=4):
  grads = [{"m": RNG.normal(size=3), "l": RNG.normal(size=2), "s": RNG.normal(size=2)}
           for _ in range(k)]  # fmt: skip
  return grads, [2, 0, 3, 1]  # the weight-0 microbatch is excluded from max and last


def test_max_last_and_sum_leaves():
  """The Keras overwrite_with_gradient rule (window max) and 'last' overwrite the param
  exactly on the fused path; 'sum' goes to the inner optimizer as sum_i w_i g_i."""
  grads, weights = rule_data()
  grads[1]["m"] = np.full(3, 1e6)  # weight 0: not a sample of the window
  params = {"m": jnp.zeros(3), "l": jnp.full(2, 7.0), "s": jnp.zeros(2)}
  tx = optax_accum.accumulate(
    optax.sgd(1.0),
    every_k=4,
    aggregate=optax_accum.aggregate(reduce={"m": "max", "l": "last", "s": "sum"}),
  )
  new, state, _ = run(tx, grads, weights, params)
  seen = [g for g, w in zip(grads, weights, strict=True) if w]
  np.testing.assert_array_equal(new["m"], np.max([g["m"] for g in seen], 0).astype(np.float32))
  np.testing.assert_array_equal(new["l"], seen[-1]["l"].astype(np.float32))
  summed = sum(w * g["s"] for g, w in zip(grads, weights, strict=True))
  np.testing.assert_allclose(new["s"], -summed, rtol=1e-6)
  # The inner optimizer never saw the overwritten leaves.
  assert int(optax_accum.metrics(state).num_updates) == 1
  # tx.update emits value - param for them: apply_updates lands within rounding.
  via_update, _, _ = run(tx, grads, weights, params, fused=False)
  for k in ("m", "l", "s"):
    np.testing.assert_allclose(via_update[k], new[k], rtol=1e-6)


def test_overwrite_false_hands_the_reduced_value_to_the_inner():
  grads, weights = rule_data()
  params = {"m": jnp.ones(3), "l": jnp.ones(2), "s": jnp.ones(2)}
  tx = optax_accum.accumulate(
    optax.sgd(0.5), every_k=4, aggregate=optax_accum.aggregate(reduce="max", overwrite=False)
  )
  new, _, _ = run(tx, grads, weights, params)
  seen = [g for g, w in zip(grads, weights, strict=True) if w]
  for k in params:
    expected = 1.0 - 0.5 * np.max([g[k] for g in seen], 0)
    np.testing.assert_allclose(new[k], expected, rtol=1e-6, atol=1e-7)


def test_skipped_window_leaves_overwritten_leaves_untouched():
  grads, weights = rule_data()
  grads[2]["s"] = np.array([np.nan, 1.0])
  params = {"m": jnp.zeros(3), "l": jnp.zeros(2), "s": jnp.zeros(2)}
  tx = optax_accum.accumulate(
    optax.adam(0.1),
    every_k=4,
    aggregate=optax_accum.aggregate(reduce={"m": "max", "l": "last", "s": "mean"}),
  )
  new, state, _ = run(tx, grads, weights, params)
  for k in params:
    np.testing.assert_array_equal(new[k], params[k])
  assert int(state.num_skipped) == 1
  assert_state_finite(state)


def test_a_callable_rule_of_the_params_and_a_bad_prefix():
  grads, weights = rule_data()
  params = {"m": jnp.zeros(3), "l": jnp.zeros(2), "s": jnp.zeros(2)}
  by_name = lambda tree: {k: "max" if k == "m" else "mean" for k in tree}
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=4, aggregate=optax_accum.aggregate(reduce=by_name)
  )
  new, _, _ = run(tx, grads, weights, params)
  seen = [g for g, w in zip(grads, weights, strict=True) if w]
  np.testing.assert_array_equal(new["m"], np.max([g["m"] for g in seen], 0).astype(np.float32))
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=4, aggregate=optax_accum.aggregate(reduce={"m": "max"})
  )
  with pytest.raises(ValueError, match="reduce= must be a rule or a tree prefix"):
    tx.init(params)


def test_a_dict_prefix_names_paths_of_any_mapping_and_refuses_what_the_params_lack():
  """Matched by key path: a dict prefix reaches the leaves of a FrozenDict-like mapping and of
  None entries; a name the params lack, or a leaf the prefix misses, raises (nothing dropped)."""
  grads, weights = rule_data()
  params = {"m": jnp.zeros(3), "l": jnp.zeros(2), "s": jnp.zeros(2)}
  tx = optax_accum.accumulate(
    optax.sgd(1.0),
    every_k=4,
    aggregate=optax_accum.aggregate(reduce={"m": "max", "l": "mean", "s": "mean"}),
  )
  new, _, _ = run(tx, grads, weights, params)
  seen = [g for g, w in zip(grads, weights, strict=True) if w]
  np.testing.assert_array_equal(new["m"], np.max([g["m"] for g in seen], 0).astype(np.float32))
  for prefix in ({"m": "max", "l": "mean", "s": "mean", "x": "max"}, {"m": {"a": "max"}}):
    bad = optax_accum.accumulate(
      optax.sgd(1.0), every_k=4, aggregate=optax_accum.aggregate(reduce=prefix)
    )
    with pytest.raises(ValueError, match="reduce= must be a rule or a tree prefix"):
      bad.init(params)
  nested = {"a": {"m": jnp.zeros(3)}, "n": None, "s": [jnp.zeros(2)]}
  agg = optax_accum.aggregate(reduce={"a": "max", "s": ["sum"]})
  assert agg.rules(nested) == ("max", "sum")  # the leaves a.m and s[0]; n is None
  optax_accum.accumulate(optax.sgd(1.0), every_k=2, aggregate=agg).init(nested)


def test_wrong_gradient_trees_and_jitted_states_of_another_rule_get_clear_errors():
  params = {"m": jnp.zeros(3), "l": jnp.zeros(2), "s": jnp.zeros(2)}
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=4, aggregate=optax_accum.aggregate(denominator=8)
  )
  listed = {k: [v, v] for k, v in params.items()}
  with pytest.raises(ValueError, match="The gradient tree does not match"):
    tx.update(listed, tx.init(params), params)
  # Under jit too: an overwriting rule masks the inner optimizer, whose state then differs.
  maxed = optax_accum.accumulate(
    optax.sgd(1.0),
    every_k=4,
    aggregate=optax_accum.aggregate(reduce={"m": "max", "l": "mean", "s": "mean"}),
  )
  step = jax.jit(lambda s: maxed.update(params, s, params))
  with pytest.raises(ValueError, match="inner state's structure is not this configuration's"):
    step(tx.init(params))


def test_a_restored_state_resumes_bitwise_and_the_rules_live_in_the_closure():
  params = {"m": jnp.zeros(3), "l": jnp.zeros(2), "s": jnp.zeros(2)}
  grads, weights = rule_data()
  saved = optax_accum.accumulate(
    optax.sgd(1.0), every_k=4, aggregate=optax_accum.aggregate(denominator=8)
  )
  _, state, _ = run(saved, grads[:2], weights[:2], params)  # mid-window
  restored = jax.tree.map(np.asarray, state)
  # The denominator is configuration (issue 48): a state holds the same leaves under any.
  other = optax_accum.accumulate(
    optax.sgd(1.0), every_k=4, aggregate=optax_accum.aggregate(denominator=16)
  )
  optax_accum.sharding.check_compatible(other, params, restored)
  # The same configuration resumes and ends where an uninterrupted run does.
  state = optax_accum.sharding.check_compatible(saved, params, restored)
  p1, s1 = params, state
  for g, w in zip(grads[2:], weights[2:], strict=True):
    p1, s1 = optax_accum.update_and_apply(saved, g, s1, p1, weight=w)
  p2, _, _ = run(saved, grads, weights, params)
  jax.tree.map(np.testing.assert_array_equal, p1, p2)


# ------------------------------------------------------------------ under axis_name


def test_rules_under_shard_map_equal_one_device_and_count_collectives():
  """8 devices, each its own microbatches: max/last exact, one pmax then one psum per window."""
  d, k = 8, 2
  mesh = _compat.make_mesh((d,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rules = {"m": "max", "l": "last", "s": "sum", "w": "mean"}
  params = {"m": jnp.zeros(2), "l": jnp.zeros(2), "s": jnp.zeros(2), "w": jnp.zeros(2)}
  tx = optax_accum.accumulate(
    optax.sgd(1.0),
    every_k=k,
    axis_name="data",
    aggregate=optax_accum.aggregate(reduce=rules, denominator=32),
  )
  opt_state = optax_accum.sharding.stack_windows(tx.init(params), mesh, "data")
  specs = optax_accum.sharding.window_specs(opt_state, "data")

  def body(params, opt_state, grads, weight):
    opt_state = optax_accum.sharding.local_state(opt_state)
    g = jax.tree.map(lambda x: x[0], grads)
    new, opt_state = optax_accum.update_and_apply(tx, g, opt_state, params, weight=weight[0])
    return new, optax_accum.sharding.stacked_state(opt_state)

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                               out_specs=(P(), specs), check_vma=False))  # fmt: skip
  grads = [{n: RNG.normal(size=(d, 2)).astype(np.float32) for n in params} for _ in range(k)]
  weights = [RNG.integers(0, 4, size=d).astype(np.float32) for _ in range(k)]
  weights[1][d - 1] = 0  # the last device's last microbatch has no weight
  new = params
  for g, w in zip(grads, weights, strict=True):
    new, opt_state = step(new, opt_state, g, w)
  # One device: the microbatches in the order (step, device); 'last' = the last with weight
  # on the highest device index that had any (devices run side by side).
  flat = [({n: g[n][i] for n in g}, w[i]) for g, w in zip(grads, weights, strict=True)
          for i in range(d)]  # fmt: skip
  seen = [(g, w) for g, w in flat if w]
  np.testing.assert_array_equal(new["m"], np.max([g["m"] for g, _ in seen], 0))
  last_device = max(i for i in range(d) if any(w[i] for w in weights))
  last = [g[n][last_device] for g, w in zip(grads, weights, strict=True) if w[last_device]
          for n in ("l",)][-1]  # fmt: skip
  np.testing.assert_array_equal(new["l"], last)
  wsum = lambda n: sum(w * g[n] for g, w in flat)
  np.testing.assert_allclose(new["s"], -wsum("s"), rtol=1e-5)
  np.testing.assert_allclose(new["w"], -wsum("w") / 32, rtol=1e-5)
  text = step.lower(params, opt_state, grads[0], weights[0]).compile().as_text()
  counts = count_collectives(text)
  assert counts["outside"] == {}, counts
  assert counts["in_conditional"] == {
    # the pmax (max leaf, device index), then one psum: the summed leaves, the window's
    # scalars and the max leaf's non-finite count (issue 46)
    "all-reduce": _compat.all_reduces_per_psum(2) + _compat.all_reduces_per_psum(7)
  }, counts


# ------------------------------------------------------------------ in-step


def masked_loss(params, batch):  # the summed loss over unmasked rows, divided by N later
  err = (batch["x"] @ params["w"] - batch["y"]) ** 2
  return (err * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1)


def test_in_step_denominator_equals_jax_grad_of_the_sum_over_n():
  rng = np.random.default_rng(1)
  batch = {"x": rng.normal(size=(16, 3)).astype(np.float32),
           "y": rng.normal(size=16).astype(np.float32),
           "mask": (rng.random(16) < 0.6).astype(np.float32)}  # fmt: skip
  params = {"w": jnp.array([0.1, -0.2, 0.3])}
  f = optax_accum.microbatched_value_and_grad(
    masked_loss,
    4,
    weight_fn=lambda mb: mb["mask"].sum(),
    aggregate=optax_accum.aggregate(denominator=20.0),
  )
  loss, grads = jax.jit(f)(params, batch)
  summed = lambda p, b: ((b["x"] @ p["w"] - b["y"]) ** 2 * b["mask"]).sum() / 20.0
  ref_loss, ref_grads = jax.value_and_grad(summed)(params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5)
  with pytest.raises(TypeError, match="not a schedule"):
    optax_accum.microbatched_value_and_grad(
      masked_loss, 4, aggregate=optax_accum.aggregate(denominator=lambda n: 2.0)
    )


def test_in_step_max_equals_the_across_step_rule():
  """A leaf whose 'gradient' is a new value (stop_gradient of the microbatch's max |x|)."""
  rng = np.random.default_rng(2)
  batch = {"x": rng.normal(size=(8, 3)).astype(np.float32),
           "y": rng.normal(size=8).astype(np.float32),
           "mask": np.array([1, 1, 0, 0, 1, 0, 1, 1], np.float32)}  # fmt: skip

  def loss(params, mb):
    return masked_loss(params, mb) + params["amax"] * jax.lax.stop_gradient(jnp.abs(mb["x"]).max())

  params = {"w": jnp.zeros(3), "amax": jnp.zeros(())}
  f = optax_accum.microbatched_value_and_grad(
    loss,
    4,
    weight_fn=lambda mb: mb["mask"].sum(),
    strided=False,
    aggregate=optax_accum.aggregate(reduce={"w": "mean", "amax": "max"}),
  )
  _, grads = jax.jit(f)(params, batch)
  rows = [batch["x"][2 * i : 2 * i + 2] for i in range(4)]
  seen = [
    np.abs(r).max() for r, m in zip(rows, batch["mask"].reshape(4, 2).sum(1), strict=True) if m
  ]
  assert float(grads["amax"]) == max(seen)
  # across-step with the same rules gives the same window value for both leaves
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=4, aggregate=optax_accum.aggregate(reduce={"w": "mean", "amax": "max"})
  )
  mbs = [jax.tree.map(lambda x, i=i: x[2 * i : 2 * i + 2], batch) for i in range(4)]
  ws = [float(mb["mask"].sum()) for mb in mbs]
  new, _, _ = run(tx, [jax.grad(loss)(params, mb) for mb in mbs], ws, params)
  assert float(new["amax"]) == float(grads["amax"])
  np.testing.assert_allclose(new["w"], -grads["w"], rtol=1e-6)
