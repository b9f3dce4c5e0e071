"""apply_if_updated and the recommended (donated, gated) train step.

Also the fast paths of accumulate's boundary that the train step relies on:
the one-pass norm/finite check (against float64 NumPy), its exact fallback,
the fused clip (against optax.clip_by_global_norm), and the compiled HLO (no
parameter-sized copies, one gradient-sized temporary).
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

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
    updates, state = tx.update(grads, state, params, weight=weight)
    return optax_accum.apply_if_updated(params, updates, state), state

  return step


@pytest.mark.parametrize(
  "inner", [optax.sgd(1.0), optax.adamw(1e-2, weight_decay=1e-2)], ids=["sgd", "adamw"]
)
def test_window_equals_physical_batch(inner):
  """C2 through the donated, gated step: two windows equal two full-batch steps."""
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


def test_matches_apply_updates_through_chain_and_flush():
  """Inside optax.chain (clip before accumulate) and with a flush, same as apply_updates."""
  tx = optax.chain(optax.clip(10.0), optax_accum.accumulate(optax.sgd(0.5), every_k=3))
  params_a = params_b = _params()
  state_a = state_b = tx.init(params_a)
  update = jax.jit(tx.update)
  gated = jax.jit(optax_accum.apply_if_updated)
  for a, b in _SPLITS:  # 3 make a window, the 4th stays open until the flush
    grads = jax.grad(_loss)(params_a, _X[a:b], _Y[a:b])
    u, state_a = update(grads, state_a, params_a, weight=b - a)
    params_a = gated(params_a, u, state_a)
    grads = jax.grad(_loss)(params_b, _X[a:b], _Y[a:b])
    u, state_b = update(grads, state_b, params_b, weight=b - a)
    params_b = optax.apply_updates(params_b, u)
  u, state_a = optax_accum.flush(tx, state_a, params_a)
  params_a = gated(params_a, u, state_a)
  assert bool(optax_accum.metrics(state_a).updated)
  # Reference: the flushed window holds only the last microbatch (weight 2), so the
  # update is -0.5 * its mean gradient at the params after the first window.
  grads = jax.grad(_loss)(params_b, _X[24:26], _Y[24:26])
  params_b = jax.tree.map(lambda p, g: p - 0.5 * g, params_b, grads)
  chex.assert_trees_all_close(params_a, params_b, rtol=1e-6)


def test_update_and_apply_equals_update_then_apply():
  """The fused path (params through accumulate's cond) against tx.update + apply_updates."""
  inner = optax.adamw(1e-2, weight_decay=1e-2)
  tx = optax_accum.accumulate(inner, every_k=3, clip_norm=0.5)
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
    u, state = jax.vmap(tx.update)(g, state, params)
    return jax.vmap(optax_accum.apply_if_updated)(params, u, state), state

  params, state = step(params, state, grads[0])
  chex.assert_trees_all_equal(params, {"w": jnp.zeros((3, 2))})
  params, state = step(params, state, grads[1])
  chex.assert_trees_all_close(params, {"w": jnp.full((3, 2), -2.0)})


def test_needs_an_accumulation_state():
  with pytest.raises(ValueError, match="AccumulationState"):
    optax_accum.apply_if_updated({"w": jnp.zeros(2)}, {"w": jnp.zeros(2)}, optax.sgd(1.0).init({}))


def _one_window(grads_list, weights, **kwargs):
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=len(grads_list), **kwargs)
  params = {"a": jnp.zeros(4), "b": jnp.zeros((2, 3))}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g, w in zip(grads_list, weights, strict=True):
    u, state = update(g, state, params, weight=w)
  return u, optax_accum.metrics(state)


def _tree(a, b):
  return {"a": jnp.asarray(a, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


def test_norm_fast_path_matches_float64():
  g1 = _tree([1.0, -2.0, 3.0, 0.5], np.arange(6.0).reshape(2, 3))
  g2 = _tree([0.25, 2.0, -1.0, 4.0], -np.ones((2, 3)))
  u, m = _one_window([g1, g2], [3, 1])
  mean = [
    (3 * np.float64(x) + np.float64(y)) / 4
    for x, y in zip(*(jax.tree.leaves(t) for t in (g1, g2)), strict=True)
  ]
  expect = np.sqrt(sum(np.sum(x**2) for x in mean))
  np.testing.assert_allclose(float(m.grad_norm), expect, rtol=1e-6)
  assert bool(m.updated)
  chex.assert_trees_all_close(jax.tree.leaves(u), [-x for x in mean], rtol=1e-6)


def test_overflowing_sum_of_squares_is_still_finite():
  """Elements near 1e30 overflow sum(g**2) in float32 but the mean is finite: applied."""
  big = _tree([1e30, -2e30, 0.0, 1.0], np.full((2, 3), 3e30))
  u, m = _one_window([big], [1])
  assert bool(m.updated) and int(m.num_skipped) == 0
  expect = np.sqrt(sum(np.sum(np.float64(x) ** 2) for x in jax.tree.leaves(big)))
  np.testing.assert_allclose(float(m.grad_norm), expect, rtol=1e-5)
  chex.assert_trees_all_close(u, jax.tree.map(lambda x: -x, big), rtol=1e-6)


@pytest.mark.parametrize("bad, norm_is", [(np.inf, np.isinf), (np.nan, np.isnan)])
def test_non_finite_window_skipped(bad, norm_is):
  g = _tree([1.0, bad, 0.0, 1.0], np.ones((2, 3)))
  u, m = _one_window([g, _tree(np.ones(4), np.ones((2, 3)))], [1, 1])
  assert not bool(m.updated) and int(m.num_skipped) == 1
  assert norm_is(float(m.grad_norm))
  chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, u))


def test_mean_that_overflows_only_after_division_is_skipped():
  """A finite sum divided by a tiny weight sum overflows: exactly the old rule."""
  g = _tree(np.full(4, 1e30), np.ones((2, 3)))
  _, m = _one_window([g], [1e-10])  # weight 1e-10: mean = g (gradient of the mean loss)
  assert bool(m.updated)  # the weighted sum is 1e20, the mean 1e30: finite
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=1, loss_scale=optax_accum.static_loss_scale(1e-20)
  )
  params = {"a": jnp.zeros(4), "b": jnp.zeros((2, 3))}
  _, state = jax.jit(tx.update)(g, tx.init(params), params)
  m = optax_accum.metrics(state)  # mean = g / 1e-20 = 1e50: not finite in float32
  assert not bool(m.updated) and int(m.num_skipped) == 1 and np.isinf(float(m.grad_norm))


@pytest.mark.parametrize("clip", [0.5, 100.0])
def test_clip_matches_optax(clip):
  g1 = _tree([1.0, -2.0, 3.0, 0.5], np.arange(6.0).reshape(2, 3))
  g2 = _tree([0.25, 2.0, -1.0, 4.0], -np.ones((2, 3)))
  u, _ = _one_window([g1, g2], [1, 3], clip_norm=clip)
  mean = jax.tree.map(lambda a, b: (a + 3 * b) / 4, g1, g2)
  ref, _ = optax.clip_by_global_norm(clip).update(mean, optax.EmptyState())
  chex.assert_trees_all_close(u, jax.tree.map(lambda x: -x, ref), rtol=1e-6)


def _param_sized_copies(compiled, shape):
  pattern = r"= f32\[" + ",".join(map(str, shape)) + r"\]\{[^}]*\} copy\("
  return [line for line in compiled.as_text().splitlines() if re.search(pattern, line)]


@pytest.mark.parametrize(
  "kwargs",
  [{}, {"clip_norm": 1.0, "loss_scale": optax_accum.dynamic_loss_scale()}],
  ids=["plain", "clip_scale"],
)
def test_compiled_step_has_no_param_sized_copies(kwargs):
  """The recommended step on CPU: buffers stay in place (the point of issue 6).

  Four equal-shape leaves (equal zero broadcasts used to be merged and copied);
  temp memory is one gradient-sized buffer (the updates), not more.
  """
  if jax.default_backend() != "cpu":
    pytest.skip("the HLO shape is checked for the CPU backend")
  shape = (64, 256)
  params = {f"w{i}": jnp.zeros(shape) for i in range(4)}
  tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4, **kwargs)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax_accum.apply_if_updated(params, updates, state), state

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def fused_step(params, state, grads):
    return optax_accum.update_and_apply(tx, grads, state, params)

  param_bytes = 4 * 64 * 256 * 4
  for f in (step, fused_step):
    compiled = f.lower(params, tx.init(params), params).compile()
    assert _param_sized_copies(compiled, shape) == []
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= param_bytes + 4096
