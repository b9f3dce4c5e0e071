"""Tests of :func:`optax_accum.accumulate` (optax_accum/_accumulate.py).

Every expectation is computed another way: one ``jax.grad`` over the
concatenated batch fed once to the inner optimizer, ``optax.MultiSteps``, the
inner optimizer fed the window means directly, or a hand-worked number. Every
transform call runs under ``jax.jit``.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

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
from _steps import call, make_step

import optax_accum

# ----------------------------------------------------------------------------- helpers


def assert_exact_zeros(tree):
  """Every leaf is +0.0 exactly (bitwise: no NaN, no -0.0)."""
  for leaf in jax.tree.leaves(tree):
    leaf = np.asarray(leaf)
    assert np.all(leaf == 0) and not np.any(np.signbit(leaf.real)), leaf


WIDE = 256  # the property test's 256 x 256 leaf: 65,536 elements, XLA's large-leaf code paths


def _wide_features(x):
  """Fixed features of x for the wide leaf: ``x @ P`` and a readout ``q`` (constants)."""
  rng = np.random.default_rng(7)
  p = rng.normal(size=(3, WIDE)).astype(x.dtype) / np.sqrt(3)
  q = rng.normal(size=WIDE).astype(x.dtype) / WIDE
  return x @ p, q


def tokens_loss(params, x, y, mask):
  """Masked-token linear model: mean over unmasked tokens of ``0.5 * (pred - y)**2`` with
  ``pred = x @ theta + b`` (+ ``((x @ P) @ wide) @ q`` when params has a ``wide`` leaf).

  Shapes: x [N, T, 3], y and mask [N, T]. M2 is the case T = 1 with every token valid.
  """
  pred = x @ params["theta"] + params["b"]
  if "wide" in params:
    features, q = _wide_features(x)
    pred = pred + (features @ params["wide"]) @ q
  per_token = 0.5 * (pred - y) ** 2
  return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.sum(mask)


def m2_params(dtype=jnp.float32):
  return {"theta": jnp.array([0.1, 0.2, -0.3], dtype), "b": jnp.array(0.05, dtype)}


# eps = 1e-3: Adam's first step is g / (|g| + eps), which turns a float32 summation-order
# difference d of a gradient element near 0 (the 65,536-element `wide` leaf has many) into an
# update difference up to lr * d / eps; with the default 1e-8 that is any size, with 1e-3 under
# 1e-6 (the float32 atol below).
INNERS = {
  "sgd": lambda: optax.sgd(0.5),
  "adam": lambda: optax.adam(0.1, eps=1e-3),
  "adamw": lambda: optax.adamw(0.1, eps=1e-3, weight_decay=0.1),
}

K = 4  # microbatches per window in the property tests
N, T = 10, 3  # examples, tokens per example


@functools.cache
def _window_fns(opt: str, x64: bool):
  """Jitted (accumulated window, one full-batch step); padded shapes, so one compile each."""
  inner = INNERS[opt]()
  tx = optax_accum.accumulate(inner, every_k=K)

  @jax.jit
  def accumulated(params, x, y, masks):  # masks [K, N, T]: microbatch j's tokens
    def body(state, mask):
      g = jax.grad(tokens_loss)(params, x, y, mask)  # 0/0 = NaN for an empty microbatch
      u, state = tx.update(g, state, params, weight=mask.sum())
      return state, u

    state, us = jax.lax.scan(body, tx.init(params), masks)
    return jax.tree.map(lambda u: u[-1], us), jax.tree.map(lambda u: u[:-1], us), state

  @jax.jit
  def full_batch(params, x, y, mask):
    g = jax.grad(tokens_loss)(params, x, y, mask)
    return inner.update(g, inner.init(params), params)

  return accumulated, full_batch


@st.composite
def partitions(draw, tokens: bool):
  """A random partition of N examples into K microbatches (unequal, maybe empty) and a mask."""
  assign = np.array(draw(st.lists(st.integers(0, K - 1), min_size=N, max_size=N)))
  if tokens:
    mask = np.array(draw(st.lists(st.booleans(), min_size=N * T, max_size=N * T))).reshape(N, T)
    mask[0, 0] = True  # at least one real token in the batch
  else:
    mask = np.zeros((N, T), bool)
    mask[:, 0] = True  # M2: one valid "token" per example
  seed = draw(st.integers(0, 2**16))
  return assign, mask, seed


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
@pytest.mark.parametrize("opt", sorted(INNERS))
@hypothesis.settings(max_examples=5, deadline=None, database=None)
@hypothesis.given(data=st.data())
def test_one_window_equals_one_full_batch_step(data, opt, x64):
  # M2 (one valid token per example) or the masked-token model: same padded shapes.
  tokens = data.draw(st.booleans(), label="tokens")
  assign, mask, seed = data.draw(partitions(tokens))
  with _compat.enable_x64(x64):
    dtype = np.float64 if x64 else np.float32
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(N, T, 3)).astype(dtype)
    y = rng.normal(size=(N, T)).astype(dtype)
    params = {**m2_params(dtype), "wide": jnp.asarray(np.eye(WIDE, dtype=dtype) * 0.1)}
    masks = np.stack([mask & (assign == j)[:, None] for j in range(K)])
    accumulated, full_batch = _window_fns(opt, x64)
    u, between, state = accumulated(params, x, y, masks)
    assert_state_finite(state)  # empty microbatches' NaN gradients (weight 0) leave no trace
    ref_u, ref_inner = full_batch(params, x, y, mask)
    rtol = 1e-10 if x64 else 2e-5
    chex.assert_trees_all_close(u, ref_u, rtol=rtol, atol=rtol * 1e-2 if x64 else 1e-6)
    chex.assert_trees_all_close(state.inner_state, ref_inner, rtol=rtol, atol=rtol * 1e-3)
    chex.assert_trees_all_equal_dtypes(u, params)
    assert_exact_zeros(between)
    assert int(state.num_updates) == 1 and int(state.num_skipped) == 0
    assert float(state.window.weight_sum) == 0 and int(state.mini_step) == 0


# ----------------------------------------------------------------------------- optax baselines


def _m2_stream(n, seed=0, size=4):
  rng = np.random.RandomState(seed)
  return [
    (rng.normal(size=(size, 3)).astype(np.float32), rng.normal(size=size).astype(np.float32))
    for _ in range(n)
  ]


def _m2_loss(params, x, y):
  return jnp.mean(0.5 * (x @ params["theta"] + params["b"] - y) ** 2)


def test_equal_weights_match_multisteps():
  every_k, windows = 3, 3
  tx = optax_accum.accumulate(optax.adam(0.1), every_k=every_k)
  ms = optax.MultiSteps(optax.adam(0.1), every_k, use_grad_mean=True)
  step = make_step(tx)
  ms_step = jax.jit(ms.update)
  grad_fn = jax.jit(jax.grad(_m2_loss))
  p = q = m2_params()
  s, ms_s = tx.init(p), ms.init(q)
  for i, (x, y) in enumerate(_m2_stream(every_k * windows)):
    u, s, p = call(step, grad_fn(p, x, y), s, p, weight=3.0)  # every weight equal
    v, ms_s = ms_step(grad_fn(q, x, y), ms_s, q)
    q = optax.apply_updates(q, v)
    chex.assert_trees_all_close(u, v, rtol=1e-5, atol=1e-7)
    assert bool(s.updated) == ((i + 1) % every_k == 0)
  chex.assert_trees_all_close(p, q, rtol=1e-5)
  chex.assert_trees_all_close(s.inner_state, ms_s.inner_opt_state, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_k_1_feeds_the_inner_the_gradient_bitwise(dtype):
  # With an identity inner the emitted update *is* what the inner received.
  tx = optax_accum.accumulate(optax.identity(), every_k=1)
  step = make_step(tx)
  p = jax.tree.map(lambda x: x.astype(dtype), m2_params())
  s = tx.init(p)
  for x, y in _m2_stream(3):
    g = jax.grad(_m2_loss)(p, jnp.asarray(x, dtype), jnp.asarray(y, dtype))
    u, s, _ = call(step, g, s, p, weight=1.0)
    chex.assert_trees_all_equal(u, g)
    chex.assert_trees_all_equal_dtypes(u, g)


@pytest.mark.parametrize("opt", sorted(INNERS))
def test_every_k_1_is_the_inner_optimizer(opt):
  inner = INNERS[opt]()
  tx = optax_accum.accumulate(inner, every_k=1)
  step = make_step(tx)
  inner_step = jax.jit(inner.update)
  grad_fn = jax.jit(jax.grad(_m2_loss))
  p = q = m2_params()
  s, inner_s = tx.init(p), inner.init(q)
  for x, y in _m2_stream(4):
    u, s, p = call(step, grad_fn(p, x, y), s, p, weight=1.0)
    v, inner_s = inner_step(grad_fn(q, x, y), inner_s, q)
    q = optax.apply_updates(q, v)
    if opt == "sgd":
      chex.assert_trees_all_equal(u, v)
    else:
      # The inner gets the gradient bitwise (test above), but the window mean is
      # fused into adam's passes, and XLA contracts the arithmetic of that fused
      # loop differently (FMA): a few ulp, compounding over the steps.
      chex.assert_trees_all_close(u, v, rtol=1e-6, atol=0)
  chex.assert_trees_all_close(s.inner_state, inner_s, rtol=1e-6, atol=0)
  chex.assert_trees_all_close(p, q, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- tree shapes


def _random_tree_with_nones(seed):
  rng = np.random.RandomState(seed)
  shapes = {"a": (2,), "b": (), "c": {"d": (3, 2), "e": (1,), "f": ()}, "g": [(2,), (4,)]}
  keep = iter(rng.rand(7) < 0.6)
  leaf = lambda shape: jnp.asarray(rng.normal(size=shape), jnp.float32) if next(keep) else None
  params = jax.tree.map(leaf, shapes, is_leaf=lambda s: isinstance(s, tuple))
  grads_list = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)]
  grads_list.append(jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params))
  return params, grads_list


@pytest.mark.parametrize("seed", [0, 1])
def test_none_leaves_in_params(seed):
  params, (g1, g2) = _random_tree_with_nones(seed)
  inner = optax.adam(0.1)
  tx = optax_accum.accumulate(inner, every_k=2)
  step = make_step(tx)
  s = tx.init(params)
  u1, s, p = call(step, g1, s, params, weight=1.0)
  u2, s, p = call(step, g2, s, params, weight=3.0)
  assert jax.tree.structure(u2) == jax.tree.structure(params)
  assert_exact_zeros(u1)
  mean = jax.tree.map(lambda a, b: (a + 3 * b) / 4, g1, g2)
  ref, _ = jax.jit(inner.update)(mean, inner.init(params), params)
  chex.assert_trees_all_close(u2, ref, rtol=1e-5)


def _labels(params):
  return {"theta": "acc", "b": "plain"}


def test_accumulate_inside_multi_transform():
  tx = optax.multi_transform(
    {"acc": optax_accum.accumulate(optax.sgd(1.0), every_k=2), "plain": optax.sgd(0.5)},
    _labels,
  )
  p = m2_params()
  s = tx.init(p)
  step = jax.jit(lambda g, s, p, w: tx.update(g, s, p, weight=w))
  g1 = {"theta": jnp.array([1.0, 2.0, 3.0]), "b": jnp.array(4.0)}
  g2 = {"theta": jnp.array([-3.0, 0.0, 1.0]), "b": jnp.array(-2.0)}
  u1, s = step(g1, s, p, 1.0)
  u2, s = step(g2, s, p, 3.0)
  # The accumulated label closes its window at microbatch 2; the plain one steps every call.
  assert_exact_zeros(u1["theta"])
  np.testing.assert_allclose(u1["b"], -0.5 * 4.0)
  np.testing.assert_allclose(u2["theta"], -(np.array([1.0, 2, 3]) + 3 * np.array([-3.0, 0, 1])) / 4)
  np.testing.assert_allclose(u2["b"], -0.5 * -2.0)
  assert int(optax_accum.metrics(s).num_updates) == 1
  # flush and metrics find the state inside the multi_transform.
  _, s = step(g1, s, p, 2.0)
  u3, s = jax.jit(lambda s, p: optax_accum.flush(tx, s, p))(s, p)
  np.testing.assert_allclose(u3["theta"], -np.array([1.0, 2.0, 3.0]), rtol=1e-6)
  assert int(optax_accum.metrics(s).num_updates) == 2


def test_multi_transform_inside_accumulate():
  inner = optax.multi_transform({"acc": optax.adam(0.1), "plain": optax.sgd(0.5)}, _labels)
  tx = optax_accum.accumulate(inner, every_k=2)
  p = m2_params()
  step = make_step(tx)
  g1 = {"theta": jnp.array([1.0, 2.0, 3.0]), "b": jnp.array(4.0)}
  g2 = {"theta": jnp.array([-3.0, 0.0, 1.0]), "b": jnp.array(-2.0)}
  s = tx.init(p)
  _, s, _ = call(step, g1, s, p, weight=1.0)
  u, s, _ = call(step, g2, s, p, weight=3.0)
  mean = jax.tree.map(lambda a, b: (a + 3 * b) / 4, g1, g2)
  ref, ref_s = jax.jit(inner.update)(mean, inner.init(p), p)
  chex.assert_trees_all_close(u, ref, rtol=1e-6)
  chex.assert_trees_all_close(s.inner_state, ref_s, rtol=1e-6)


def test_masked_nodes_inside_optax_masked():
  mask = {"theta": True, "b": False}
  tx = optax.masked(optax_accum.accumulate(optax.sgd(1.0), every_k=2), mask)
  p = m2_params()
  s = tx.init(p)
  assert isinstance(optax_accum.metrics(s).mini_step, jax.Array)
  # The accumulate sees optax.MaskedNode where the mask is False.
  inner_acc = optax_accum._state.find_state(s).window.grad_sum
  assert isinstance(inner_acc["b"], optax.MaskedNode)
  step = jax.jit(lambda g, s, p, w: tx.update(g, s, p, weight=w))
  g1 = {"theta": jnp.array([1.0, 2.0, 3.0]), "b": jnp.array(4.0)}
  g2 = {"theta": jnp.array([3.0, 0.0, 1.0]), "b": jnp.array(-2.0)}
  u1, s = step(g1, s, p, 1.0)
  u2, s = step(g2, s, p, 1.0)
  assert_exact_zeros(u1["theta"])
  np.testing.assert_allclose(u2["theta"], [-2.0, -1.0, -2.0])
  # Masked-out leaves pass through unchanged (optax.masked's rule).
  np.testing.assert_allclose(u1["b"], 4.0)
  np.testing.assert_allclose(u2["b"], -2.0)


# ----------------------------------------------------------------------------- compilation


def test_one_compilation_for_all_microsteps():
  tx = optax_accum.accumulate(optax.adam(0.1), every_k=3)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(grads, state, params, weight, flush):
    updates, state = tx.update(grads, state, params, weight=weight, flush=flush)
    return updates, state, optax.apply_updates(params, updates)

  p = m2_params()
  s = tx.init(p)
  g = jax.tree.map(jnp.ones_like, p)
  flushes = [False, False, False, False, True, False, False, False, False]
  updated = []
  for i, f in enumerate(flushes):
    _, s, p = call(step, g, s, p, weight=float(i + 1), flush=f)
    updated.append(bool(s.updated))
  # windows: [1, 2, 3], [4, 5 (flush)], [6, 7, 8], [9 ...
  assert updated == [False, False, True, False, True, False, False, True, False]
  assert int(s.num_updates) == 3


# ----------------------------------------------------------------------------- composition


def test_update_takes_optaxs_argument_names():
  """optax's update protocol names the arguments (updates, state, params): keywords work."""
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=1)
  params, g = {"w": jnp.ones(2)}, {"w": jnp.array([0.5, 2.0])}
  by_name = tx.update(updates=g, state=tx.init(params), params=params, weight=2)
  chex.assert_trees_all_equal(by_name, tx.update(g, tx.init(params), params, weight=2))
  chex.assert_trees_all_equal(by_name[0], {"w": jnp.array([-0.5, -2.0])})  # -1.0 * g


def test_in_chain_after_a_clip():
  tx = optax.chain(optax.clip(0.5), optax_accum.accumulate(optax.sgd(1.0), every_k=2))
  p = {"w": jnp.zeros(3)}
  step = make_step(tx)
  s = tx.init(p)
  g1, g2 = np.array([1.0, -0.2, 0.1]), np.array([0.3, -2.0, 0.4])
  _, s, p = call(step, {"w": jnp.asarray(g1, jnp.float32)}, s, p, weight=1.0)
  u, s, p = call(step, {"w": jnp.asarray(g2, jnp.float32)}, s, p, weight=3.0)
  # Hand-worked: each microbatch is clipped elementwise first, then the weighted mean.
  ref = -(np.clip(g1, -0.5, 0.5) + 3 * np.clip(g2, -0.5, 0.5)) / 4
  np.testing.assert_allclose(u["w"], ref, rtol=1e-6)
  assert int(optax_accum.metrics(s).num_updates) == 1


def test_inject_hyperparams_inner_and_changed_learning_rate():
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
  tx = optax_accum.accumulate(inner, every_k=2)
  step = make_step(tx)
  p = q = {"w": jnp.array([1.0, -1.0])}
  s, ref_s = tx.init(p), inner.init(q)
  grads = [np.array([1.0, 2.0]), np.array([3.0, -1.0]), np.array([-2.0, 0.5]), np.array([1.0, 1.0])]
  inner_step = jax.jit(inner.update)
  for w_idx in range(2):
    ga, gb = grads[2 * w_idx], grads[2 * w_idx + 1]
    _, s, p = call(step, {"w": jnp.asarray(ga, jnp.float32)}, s, p, weight=2.0)
    u, s, p = call(step, {"w": jnp.asarray(gb, jnp.float32)}, s, p, weight=1.0)
    v, ref_s = inner_step({"w": jnp.asarray((2 * ga + gb) / 3, jnp.float32)}, ref_s, q)
    q = optax.apply_updates(q, v)
    chex.assert_trees_all_close(u, v, rtol=1e-6)
    # Change the learning rate in both states after window 1.
    s.inner_state.hyperparams["learning_rate"] = jnp.asarray(0.01, jnp.float32)
    ref_s.hyperparams["learning_rate"] = jnp.asarray(0.01, jnp.float32)
  chex.assert_trees_all_close(p, q, rtol=1e-6)
  assert int(s.inner_state.count) == 2


def test_vmap_over_states_matches_per_state_runs():
  tx = optax_accum.accumulate(optax.adam(0.1), every_k=2)
  step = jax.jit(lambda g, s, p, w: tx.update(g, s, p, weight=w))
  vstep = jax.jit(jax.vmap(lambda g, s, p, w: tx.update(g, s, p, weight=w)))
  b = 3
  rng = np.random.RandomState(0)
  grads = jnp.asarray(rng.normal(size=(6, b, 2)), jnp.float32)
  grads = grads.at[2, 1, 0].set(jnp.nan)  # state 1 skips its window 2, others apply it
  # state 2 has an empty window 1 (weights 0); state 1's NaN microbatch has weight 2.
  weights = jnp.asarray(
    [[1, 2, 0], [3, 1, 0], [2, 2, 1], [1, 3, 2], [0, 1, 4], [2, 1, 1]], jnp.float32
  )
  params = {"w": jnp.zeros((b, 2))}
  vs = jax.vmap(tx.init)(params)
  v_updates = []
  for t in range(6):
    u, vs = vstep({"w": grads[t]}, vs, params, weights[t])
    v_updates.append(u["w"])
  for i in range(b):
    p = {"w": params["w"][i]}
    s = tx.init(p)
    for t in range(6):
      u, s = step({"w": grads[t, i]}, s, p, weights[t, i])
      np.testing.assert_allclose(v_updates[t][i], u["w"], rtol=1e-6)
      if t % 2 == 0:
        assert_exact_zeros(v_updates[t][i])
    chex.assert_trees_all_close(jax.tree.map(lambda x, i=i: x[i], vs), s, rtol=1e-6)
  assert [int(n) for n in vs.num_skipped] == [0, 1, 0]
  assert [int(n) for n in vs.num_updates] == [3, 2, 2]


def test_every_k_schedule_of_num_updates():
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=lambda n: jnp.where(n < 2, 2, 4))
  step = make_step(tx)
  p = {"w": jnp.zeros(())}
  s = tx.init(p)
  updated = []
  for i in range(12):
    _, s, p = call(step, {"w": jnp.float32(-(i + 1))}, s, p, weight=1.0)
    updated.append(bool(s.updated))
  # Windows of 2, 2, then 4, 4 microbatches: boundaries after microbatch 2, 4, 8 and 12.
  assert [i + 1 for i, u in enumerate(updated) if u] == [2, 4, 8, 12]
  # SGD(1) on -y moves w by the window mean of y: 1.5 + 3.5 + 6.5 + 10.5.
  np.testing.assert_allclose(p["w"], 22.0, rtol=1e-6)


# ----------------------------------------------------------------------------- extra args


class RecState(NamedTuple):
  value: jax.Array
  foo: jax.Array
  calls: jax.Array


def recorder():
  """An inner that records the ``value`` and ``foo`` extra args it receives."""

  def init(params):
    del params
    nan = jnp.full((), jnp.nan, jnp.float32)
    return RecState(nan, nan, jnp.zeros((), jnp.int32))

  def update(updates, state, params=None, *, value=None, foo=None, **extra_args):
    del params, extra_args
    value = state.value if value is None else jnp.asarray(value, jnp.float32)
    foo = state.foo if foo is None else jnp.asarray(foo, jnp.float32)
    return updates, RecState(value, foo, state.calls + 1)

  return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize("chained", [False, True], ids=["plain", "in_chain"])
def test_value_is_window_weighted_mean_and_extra_args_forwarded(chained):
  acc = optax_accum.accumulate(recorder(), every_k=3)
  tx = optax.chain(optax.clip(10.0), acc) if chained else acc
  step = jax.jit(lambda g, s, p, w, v, foo: tx.update(g, s, p, weight=w, value=v, foo=foo))
  p = {"w": jnp.zeros(2)}
  s = tx.init(p)
  rec = lambda s: optax_accum._state.find_state(s).inner_state
  data = [(2.0, 1.0, 10.0), (1.0, 4.0, 20.0), (5.0, 0.5, 30.0), (1.0, 3.0, 40.0)]
  for i, (w, v, foo) in enumerate(data[:3]):
    _, s = step({"w": jnp.ones(2)}, s, p, w, v, foo)
    if i < 2:
      assert int(rec(s).calls) == 0  # the inner never runs between boundaries
  ref = (2 * 1.0 + 1 * 4.0 + 5 * 0.5) / 8  # hand-worked weighted mean
  np.testing.assert_allclose(rec(s).value, ref, rtol=1e-6)
  np.testing.assert_allclose(optax_accum.metrics(s).window_loss, ref, rtol=1e-6)
  assert float(rec(s).foo) == 30.0  # extra args of the boundary call reach the inner
  assert int(rec(s).calls) == 1


def test_window_loss_has_no_value_when_value_never_passed():
  """No NaN sentinel (issue 11, item 1): has_window_loss is False, window_loss 0."""
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  step = make_step(tx)
  p = {"w": jnp.zeros(2)}
  s = tx.init(p)
  for _ in range(4):
    _, s, p = call(step, {"w": jnp.ones(2)}, s, p)
  assert int(s.num_updates) == 2
  m = optax_accum.metrics(s)
  assert not bool(m.has_window_loss) and float(m.window_loss) == 0.0


def test_reduce_on_plateau_as_inner():
  inner = optax.chain(
    optax.sgd(1.0), optax.contrib.reduce_on_plateau(factor=0.5, patience=1, rtol=0.0, atol=1e-6)
  )
  tx = optax_accum.accumulate(inner, every_k=2)
  step = jax.jit(lambda g, s, p, w, v: tx.update(g, s, p, weight=w, value=v))
  p = {"w": jnp.zeros(())}
  s, ref_s = tx.init(p), inner.init(p)
  inner_step = jax.jit(lambda g, s, p, v: inner.update(g, s, p, value=v))
  # (weight, loss) per microbatch; window means 2.0, 3.0, 2.5, 1.0.
  losses = [(1.0, 2.0), (1.0, 2.0), (3.0, 3.0), (1.0, 3.0), (1.0, 1.0), (1.0, 4.0), (2.0, 1.0)]
  losses.append((2.0, 1.0))
  for i, (w, v) in enumerate(losses):
    u, s = step({"w": jnp.float32(-1.0)}, s, p, w, v)
    if i % 2 == 1:
      (wa, va), (wb, vb) = losses[i - 1], losses[i]
      mean_v = jnp.float32((wa * va + wb * vb) / (wa + wb))
      ref_u, ref_s = inner_step({"w": jnp.float32(-1.0)}, ref_s, p, mean_v)
      chex.assert_trees_all_close(u, ref_u, rtol=1e-6)
  chex.assert_trees_all_close(s.inner_state, ref_s, rtol=1e-6)
  # Hand-worked: best 2.0 after window 1; 3.0 and 2.5 are plateaus (patience 1), each halving
  # the scale: 0.25; window 4 (1.0) improves. The last update is 0.25 * -(-1.0).
  np.testing.assert_allclose(s.inner_state[1].scale, 0.25)
  np.testing.assert_allclose(u["w"], 0.25)


def test_flush_passes_window_mean_value_to_inner():
  inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1))
  tx = optax_accum.accumulate(inner, every_k=4)
  step = jax.jit(lambda g, s, p, v: tx.update(g, s, p, weight=2.0, value=v))
  p = {"w": jnp.zeros(())}
  s = tx.init(p)
  for v in (1.0, 3.0):
    _, s = step({"w": jnp.float32(1.0)}, s, p, v)
  _, s = jax.jit(lambda s, p: optax_accum.flush(tx, s, p))(s, p)
  np.testing.assert_allclose(s.inner_state[1].best_value, 2.0)  # (2 * 1 + 2 * 3) / 4
  np.testing.assert_allclose(optax_accum.metrics(s).window_loss, 2.0)


# ----------------------------------------------------------------------------- dtypes


def test_float32_params_with_bfloat16_grads_keep_the_float32_mean():
  # C7's numbers with float32 master params: the inner optimizer gets the float32 mean, not a
  # bf16-rounded one. Its updates have the dtypes plain inner returns (issue 11, item 3):
  # float32 here: a float32 (not weakly typed) scale promotes the bf16 gradient.
  inner = optax.chain(optax.sgd(1.0), optax.scale(jnp.ones((), jnp.float32)))
  tx = optax_accum.accumulate(inner, every_k=128)
  step = make_step(tx)
  p = jnp.zeros((), jnp.float32)
  s = tx.init(p)
  g_small = jnp.asarray(0.003, jnp.bfloat16)
  u, s, _ = call(step, jnp.asarray(1.0, jnp.bfloat16), s, p)
  for _ in range(127):
    u, s, _ = call(step, g_small, s, p)
  mean64 = (1.0 + 127 * float(g_small)) / 128  # 0.010795, hand-checked in test_cases C7
  assert u.dtype == jnp.float32
  assert abs(float(u) + mean64) < 1e-6  # bf16 rounding gives -0.010803


@pytest.mark.parametrize(
  "grad_dtype,x64,acc_dtype",
  [
    (jnp.bfloat16, False, jnp.float32),
    (jnp.float16, False, jnp.float32),
    (jnp.float32, False, jnp.float32),
    (jnp.float64, True, jnp.float64),
    (jnp.complex64, False, jnp.complex64),
    (jnp.complex128, True, jnp.complex128),
  ],
)
def test_accumulator_and_update_dtypes(grad_dtype, x64, acc_dtype):
  with _compat.enable_x64(x64):
    tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    p = {"w": jnp.zeros(2, grad_dtype)}
    s = tx.init(p)
    assert s.window.grad_sum["w"].dtype == acc_dtype
    step = make_step(tx)
    g1 = {
      "w": jnp.asarray([1.0, 2.0], grad_dtype) * (1 + 1j if "complex" in str(grad_dtype) else 1)
    }
    g2 = {"w": jnp.asarray([3.0, 0.5], grad_dtype)}
    u1, s, _ = call(step, g1, s, p, weight=1.0)
    u2, s, _ = call(step, g2, s, p, weight=3.0)
    chex.assert_trees_all_equal_dtypes(u1, p)
    chex.assert_trees_all_equal_dtypes(u2, p)
    chex.assert_trees_all_equal_dtypes(s.window.grad_sum, {"w": jnp.zeros(2, acc_dtype)})
    ref = -(np.asarray(g1["w"], np.complex128) + 3 * np.asarray(g2["w"], np.complex128)) / 4
    if "complex" not in str(grad_dtype):
      ref = ref.real
    want = ref.astype(np.dtype(grad_dtype)).astype(ref.dtype)  # rounded; NumPy < 2 can't mix bf16
    np.testing.assert_allclose(np.asarray(u2["w"]).astype(ref.dtype), want, rtol=1e-2)


@pytest.mark.parametrize("every_k", [1, 2])
def test_complex_gradient_of_real_params_raises_whatever_every_k(every_k):
  """Issue 46: every_k=1 keeps no accumulator but refuses, like every_k=2, a complex gradient
  that a float32 param's update would silently drop the imaginary part of."""
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=every_k)
  p = {"w": jnp.zeros(2, jnp.float32)}
  g = {"w": jnp.asarray([1.0 + 2.0j, 3.0], jnp.complex64)}
  with pytest.raises(TypeError, match=r"Gradient leaf .*w.* is complex64 .* imaginary part"):
    jax.jit(tx.update)(g, tx.init(p), p)


def test_updates_have_the_dtypes_plain_inner_returns():
  """Issue 11, item 3: plain sgd on bf16 grads returns bf16 updates, whatever the params."""
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=1)
  p = {"w": jnp.zeros(2, jnp.float32)}
  g = {"w": jnp.asarray([1.0, 3.0], jnp.bfloat16)}
  u, _ = jax.jit(lambda g, s, p: tx.update(g, s, p))(g, tx.init(p), p)
  assert u["w"].dtype == optax.sgd(1.0).update(g, optax.sgd(1.0).init(p), p)[0]["w"].dtype
  np.testing.assert_array_equal(u["w"], [-1.0, -3.0])
  p16 = {"w": jnp.zeros(2, jnp.bfloat16)}
  u, _ = jax.jit(lambda g, s: tx.update(g, s))(g, tx.init(p16))
  assert u["w"].dtype == jnp.bfloat16  # plain sgd: the grads' dtype
  np.testing.assert_array_equal(u["w"].astype(jnp.float32), [-1.0, -3.0])


# ----------------------------------------------------------------------------- zeros, empty


def test_zero_updates_are_exact_and_inner_state_frozen_between_boundaries():
  tx = optax_accum.accumulate(optax.adamw(0.1, weight_decay=0.1), every_k=4)
  step = make_step(tx)
  p = m2_params()
  s = tx.init(p)
  rng = np.random.RandomState(0)
  for i in range(8):
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 1e3, x.dtype), p)
    inner_before = s.inner_state
    u, s, p_new = call(step, g, s, p, weight=float(i % 3))
    if (i + 1) % 4:
      assert_exact_zeros(u)
      chex.assert_trees_all_equal(s.inner_state, inner_before)
      chex.assert_trees_all_equal(p_new, p)
    else:
      assert bool(s.updated)
    p = p_new
  assert int(s.num_updates) == 2


def test_empty_window_counts_nothing():
  tx = optax_accum.accumulate(optax.adam(0.1), every_k=2)
  step = make_step(tx)
  p = {"w": jnp.zeros(2)}
  s0 = tx.init(p)
  nan_g = {"w": jnp.full(2, jnp.nan)}  # a zero-weight microbatch's masked mean: 0/0
  u1, s, _ = call(step, {"w": jnp.ones(2)}, s0, p, weight=0.0)
  u2, s, _ = call(step, nan_g, s, p, weight=0.0)
  assert_exact_zeros((u1, u2))
  assert int(s.num_updates) == 0 and int(s.num_skipped) == 0
  assert not bool(s.updated)
  chex.assert_trees_all_equal(s.inner_state, s0.inner_state)
  assert int(s.mini_step) == 0 and float(s.window.weight_sum) == 0.0
  for leaf in jax.tree.leaves(s.window.grad_sum):
    assert not np.any(np.isnan(leaf))
  # A later window is unaffected: Adam's first step is -lr * sign(g).
  _, s, _ = call(step, {"w": jnp.array([1.0, -2.0])}, s, p, weight=1.0)
  u, s, _ = call(step, nan_g, s, p, weight=0.0)
  np.testing.assert_allclose(u["w"], [-0.1, 0.1], rtol=1e-5)
  assert int(s.num_updates) == 1


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
  "every_k,exc,match",
  [
    (0, ValueError, "every_k must be >= 1"),
    (2.5, TypeError, "positive int"),
    (True, TypeError, "positive int"),
  ],
)
def test_bad_every_k(every_k, exc, match):
  with pytest.raises(exc, match=match):
    optax_accum.accumulate(optax.sgd(1.0), every_k=every_k)


@pytest.mark.parametrize(
  "weight,exc,match",
  [
    (jnp.ones(2), ValueError, "Sum it first"),
    (jnp.array(True), TypeError, r"mask\.sum\(\)"),
    (-1.0, ValueError, "non-negative"),
  ],
  ids=["non_scalar", "boolean", "negative"],
)
def test_bad_weight_raises_at_trace_time(weight, exc, match):
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  p = {"w": jnp.zeros(2)}
  s = tx.init(p)
  if isinstance(weight, float):  # a concrete Python number inside jit
    f = jax.jit(lambda g, s, p: tx.update(g, s, p, weight=weight))
    args = (p, s, p)
  else:  # a traced array
    f = jax.jit(lambda g, s, p, w: tx.update(g, s, p, weight=w))
    args = (p, s, p, weight)
  with pytest.raises(exc, match=match):
    f(*args)


def test_mismatched_trees_raise_at_trace_time():
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  p = {"w": jnp.zeros(2), "b": jnp.zeros(())}
  s = tx.init(p)
  update = jax.jit(lambda g, s, p: tx.update(g, s, p))
  with pytest.raises(ValueError, match="Call tx.init on params with the same structure"):
    update({"w": jnp.zeros(2)}, s, None)
  with pytest.raises(ValueError, match="Pass gradients of the same params"):
    update({"w": jnp.zeros(3), "b": jnp.zeros(())}, s, None)
  with pytest.raises(ValueError, match="Pass the params the gradients were taken with"):
    update(p, s, {"w": jnp.zeros(2), "c": jnp.zeros(())})
  with pytest.raises(ValueError, match="Pass gradients of the same params"):
    update(p, s, {"w": jnp.zeros(2), "b": jnp.zeros(4)})


def test_a_state_of_another_every_k_continues_under_the_transformation_s():
  """Issue 48: the window length lives in the closure (optax's way), not in the state: a state
  made with every_k=4 holding one microbatch closes after the second under every_k=2, with
  the weighted mean of both (hand-worked: -(3 * 1 + 1 * 5) / 4 = -2)."""
  p = {"w": jnp.zeros(2)}
  old = optax_accum.accumulate(optax.sgd(1.0), every_k=4)
  _, s = old.update({"w": jnp.ones(2)}, old.init(p), p, weight=3)
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  optax_accum.sharding.check_compatible(tx, p, s)  # the same leaves: accepted
  u, s = jax.jit(tx.update)({"w": jnp.full(2, 5.0)}, s, p, weight=1)
  np.testing.assert_array_equal(u["w"], [-2.0, -2.0])
  assert int(s.num_updates) == 1


def test_a_state_of_another_structure_raises_under_jit_too():
  """A state whose sub-states are not this configuration's (a loss scale's) is refused at
  trace time, eagerly and under jit alike: no host callback, the structure is known."""
  p = {"w": jnp.zeros(2)}
  scaled = optax_accum.accumulate(optax.sgd(1.0), 2, loss_scale=optax_accum.static_loss_scale(8))
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  for update in (tx.update, jax.jit(tx.update)):
    with pytest.raises(ValueError, match="another accumulate configuration: .*loss_scale"):
      update(p, scaled.init(p), p)


@pytest.mark.parametrize("path", ["update", "update_and_apply"])
def test_the_jitted_step_exports_without_host_callbacks(path):
  """Issue 48: jax.export serializes the step (it refuses host callbacks), with a loss scale,
  a spike rule and a noise scale on; the exported step gives the jitted step's result."""
  from jax import export

  tx = optax_accum.accumulate(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    every_k=2,
    loss_scale=optax_accum.dynamic_loss_scale(),
    skip_if=optax_accum.spike_rule(warmup=2),
    observe=(optax_accum.noise_scale(0.9),),
  )
  p = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
  if path == "update":
    step = lambda g, s, p: tx.update(g, s, p, weight=3.0, value=jnp.float32(0.5))
  else:
    step = lambda g, s, p: optax_accum.update_and_apply(
      tx, g, s, p, weight=3.0, value=jnp.float32(0.5)
    )
  state = tx.init(p)
  treedef = jax.tree.structure(state)  # optax's state types are not registered for export

  def flat_step(g, leaves, p):
    out, new = step(g, jax.tree.unflatten(treedef, leaves), p)
    return out, jax.tree.leaves(new)

  grads = jax.tree.map(jnp.ones_like, p)
  exported = export.export(jax.jit(flat_step))(grads, jax.tree.leaves(state), p)
  restored = export.deserialize(exported.serialize())
  leaves = jax.tree.leaves(state)
  for _ in range(2):  # the second call is a boundary
    want = jax.jit(flat_step)(grads, leaves, p)
    chex.assert_trees_all_equal(restored.call(grads, leaves, p), want)
    leaves = want[1]
  assert int(jax.tree.unflatten(treedef, leaves).num_updates) == 1
  targets = set(re.findall(r"custom_call @([\w.]+)", exported.mlir_module()))
  assert not [t for t in targets if "callback" in t or "python" in t], targets


def test_traced_negative_weight_subtracts_its_microbatch():
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  step = make_step(tx)
  p = jnp.zeros(())
  s = tx.init(p)
  _, s, _ = call(step, jnp.float32(1.0), s, p, weight=2.0)
  u, s, _ = call(step, jnp.float32(5.0), s, p, weight=-1.0)
  # Documented: a traced negative weight subtracts its microbatch from the sum and from the
  # weight sum alike: -(2 * 1 - 5) / (2 - 1) = 3.
  assert float(u) == 3.0


def test_flush_of_a_plain_optimizer_raises():
  # Flushing optax.adamw itself would run a real step (weight decay on zero gradients).
  params = {"w": jnp.ones(2)}
  inner = optax.adamw(0.1, weight_decay=0.5)
  with pytest.raises(ValueError, match="flush needs the state of optax_accum.accumulate"):
    optax_accum.flush(inner, inner.init(params), params)


def test_unknown_keywords_raise_as_python_does():
  with pytest.raises(TypeError, match="unexpected keyword argument 'clip'"):
    optax_accum.accumulate(optax.sgd(1.0), 2, clip=1.0)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(aggregate="mean"), TypeError, r"aggregate must be optax_accum.aggregate"),
    (dict(observe=(0.9,)), TypeError, r"observe takes a tuple of observers"),
    (dict(skip_if=3), TypeError, r"skip_if takes optax_accum.spike_rule"),
    (dict(loss_scale=2.0), TypeError, r"loss_scale must be None"),
    (dict(axis_name=3), TypeError, r"axis_name must be None"),
  ],
)
def test_bad_feature_objects_name_the_argument(kwargs, error, match):
  with pytest.raises(error, match=match):
    optax_accum.accumulate(optax.sgd(1.0), 2, **kwargs)


def test_accumulate_takes_at_most_nine_named_parameters():
  """Issue 38: features are objects; accumulate's own parameters stay few."""
  import inspect

  params = inspect.signature(optax_accum.accumulate).parameters.values()
  assert all(p.kind is not p.VAR_KEYWORD for p in params)  # an unknown keyword: TypeError
  named = [p.name for p in params]
  assert len(named) <= 9, named


def test_uncalled_inner_factory_raises():
  with pytest.raises(TypeError, match="Call the factory"):
    optax_accum.accumulate(optax.sgd, 2)


@pytest.mark.parametrize("weight", [None, "3"])
def test_non_numeric_weight_raises(weight):
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = {"w": jnp.zeros(2)}
  with pytest.raises(TypeError, match="weight must be a number"):
    tx.update({"w": jnp.ones(2)}, tx.init(params), params, weight=weight)


def test_public_surface_is_small():
  """Issue 38, item 4: at most 33 names in all public modules together, each in __all__
  (30 in 0.4's design, and testing's three report classes, issue 48 item 5)."""
  import importlib

  names = set()
  for module in ("optax_accum", "optax_accum.sharding", "optax_accum.testing",
                 "optax_accum.flax", "optax_accum.pitfalls"):  # fmt: skip
    m = importlib.import_module(module)
    assert len(m.__all__) == len(set(m.__all__))
    assert all(hasattr(m, name) for name in m.__all__), module
    names |= set(m.__all__)
  assert len(names) <= 33, sorted(names)
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    _ = optax_accum.nope
