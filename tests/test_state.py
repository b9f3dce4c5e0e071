"""Tests of optax_accum/_state.py: finding the state, metrics, loss scale, discard, counters."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

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
  assert not bool(m.updated) and np.isnan(m.grad_norm) and np.isnan(m.window_loss)
  assert float(optax_accum.get_loss_scale(state)) == 128.0
  assert isinstance(find_state(state), optax_accum.AccumulationState)
  # discard empties only the open window.
  before = find_state(state)
  state = jax.jit(optax_accum.discard)(state)
  after = find_state(state)
  assert int(after.mini_step) == 0 and float(after.weight_sum) == 0.0
  for leaf in jax.tree.leaves(after.acc):
    assert np.all(np.asarray(leaf) == 0)
  chex.assert_trees_all_equal(after.inner_state, before.inner_state)
  assert int(after.num_microbatches) == 2 and float(after.loss_scale) == 128.0
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
  assert float(optax_accum.get_loss_scale(opt.opt_state)) == 128.0
  s = find_state(opt.opt_state)
  assert float(s.weight_sum) == 7.0
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
    optax_accum.get_loss_scale(two)
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
