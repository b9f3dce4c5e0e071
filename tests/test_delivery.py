"""optax_accum/_delivery.py and flush's path through wrappers (issue 37, item 3).

A caller's ``weight``/``flush``/``value`` either reaches ``accumulate`` or the call is refused,
naming the wrapper; ``optax_accum.flush`` reaches it through any wrapper (the state carries it).
Expected values are worked by hand (M1: at ``w``, an item's gradient is ``w - y``).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite

import optax_accum
from optax_accum import _delivery

SYNC = 100  # lookahead never syncs in these short runs: its fast params are accumulate's


def _lookahead(inner_tx, extra_args):
  tx = optax.lookahead(inner_tx, sync_period=SYNC, slow_step_size=0.5)
  return optax.with_extra_args_support(tx) if extra_args else tx


@pytest.mark.parametrize("extra_args", [False, True], ids=["lookahead", "with_extra_args"])
def test_flush_reaches_accumulate_through_lookahead(extra_args):
  tx = _lookahead(optax_accum.accumulate(optax.sgd(1.0), every_k=4), extra_args)
  params = optax.LookaheadParams.init_synced({"w": jnp.zeros(())})
  state = tx.init(params)
  update = jax.jit(tx.update)
  for y in (9.0, 10.0):  # two microbatches of a 4-window, no weight: M1 gradient w - y = -y
    u, state = update({"w": jnp.asarray(-y)}, state, params)
    params = optax.apply_updates(params, u)
  assert float(params.fast["w"]) == 0.0
  u, state = jax.jit(lambda s, p: optax_accum.flush(tx, s, p))(state, params)
  params = optax.apply_updates(params, u)
  assert float(params.fast["w"]) == 9.5  # the mean of two, not of four (nor weight 1 added)
  m = optax_accum.metrics(state)
  assert (int(m.num_updates), int(m.mini_step), int(m.num_microbatches)) == (1, 0, 2)
  assert not bool(optax_accum._state.find_state(state).flush_pending)
  # A second flush in a row is a no-op (C3).
  u, state = optax_accum.flush(tx, state, params)
  chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, u))
  assert int(optax_accum.metrics(state).num_updates) == 1
  assert_state_finite(state)


def test_weights_through_chain_masked_and_multi_transform_arrive():
  """Wrappers that forward extra arguments: the window equals its physical batch (M1)."""
  acc = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  for tx in (optax.chain(optax.identity(), acc), optax.masked(acc, {"w": True})):
    params = {"w": jnp.zeros(())}
    state = tx.init(params)
    for y, n in ((1.0, 1), (3.0, 3)):
      params, state = optax_accum.update_and_apply(
        tx, {"w": jnp.asarray(-y)}, state, params, weight=n
      )
    assert float(params["w"]) == (1 * 1 + 3 * 3) / 4  # 2.5, not the mean of means 2


@pytest.mark.parametrize("wrap", ["masked", "multi_transform"])
def test_flush_through_masked_and_multi_transform_returns_updates_like_the_params(wrap):
  """Issue 46: flush's zero gradients are shaped like the params, not like the window (whose
  masked-out leaves are ``MaskedNode``), so ``optax.apply_updates`` takes flush's updates."""
  acc = optax_accum.accumulate(optax.sgd(1.0), every_k=4)
  if wrap == "masked":
    tx = optax.masked(acc, {"w": True, "b": False})
  else:
    tx = optax.multi_transform({"a": acc, "f": optax.set_to_zero()}, {"w": "a", "b": "f"})
  params = {"w": jnp.zeros(3), "b": jnp.ones(2)}
  state = tx.init(params)
  for y, n in ((1.0, 1), (3.0, 3)):  # two microbatches of a 4-window, weights 1 and 3
    grads = {"w": jnp.full(3, -y), "b": jnp.full(2, 5.0)}
    u, state = tx.update(grads, state, params, weight=n)
    params = optax.apply_updates(params, u)
  b = params["b"]  # masked's own rule moved it by the raw gradients; flush's are zero
  u, state = jax.jit(lambda s, p: optax_accum.flush(tx, s, p))(state, params)
  assert jax.tree.structure(u) == jax.tree.structure(params)
  params = optax.apply_updates(params, u)
  np.testing.assert_array_equal(params["w"], np.full(3, (1 * 1 + 3 * 3) / 4))  # 2.5
  np.testing.assert_array_equal(params["b"], b)
  assert_state_finite(state)


def test_a_transformation_without_accumulate_is_optax_s_business():
  """Nothing to deliver to: update_and_apply is tx.update + apply_updates, as optax has it (a
  Flax TrainState passes weight=1 to any tx)."""
  params = {"w": jnp.ones(())}
  tx = optax.sgd(1.0)
  new, _ = optax_accum.update_and_apply(tx, params, tx.init(params), params, weight=1)
  assert float(new["w"]) == 0.0


def test_wrappers_are_named_by_their_state_types():
  inner = optax_accum.accumulate(optax.sgd(1.0), 2)
  tx = optax.lookahead(optax.chain(optax.identity(), inner), 2, 0.5)
  state = tx.init(optax.LookaheadParams.init_synced({"w": jnp.zeros(())}))
  assert _delivery.wrappers(state, optax_accum.AccumulationState) == ["optax.LookaheadState"]


def _dropping(acc):
  """A user's wrapper that forwards no extra arguments (its own state: accumulate's)."""
  return optax.GradientTransformationExtraArgs(
    acc.init, lambda g, s, p=None, **kwargs: acc.update(g, s, p)
  )


def test_flax_optimizer_refuses_a_dropped_weight():
  """The Flax helpers go through update_and_apply: the same refusal."""
  from flax import nnx

  import optax_accum.flax

  model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
  opt = optax_accum.flax.Optimizer(
    model, _dropping(optax_accum.accumulate(optax.sgd(1.0), 2)), wrt=nnx.Param
  )
  grads = nnx.grad(lambda m: m(jnp.ones((1, 1))).sum())(model)
  with pytest.raises(ValueError, match=r"weight= did not reach accumulate: a wrapper around"):
    opt.update(model, grads, weight=3)
  opt.update(model, grads)  # equal microbatches need no weight: nothing is dropped


def test_linen_train_state_value_reaches_the_window_loss():
  import flax.linen as nn

  import optax_accum.flax

  model = nn.Dense(1)
  x = jnp.ones((4, 2))
  state = optax_accum.flax.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), x)["params"],
    tx=optax_accum.accumulate(optax.sgd(0.0), every_k=2),
  )
  grads = jax.tree.map(jnp.zeros_like, state.params)
  for loss, n in ((1.0, 1), (5.0, 3)):
    state = state.apply_gradients(grads=grads, weight=n, value=jnp.float32(loss))
  m = optax_accum.metrics(state.opt_state)
  assert bool(m.has_window_loss) and float(m.window_loss) == (1 * 1 + 5 * 3) / 4
  assert int(state.step) == 1
