"""Tests of optax_accum/_state.py and _metrics.py: finding the state, metrics, discard."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite

import optax_accum
from optax_accum._state import find_state

COUNTER_MAX = np.iinfo(np.int32).max

PARAMS = {"theta": jnp.zeros(3), "b": jnp.zeros(())}
GRADS = {"theta": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}


def _acc(**kw):
  return optax_accum.accumulate(
    optax.sgd(1.0), every_k=3, loss_scale=optax_accum.static_loss_scale(128.0), **kw
  )


WRAPPERS = {
  "bare": lambda: _acc(),
  "chain": lambda: optax.chain(optax.identity(), _acc(), optax.scale(1.0)),
  "masked": lambda: optax.masked(_acc(), {"theta": True, "b": False}),
  "multi_transform": lambda: optax.multi_transform(
    {"a": _acc(), "b": optax.sgd(0.1)}, {"theta": "a", "b": "b"}
  ),
  "inject_hyperparams": lambda: optax.inject_hyperparams(
    lambda learning_rate: optax_accum.accumulate(
      optax.sgd(learning_rate), every_k=3, loss_scale=optax_accum.static_loss_scale(128.0)
    )
  )(learning_rate=1.0),
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_helpers_find_the_state_through_wrappers(wrapper):
  tx = WRAPPERS[wrapper]()
  state = tx.init(PARAMS)
  step = jax.jit(lambda g, s, p, w: tx.update(g, s, p, weight=w))
  _, state = step(GRADS, state, PARAMS, 5.0)
  _, state = step(GRADS, state, PARAMS, 2.0)
  m = jax.jit(optax_accum.metrics)(state)
  assert int(m.mini_step) == 2 and int(m.num_microbatches) == 2
  assert float(m.pending_weight) == 7.0 and int(m.num_updates) == 0
  assert not bool(m.updated) and not bool(m.has_grad_norm) and not bool(m.has_window_loss)
  assert float(m.grad_norm) == 0.0 and float(m.window_loss) == 0.0  # "no value yet": flags
  assert float(optax_accum.metrics(state).loss_scale) == 128.0
  assert isinstance(find_state(state), optax_accum.AccumulationState)
  # discard empties only the open window.
  before = find_state(state)
  state = jax.jit(optax_accum.discard)(state)
  after = find_state(state)
  assert int(after.mini_step) == 0 and float(after.window.weight_sum) == 0.0
  for leaf in jax.tree.leaves(after.window.grad_sum):
    assert np.all(np.asarray(leaf) == 0)
  chex.assert_trees_all_equal(after.inner_state, before.inner_state)
  assert int(after.num_microbatches) == 2 and float(after.loss_scale.scale) == 128.0
  # The next window holds only its own microbatches: a weight-1 window of 128 * GRADS.
  scaled = jax.tree.map(lambda g: 128.0 * g, GRADS)
  for _ in range(3):
    u, state = step(scaled, state, PARAMS, 1.0)
  assert int(optax_accum.metrics(state).num_updates) == 1
  np.testing.assert_allclose(u["theta"], -GRADS["theta"], rtol=1e-6)


def _nnx_setup(tx):
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):
    def __init__(self):
      self.theta = nnx.Param(jnp.zeros(3))
      self.b = nnx.Param(jnp.zeros(()))

  model = Model()
  with pytest.warns(optax_accum.pitfalls.PitfallWarning, match="adds 1 to `step`"):
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss(model):
    return jnp.sum(GRADS["theta"] * model.theta) + GRADS["b"] * model.b

  grads = nnx.grad(loss)(model)
  return nnx, model, opt, grads


@pytest.mark.parametrize("wrapper", ["bare", "chain"])
def test_helpers_through_nnx_optimizer(wrapper):
  nnx, model, opt, grads = _nnx_setup(WRAPPERS[wrapper]())

  @nnx.jit
  def step(model, opt, grads, weight):
    opt.update(model, grads, weight=weight)

  step(model, opt, grads, 5.0)
  step(model, opt, grads, 2.0)
  m = optax_accum.metrics(opt.opt_state)
  assert int(m.mini_step) == 2 and float(m.pending_weight) == 7.0
  assert isinstance(m.mini_step, jax.Array)  # unwrapped from OptArray
  assert float(optax_accum.metrics(opt.opt_state).loss_scale) == 128.0
  s = find_state(opt.opt_state)
  assert float(s.window.weight_sum) == 7.0
  for leaf in jax.tree.leaves(s):
    assert isinstance(leaf, jax.Array)


def test_discard_through_nnx_optimizer_keeps_structure():
  _, model, opt, grads = _nnx_setup(_acc())
  opt.update(model, grads, weight=5.0)
  discarded = optax_accum.discard(opt.opt_state)
  assert jax.tree.structure(discarded) == jax.tree.structure(opt.opt_state)
  opt.opt_state = discarded
  opt.update(model, grads, weight=2.0)
  m = optax_accum.metrics(opt.opt_state)
  assert int(m.mini_step) == 1 and float(m.pending_weight) == 2.0


def test_no_or_two_accumulation_states_raise():
  with pytest.raises(ValueError, match="Found no optax_accum AccumulationState"):
    optax_accum.metrics(optax.adam(0.1).init(PARAMS))
  two = optax.chain(_acc(), _acc()).init(PARAMS)
  with pytest.raises(ValueError, match="Found 2 .*Pass the state of a transformation"):
    _ = optax_accum.metrics(two).loss_scale
  with pytest.raises(ValueError, match="expected exactly one"):
    find_state(two)
  # discard resets every state found, without complaint.
  d = optax_accum.discard(two)
  assert [int(s.mini_step) for s in d if isinstance(s, optax_accum.AccumulationState)] == [0, 0]


@pytest.mark.parametrize("nonfinite", [False, True], ids=["applied", "skipped"])
def test_counters_saturate_instead_of_wrapping(nonfinite):
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  top = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
  assert int(top) == COUNTER_MAX
  state = tx.init(PARAMS)._replace(num_updates=top, num_microbatches=top, num_skipped=top)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  g = jax.tree.map(lambda x: x * jnp.nan, GRADS) if nonfinite else GRADS
  u, state = step(g, state, PARAMS)
  u, state = step(GRADS, state, PARAMS)
  for name in ("num_updates", "num_microbatches", "num_skipped"):
    assert int(getattr(state, name)) == COUNTER_MAX, name
  assert bool(state.updated) == (not nonfinite)
  # The window itself is still processed normally.
  if not nonfinite:
    np.testing.assert_allclose(u["theta"], -GRADS["theta"], rtol=1e-6)


@pytest.fixture
def debug_nans_and_infs():
  """jax_debug_nans and jax_debug_infs on for the test, restored afterwards."""
  old = (jax.config.jax_debug_nans, jax.config.jax_debug_infs)
  jax.config.update("jax_debug_nans", True)
  jax.config.update("jax_debug_infs", True)
  yield
  jax.config.update("jax_debug_nans", old[0])
  jax.config.update("jax_debug_infs", old[1])


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_training_runs_under_debug_nans_and_infs(debug_nans_and_infs, jitted):
  """Issue 11, item 1: no NaN/Inf sentinel in the state, so the debug flags never trip.

  On the old state `tx.init` itself raised FloatingPointError (window_loss and
  grad_norm started as NaN). Two applied windows, a skipped window (its fp16 mean
  overflows: finite gradients, no NaN fed in), an empty flush, a partial flush, a
  discard and metrics, jitted and not. Expected values by hand: an SGD(1) step is
  minus the weighted window mean.
  """
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=2, loss_scale=optax_accum.static_loss_scale(2.0**-10)
  )
  params = {"w": jnp.zeros(2, jnp.float16)}
  update = jax.jit(tx.update) if jitted else tx.update
  flush = jax.jit(optax_accum.flush, static_argnums=0) if jitted else optax_accum.flush
  state = tx.init(params)
  assert_state_finite(state)
  m = optax_accum.metrics(state)
  assert not bool(m.has_grad_norm) and not bool(m.has_window_loss)

  def feed(g, w, loss):
    nonlocal state
    scaled = jnp.full(2, g * 2.0**-10, jnp.float16)  # gradient of loss * scale
    u, state = update({"w": scaled}, state, params, weight=w, value=jnp.float32(loss))
    assert_state_finite(state)
    return np.asarray(u["w"], np.float64)

  # Window 1: weights 1 and 3, gradients 1 and 2, losses 4 and 8: mean 1.75, loss 7.
  feed(1.0, 1.0, 4.0)
  np.testing.assert_array_equal(feed(2.0, 3.0, 8.0), [-1.75, -1.75])
  m = optax_accum.metrics(state)
  assert bool(m.has_grad_norm) and bool(m.has_window_loss) and float(m.window_loss) == 7.0
  np.testing.assert_allclose(m.grad_norm, 1.75 * np.sqrt(2), rtol=1e-6)
  # Window 2 is skipped: its mean 7e4 does not fit fp16 (max 65504).
  feed(7e4, 1.0, 1.0)
  np.testing.assert_array_equal(feed(7e4, 1.0, 1.0), [0.0, 0.0])
  m = optax_accum.metrics(state)
  assert int(m.num_skipped) == 1 and int(m.num_updates) == 1
  assert bool(m.has_grad_norm)  # the norm itself is finite in float32: logged
  np.testing.assert_allclose(m.grad_norm, 7e4 * np.sqrt(2), rtol=1e-3)
  # Window 3: one microbatch, then a flush (mean of what is there: 3).
  feed(3.0, 2.0, 5.0)
  u, state = flush(tx, state, params)
  assert_state_finite(state)
  np.testing.assert_array_equal(np.asarray(u["w"]), [-3.0, -3.0])
  assert float(optax_accum.metrics(state).window_loss) == 5.0
  u, state = flush(tx, state, params)  # an empty flush: nothing happens
  assert_state_finite(state)
  np.testing.assert_array_equal(np.asarray(u["w"]), [0.0, 0.0])
  feed(1.0, 1.0, 1.0)
  state = optax_accum.discard(state)
  assert_state_finite(state)
  m = optax_accum.metrics(state)
  assert (int(m.num_updates), int(m.num_skipped), int(m.num_microbatches)) == (2, 1, 6)


def test_state_is_finite_again_after_a_skipped_window():
  """Issue 11, item 1: a NaN/Inf window leaves no NaN/Inf behind (it wrote them into grad_norm).

  has_grad_norm says the skipped window has no norm; grad_norm keeps the last finite
  one (|(1, 1)|, by hand); the next window's norm is recorded again.
  """
  tx = optax_accum.accumulate(optax.adam(0.1), every_k=1)
  params = {"w": jnp.zeros(2)}
  step = jax.jit(tx.update)
  _, state = step({"w": jnp.ones(2)}, tx.init(params), params)
  for bad in (jnp.inf, jnp.nan):
    _, state = step({"w": jnp.array([1.0, bad])}, state, params)
    assert_state_finite(state)
    m = optax_accum.metrics(state)
    assert not bool(m.has_grad_norm) and not bool(m.updated)
    np.testing.assert_allclose(m.grad_norm, np.sqrt(2.0), rtol=1e-6)
  _, state = step({"w": jnp.array([3.0, 4.0])}, state, params)
  m = optax_accum.metrics(state)
  assert bool(m.has_grad_norm) and float(m.grad_norm) == 5.0 and int(m.num_skipped) == 2
  assert_state_finite(state)


def test_window_loss_flag_with_a_nan_loss():
  """Issue 11, item 1: a NaN mean loss clears has_window_loss and keeps the last finite loss."""
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=1)
  params = {"w": jnp.zeros(2)}
  _, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params, value=2.5)
  assert bool(optax_accum.metrics(state).has_window_loss)
  _, state = tx.update({"w": jnp.ones(2)}, state, params, value=jnp.nan)
  m = optax_accum.metrics(state)
  assert not bool(m.has_window_loss) and float(m.window_loss) == 2.5
  assert_state_finite(state)


def test_flush_refuses_a_state_of_another_transformation():
  """Issue 11, item 7: flush(tx, state) with a tx and state that do not belong together."""
  params = {"w": jnp.zeros(2)}
  state = optax_accum.accumulate(optax.adam(0.1), every_k=2).init(params)
  for tx in (
    optax_accum.accumulate(optax.sgd(0.1), every_k=2),  # another inner optimizer
    optax.chain(optax.clip(1.0), optax_accum.accumulate(optax.adam(0.1), every_k=2)),
  ):
    with pytest.raises(ValueError, match=r"flush\(tx, state, params\): state is not a state of tx"):
      optax_accum.flush(tx, state, params)
  with pytest.raises(ValueError, match="not a state of tx"):  # params of other shapes
    optax_accum.flush(
      optax_accum.accumulate(optax.adam(0.1), every_k=2), state, {"w": jnp.zeros(3)}
    )
