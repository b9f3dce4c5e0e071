"""Each README pitfall warns with its fix; the recommended placement stays silent.

The pitfall tests also show the pitfall changes the result (computed by hand or
with the recommended placement), which is why it deserves a warning.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum.pitfalls import PitfallWarning

PARAMS = {"w": jnp.zeros(2)}
GRADS = [{"w": jnp.array([3.0, 0.0])}, {"w": jnp.array([0.0, 4.0])}]
SCHEDULE = optax.linear_schedule(1.0, 0.0, transition_steps=4)


def _clipped(c, inner):
  return optax.chain(optax.clip_by_global_norm(c), inner)


def _run(tx, grads=GRADS, params=PARAMS):
  """Applies ``grads`` one microbatch per call with update_and_apply; returns (params, state)."""
  state = tx.init(params)
  for g in grads:
    params, state = optax_accum.update_and_apply(tx, g, state, params)
  return params, state


def _silent(fn, *args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    return fn(*args, **kwargs)


def test_clip_before_accumulate_clips_each_microbatch():
  # Documented (README, Pitfalls), not detected: the clip's state is an EmptyState like
  # many transformations'.
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax_accum.accumulate(optax.sgd(1.0), 2))
  params, _ = _run(tx)
  # Each microbatch clipped to norm 1, then averaged: -(1, 0) / 2 - (0, 1) / 2.
  np.testing.assert_allclose(params["w"], [-0.5, -0.5])


def test_clip_in_accumulate_or_after_it_is_silent():
  params, _ = _silent(_run, optax_accum.accumulate(_clipped(1.0, optax.sgd(1.0)), 2))
  # The window mean (1.5, 2) has norm 2.5: clipped to (0.6, 0.8), as the README says.
  np.testing.assert_allclose(params["w"], [-0.6, -0.8], rtol=1e-6)
  inner_clip = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  params, _ = _silent(_run, optax_accum.accumulate(inner_clip, 2))
  np.testing.assert_allclose(params["w"], [-0.6, -0.8], rtol=1e-6)
  after = optax.chain(optax_accum.accumulate(optax.sgd(1.0), 2), optax.clip_by_global_norm(1.0))
  _silent(_run, after)  # clipping the updates is a choice, not a pitfall


@pytest.mark.parametrize("where", ["after", "before"])
def test_schedule_outside_accumulate_warns_and_counts_microbatches(where):
  acc = optax_accum.accumulate(optax.sgd(1.0), 2)
  sched = optax.scale_by_schedule(SCHEDULE)
  tx = optax.chain(acc, sched) if where == "after" else optax.chain(sched, acc)
  with pytest.warns(PitfallWarning, match="outside accumulate counts calls"):
    _, state = _run(tx, GRADS * 2)
  assert int(state[1 if where == "after" else 0].count) == 4  # 4 microbatches, 2 updates


def test_schedule_inside_accumulate_is_silent_and_counts_updates():
  inner = optax.chain(optax.sgd(1.0), optax.scale_by_schedule(SCHEDULE))
  params, state = _silent(_run, optax_accum.accumulate(inner, 2), GRADS * 2)
  assert int(state.inner_state[1].count) == 2
  # Scales 1.0 then 0.75 (count 0, 1 of a 4-step linear decay) on the same mean (1.5, 2).
  np.testing.assert_allclose(params["w"], -1.75 * np.array([1.5, 2.0]), rtol=1e-6)
  adamw = optax_accum.accumulate(optax.adamw(SCHEDULE), 2)
  _silent(_run, adamw)


def _injected(learning_rate):
  return optax.inject_hyperparams(
    lambda learning_rate: optax_accum.accumulate(optax.sgd(learning_rate), every_k=4)
  )(learning_rate=learning_rate)


def test_inject_hyperparams_schedule_around_accumulate_warns_and_counts_microbatches():
  """Issue 22: the schedule advanced per microbatch (0.3, 0.7, 1.0 at the first updates)."""
  schedule = optax.linear_schedule(0.0, 1.0, transition_steps=10)
  tx = _injected(schedule)
  with pytest.warns(
    PitfallWarning, match="InjectStatefulHyperparamsState outside accumulate counts calls"
  ):
    _, state = _run(tx, GRADS * 2)
  assert int(state.count) == 4  # counted microbatches: 2 updates would be count 2
  # The learning rate of the next (third) microbatch is schedule(4), not schedule(1).
  np.testing.assert_allclose(float(state.hyperparams["learning_rate"]), schedule(3))
  with pytest.warns(
    PitfallWarning, match="InjectStatefulHyperparamsState outside accumulate counts calls"
  ):
    optax_accum.flush(tx, state, PARAMS)
  with pytest.warns(
    PitfallWarning, match="InjectStatefulHyperparamsState outside accumulate counts calls"
  ):
    optax_accum.discard(state)


def test_inject_hyperparams_constant_around_or_inside_accumulate_is_silent():
  _silent(_run, _injected(0.5))
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE)
  _silent(_run, optax_accum.accumulate(inner, 2), GRADS * 2)


def test_deprecated_inject_hyperparams_state_around_accumulate_warns_as_a_counter():
  """optax's deprecated InjectHyperparamsState (no hyperparams_states to tell a schedule by):
  its count advances per microbatch like any other counter's."""
  acc = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  state = optax.InjectHyperparamsState(
    count=jnp.zeros((), jnp.int32), hyperparams={}, inner_state=acc.init(PARAMS)
  )
  with pytest.warns(PitfallWarning, match="InjectHyperparamsState outside accumulate counts"):
    optax_accum.discard(state)


def test_apply_if_finite_around_accumulate_warns_and_shrinks_the_window():
  tx = optax.apply_if_finite(optax_accum.accumulate(optax.sgd(1.0), 2), max_consecutive_errors=5)
  grads = [GRADS[0], {"w": jnp.array([jnp.nan, 0.0])}, GRADS[1]]
  with pytest.warns(PitfallWarning, match="apply_if_finite around accumulate"):
    params, state = _run(tx, grads)
    assert int(optax_accum.metrics(state).num_skipped) == 0  # nothing was counted as skipped
  # The NaN microbatch was dropped and the window closed on the next one: mean of (3, 0), (0, 4).
  np.testing.assert_allclose(params["w"], [-1.5, -2.0])


def test_accumulate_alone_skips_the_non_finite_window_whole_and_is_silent():
  grads = [GRADS[0], {"w": jnp.array([jnp.nan, 0.0])}, GRADS[1], GRADS[1]]
  params, state = _silent(_run, optax_accum.accumulate(optax.sgd(1.0), 2), grads)
  np.testing.assert_allclose(params["w"], [0.0, -4.0])  # only the second window applied
  assert int(_silent(optax_accum.metrics, state).num_skipped) == 1


def test_nested_accumulate_warns_at_init_and_gives_the_mean_of_means():
  tx = optax_accum.accumulate(optax_accum.accumulate(optax.sgd(1.0), 2), 2)
  with pytest.warns(PitfallWarning, match="contains another accumulate"):
    params, _ = _run_weighted(tx)
  # Window means (3 * 1, 4 * 3) / 4 and (3 * 1, 4 * 1) / 2, averaged with equal weights.
  np.testing.assert_allclose(params["w"], -np.array([(0.75 + 1.5) / 2, (3.0 + 2.0) / 2]))
  flat, _ = _silent(_run_weighted, optax_accum.accumulate(optax.sgd(1.0), 4))
  np.testing.assert_allclose(flat["w"], -np.array([6.0, 16.0]) / 6, rtol=1e-6)  # token mean


def _run_weighted(tx, weights=(1, 3, 1, 1)):
  state, params = tx.init(PARAMS), PARAMS
  for g, w in zip(GRADS * 2, weights, strict=True):
    params, state = optax_accum.update_and_apply(tx, g, state, params, weight=w)
  return params, state


def test_multisteps_as_inner_optimizer_warns_at_init():
  tx = optax_accum.accumulate(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2), 2)
  with pytest.warns(PitfallWarning, match="inner optimizer is an optax.MultiSteps"):
    tx.init(PARAMS)
  _silent(optax_accum.accumulate(optax.sgd(1.0), 4).init, PARAMS)


def test_warns_once_per_call_site_and_once_per_trace():
  tx = optax.chain(optax_accum.accumulate(optax.sgd(1.0), 2), optax.scale_by_schedule(SCHEDULE))
  state = _silent(tx.init, PARAMS)
  _silent(optax_accum.metrics, state)  # a getter: it never warns
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")  # Python's default: once per location
    for _ in range(3):
      optax_accum.update_and_apply(tx, GRADS[0], state, PARAMS)
  assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller

  step = jax.jit(lambda s: optax_accum.update_and_apply(tx, GRADS[0], s, PARAMS)[0])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
      step(state)
  assert len(caught) == 1  # at trace time only


def test_flax_linen_train_state_warns_about_a_schedule_outside_accumulate():
  pytest.importorskip("flax")
  import optax_accum.flax

  tx = optax.chain(optax_accum.accumulate(optax.sgd(1.0), 2), optax.scale_by_schedule(SCHEDULE))
  state = optax_accum.flax.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
  with pytest.warns(PitfallWarning, match="outside accumulate counts calls"):
    state = state.apply_gradients(grads=GRADS[0])
  good = optax_accum.accumulate(_clipped(1.0, optax.sgd(1.0)), 2)
  state = optax_accum.flax.TrainState.create(apply_fn=None, params=PARAMS, tx=good)
  _silent(lambda: state.apply_gradients(grads=GRADS[0]))


def test_flax_nnx_optimizer_state_with_a_schedule_after_accumulate_warns():
  nnx = pytest.importorskip("flax.nnx")
  import optax_accum.flax

  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  tx = optax.chain(optax_accum.accumulate(optax.sgd(1.0), 2), optax.scale_by_schedule(SCHEDULE))
  with pytest.warns(PitfallWarning, match="adds 1 to `step` per microbatch"):
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  with pytest.warns(PitfallWarning, match="outside accumulate counts calls"):
    optax_accum._pitfalls.check_state(opt.opt_state, optax_accum.AccumulationState)
  assert int(_silent(optax_accum.metrics, opt.opt_state).num_updates) == 0  # a getter: silent
  grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
  fused = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
  with pytest.warns(PitfallWarning, match="outside accumulate counts calls"):
    fused.update(model, grads)
  inner = optax.chain(optax.sgd(1.0), optax.scale_by_schedule(SCHEDULE))
  opt = _silent(optax_accum.flax.Optimizer, model, optax_accum.accumulate(inner, 2), wrt=nnx.Param)
  _silent(optax_accum._pitfalls.check_state, opt.opt_state, optax_accum.AccumulationState)
  assert int(_silent(optax_accum.metrics, opt.opt_state).num_updates) == 0
  fused = optax_accum.flax.Optimizer(model, optax_accum.accumulate(inner, 2), wrt=nnx.Param)
  _silent(fused.update, model, grads)


def _add_noise():
  """optax.add_noise with a key (optax >= 0.2.6) or a seed (older): feature detection."""
  import inspect

  if "key" in inspect.signature(optax.add_noise).parameters:
    return optax.add_noise(0.01, 0.55, key=jax.random.key(0))
  return optax.add_noise(0.01, 0.55, seed=0)


@pytest.mark.parametrize(
  "outside",
  [_add_noise, optax.scale_by_adam, lambda: optax.ema(0.9)],
  ids=["add_noise", "adam", "ema"],
)
def test_any_step_counter_outside_accumulate_warns_by_kind(outside):
  """Issue 37, item 4: found through optax's public state types and their counters."""
  tx = optax.chain(optax_accum.accumulate(optax.sgd(0.1), 2), outside())
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  with pytest.warns(PitfallWarning, match=r"outside accumulate counts calls"):
    optax_accum.update_and_apply(tx, params, state, params)
  # Inside accumulate the same transformation counts windows: silent.
  inside = optax_accum.accumulate(optax.chain(optax.sgd(0.1), outside()), 2)
  _silent(optax_accum.update_and_apply, inside, params, inside.init(params), params)
