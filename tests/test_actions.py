"""Tests of optax_accum/_actions.py: update_and_apply, the recommended (donated) train step.

The fused path (accumulate's own transformation) and the fallback (any other
tx) against tx.update + optax.apply_updates and against one physical batch.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum._accumulate import Accumulation

# M2 of the reference cases: linear regression, 26 examples in microbatches of 8, 8, 8, 2.
_RNG = np.random.default_rng(0)
_X = _RNG.normal(size=(26, 3)).astype(np.float32)
_Y = _RNG.normal(size=(26,)).astype(np.float32)
_SPLITS = [(0, 8), (8, 16), (16, 24), (24, 26)]


def _loss(params, x, y):
  return 0.5 * jnp.mean((x @ params["theta"] + params["b"] - y) ** 2)


def _params():
  return {"theta": jnp.array([0.1, -0.2, 0.3]), "b": jnp.array(0.05)}


def _fresh(tree):
  return jax.tree.map(lambda x: jnp.array(np.asarray(x)), tree)


def _donated_step(tx):
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, x, y, weight):
    grads = jax.grad(_loss)(params, x, y)
    return optax_accum.update_and_apply(tx, grads, state, params, weight=weight)

  return step


@pytest.mark.parametrize(
  "inner", [optax.sgd(1.0), optax.adamw(1e-2, weight_decay=1e-2)], ids=["sgd", "adamw"]
)
def test_window_equals_physical_batch(inner):
  """C2 through the donated, fused step: two windows equal two full-batch steps."""
  tx = optax_accum.accumulate(inner, every_k=4)
  step = _donated_step(tx)
  params = _fresh(_params())
  state = tx.init(params)
  ref_params, ref_state = _params(), inner.init(_params())
  for _ in range(2):
    before = jax.tree.map(np.asarray, params)  # params are donated: keep a host copy
    for i, (a, b) in enumerate(_SPLITS):
      params, state = step(params, state, _X[a:b], _Y[a:b], b - a)
      if i < 3:  # between boundaries the params are untouched
        chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), before)
    grads = jax.grad(_loss)(ref_params, _X, _Y)
    updates, ref_state = inner.update(grads, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)
  assert int(optax_accum.metrics(state).num_updates) == 2


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_matches_apply_updates_through_chain_and_flush():
  """Inside optax.chain (clip before accumulate) and with a flush, same as apply_updates."""
  tx = optax.chain(optax.clip(10.0), optax_accum.accumulate(optax.sgd(0.5), every_k=3))
  params_a = params_b = _params()
  state_a = state_b = tx.init(params_a)
  update = jax.jit(tx.update)
  fused = jax.jit(functools.partial(optax_accum.update_and_apply, tx))
  for a, b in _SPLITS:  # 3 make a window, the 4th stays open until the flush
    grads = jax.grad(_loss)(params_a, _X[a:b], _Y[a:b])
    params_a, state_a = fused(grads, state_a, params_a, weight=b - a)
    grads = jax.grad(_loss)(params_b, _X[a:b], _Y[a:b])
    u, state_b = update(grads, state_b, params_b, weight=b - a)
    params_b = optax.apply_updates(params_b, u)
  u, state_a = optax_accum.flush(tx, state_a, params_a)
  params_a = optax.apply_updates(params_a, u)
  assert bool(optax_accum.metrics(state_a).updated)
  # Reference: the flushed window holds only the last microbatch (weight 2), so the
  # update is -0.5 * its mean gradient at the params after the first window.
  grads = jax.grad(_loss)(params_b, _X[24:26], _Y[24:26])
  params_b = jax.tree.map(lambda p, g: p - 0.5 * g, params_b, grads)
  chex.assert_trees_all_close(params_a, params_b, rtol=1e-6)


@pytest.mark.slow
def test_update_and_apply_equals_update_then_apply():
  """The fused path (params through accumulate's cond) against tx.update + apply_updates."""
  inner = optax.adamw(1e-2, weight_decay=1e-2)
  tx = optax_accum.accumulate(optax.chain(optax.clip_by_global_norm(0.5), inner), every_k=3)
  params_a = _fresh(_params())
  state_a = tx.init(params_a)
  params_b, state_b = _params(), tx.init(_params())

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def fused(params, state, x, y, weight):
    grads = jax.grad(_loss)(params, x, y)
    return optax_accum.update_and_apply(tx, grads, state, params, weight=weight)

  for _ in range(2):
    for a, b in _SPLITS:
      params_a, state_a = fused(params_a, state_a, _X[a:b], _Y[a:b], b - a)
      grads = jax.grad(_loss)(params_b, _X[a:b], _Y[a:b])
      u, state_b = tx.update(grads, state_b, params_b, weight=b - a)
      params_b = optax.apply_updates(params_b, u)
  assert int(optax_accum.metrics(state_a).num_updates) == 2
  chex.assert_trees_all_close(params_a, params_b, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(state_a, state_b, rtol=1e-6, atol=1e-7)


def test_update_and_apply_falls_back_for_chains():
  tx = optax.chain(optax.clip(1.0), optax_accum.accumulate(optax.sgd(1.0), every_k=2))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for g in (jnp.array([0.5, -0.5]), jnp.array([0.25, 0.75])):
    params, state = jax.jit(optax_accum.update_and_apply, static_argnums=0)(
      tx, {"w": g}, state, params
    )
  chex.assert_trees_all_close(params, {"w": jnp.array([-0.375, -0.125])})


def test_under_vmap_over_states():
  """vmap turns the cond into a select: still exact, per replica."""
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  params = {"w": jnp.zeros((3, 2))}  # 3 independent replicas
  state = jax.vmap(tx.init)(params)
  grads = [{"w": jnp.full((3, 2), 1.0)}, {"w": jnp.full((3, 2), 3.0)}]

  @jax.jit
  def step(params, state, g):
    fused = functools.partial(optax_accum.update_and_apply, tx)
    return jax.vmap(lambda g, s, p: fused(g, s, p))(g, state, params)

  params, state = step(params, state, grads[0])
  chex.assert_trees_all_equal(params, {"w": jnp.zeros((3, 2))})
  params, state = step(params, state, grads[1])
  chex.assert_trees_all_close(params, {"w": jnp.full((3, 2), -2.0)})


def _halving_wrapper(tx):
  """A user transformation whose update calls accumulate's and halves its updates."""

  def update(grads, state, params=None, **extra_args):
    updates, state = tx.update(grads, state, params, **extra_args)
    return jax.tree.map(lambda u: 0.5 * u, updates), state

  return optax.GradientTransformationExtraArgs(tx.init, update)


@pytest.mark.parametrize(
  "make",
  [
    _halving_wrapper,
    lambda acc: optax.chain(acc, optax.scale(0.5)),
  ],
  ids=["wrapper", "chain_scale_after"],
)
def test_members_after_accumulate_change_the_updates_on_both_paths(make):
  """sgd(1.0), every_k=2, params 1.0, grads 1.0: the window's update -1.0, halved: 0.5.

  The fused path must not silently differ (it once halved the new *params*: -0.25).
  """
  tx = make(optax_accum.accumulate(optax.sgd(1.0), every_k=2))
  params = {"w": jnp.ones(())}
  state_a = state_b = tx.init(params)
  params_a = params_b = params
  for _ in range(2):
    params_a, state_a = optax_accum.update_and_apply(tx, {"w": jnp.ones(())}, state_a, params_a)
    u, state_b = tx.update({"w": jnp.ones(())}, state_b, params_b)
    params_b = optax.apply_updates(params_b, u)
  assert float(params_a["w"]) == float(params_b["w"]) == 0.5


def test_fused_path_only_for_accumulates_own_transformation():
  acc = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  assert isinstance(acc, Accumulation) and callable(acc.update_and_apply)
  assert isinstance(acc, optax.GradientTransformationExtraArgs)
  for other in (optax.chain(acc), _halving_wrapper(acc), optax.sgd(1.0)):
    assert not isinstance(other, Accumulation)
    assert not hasattr(other, "update_and_apply")


def test_copies_keep_the_fused_step_and_replace_drops_it():
  """copy/deepcopy give an Accumulation whose fused step still equals update + apply_updates;
  _replace (a new init or update) gives a plain transformation, so nothing can disagree."""
  import copy

  acc = optax_accum.accumulate(optax.sgd(1.0), every_k=1)
  params, g = {"w": jnp.ones(2)}, {"w": jnp.array([0.5, 2.0])}
  for tx in (copy.copy(acc), copy.deepcopy(acc)):
    assert isinstance(tx, Accumulation)
    new, _ = optax_accum.update_and_apply(tx, g, tx.init(params), params)
    chex.assert_trees_all_equal(new, {"w": jnp.array([0.5, -1.0])})  # 1 - g
  replaced = acc._replace(update=acc.update)
  assert type(replaced) is optax.GradientTransformationExtraArgs
  with pytest.raises(TypeError, match="not accumulate's own"):
    _ = Accumulation(acc.init, optax.sgd(1.0).update).update_and_apply


def test_plain_optimizer_through_update_and_apply():
  """Any tx works: update_and_apply is then exactly tx.update + optax.apply_updates."""
  tx = optax.adam(0.1)
  params = {"w": jnp.array([1.0, -2.0])}
  g = {"w": jnp.array([0.5, 0.25])}
  new, _ = optax_accum.update_and_apply(tx, g, tx.init(params), params)
  u, _ = tx.update(g, tx.init(params), params)
  chex.assert_trees_all_equal(new, optax.apply_updates(params, u))


def test_fused_path_needs_params():
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  with pytest.raises(ValueError, match="needs the params"):
    optax_accum.update_and_apply(tx, {"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}), None)
