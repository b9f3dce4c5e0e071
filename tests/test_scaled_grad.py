"""optax_accum._scaled_grad: 0.3's ``scaled_value_and_grad``, deprecated in 0.4.

It still gives the gradient of the loss times the scale in force, with a ``DeprecationWarning``
naming ``microbatched_value_and_grad(loss_fn, 1, loss_scale=metrics(s).loss_scale)``, which
gives the same values (to rounding: it weighs the one microbatch by its rows).
"""

import chex
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest

import optax_accum


def _deprecated():
  with pytest.warns(DeprecationWarning, match=r"microbatched_value_and_grad\(loss_fn, 1, loss_sc"):
    return optax_accum.scaled_value_and_grad


def _m2_loss(params, batch):
  return 0.5 * jnp.mean((batch["x"] @ params["theta"] + params["b"] - batch["y"]) ** 2)


K = 4
tokens = lambda mb: mb["mask"].sum()


@pytest.fixture(scope="module")
def token_data():
  return models.token_params(), models.token_batch(num_rows=16, seq_len=8)


def test_gradient_of_the_scaled_loss_and_the_unscaled_loss(token_data):
  params, batch = token_data
  tx = optax_accum.accumulate(optax.sgd(1.0), 2, loss_scale=optax_accum.static_loss_scale(8.0))
  f = jax.jit(_deprecated()(models.token_loss))
  loss, grads = f(tx.init(params), params, batch)
  ref_loss, ref_grads = jax.value_and_grad(models.token_loss)(params, batch)
  chex.assert_trees_all_close(loss, ref_loss, rtol=1e-6)
  chex.assert_trees_all_close(grads, optax.tree.scale(8.0, ref_grads), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_equal_dtypes(grads, params)


def test_has_aux_and_no_accumulation_state(token_data):
  params, batch = token_data
  loss_aux = lambda p, b: (models.token_loss(p, b), {"rows": b["mask"].shape[0]})
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)  # no loss scale: the scale in force is 1
  (loss, aux), grads = _deprecated()(loss_aux, has_aux=True)(tx.init(params), params, batch)
  ref_loss, ref_grads = jax.value_and_grad(models.token_loss)(params, batch)
  chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), rtol=1e-5, atol=1e-7)
  assert aux == {"rows": 16}
  with pytest.raises(ValueError):
    _deprecated()(models.token_loss)(optax.sgd(1.0).init(params), params, batch)


def test_one_convention_for_in_step_and_across_step(token_data):
  """Given the same optimizer state, both helpers return the same scaled gradient and update."""
  params, batch = token_data
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=1, loss_scale=optax_accum.dynamic_loss_scale(init_scale=2.0**10)
  )
  state = tx.init(params)

  @jax.jit
  def in_step(p, s, b):
    f = optax_accum.microbatched_value_and_grad(
      models.token_loss, K, weight_fn=tokens, loss_scale=optax_accum.metrics(s).loss_scale
    )
    loss, grads = f(p, b)
    return loss, grads, tx.update(grads, s, p, weight=tokens(b))[0]

  @jax.jit
  def whole_batch(p, s, b):
    loss, grads = _deprecated()(models.token_loss)(s, p, b)
    return loss, grads, tx.update(grads, s, p, weight=tokens(b))[0]

  ref_loss, ref_grads = jax.value_and_grad(models.token_loss)(params, batch)
  loss_i, grads_i, upd_i = in_step(params, state, batch)
  loss_w, grads_w, upd_w = whole_batch(params, state, batch)
  chex.assert_trees_all_close((loss_i, loss_w), (ref_loss, ref_loss), rtol=1e-5)
  chex.assert_trees_all_close(grads_i, grads_w, rtol=1e-5, atol=1e-4)
  chex.assert_trees_all_close(grads_w, optax.tree.scale(2.0**10, ref_grads), rtol=1e-5, atol=1e-4)
  # accumulate divides the scale out once: both updates are -lr * the unscaled gradient.
  for upd in (upd_i, upd_w):
    chex.assert_trees_all_close(upd, optax.tree.scale(-1.0, ref_grads), rtol=1e-5, atol=1e-7)


def test_scaled_value_and_grad_returns_unscaled_loss_and_scaled_grads():
  rng = np.random.default_rng(4)
  batch = {
    "x": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=6), jnp.float32),
  }
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=2, loss_scale=optax_accum.static_loss_scale(2.0**5)
  )
  params = {"theta": jnp.asarray([0.5, -1.0, 0.25]), "b": jnp.asarray(0.1)}
  state = tx.init(params)
  loss, grads = jax.jit(_deprecated()(_m2_loss))(state, params, batch)
  ref_loss, ref_grads = jax.value_and_grad(_m2_loss)(params, batch)
  assert loss.dtype == jnp.float32
  chex.assert_trees_all_equal(loss, ref_loss)
  chex.assert_trees_all_close(grads, jax.tree.map(lambda g: g * 32.0, ref_grads), rtol=1e-6)


def test_scaled_value_and_grad_has_aux():
  def loss_fn(params, x):
    pred = x * params
    return jnp.sum(pred**2), {"pred": pred}

  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=2, loss_scale=optax_accum.static_loss_scale(4.0)
  )
  params = jnp.asarray([1.0, 2.0])
  x = jnp.asarray([3.0, -1.0])
  fn = jax.jit(_deprecated()(loss_fn, has_aux=True))
  (loss, aux), grads = fn(tx.init(params), params, x)
  assert float(loss) == 9.0 + 4.0
  np.testing.assert_array_equal(aux["pred"], [3.0, -2.0])
  np.testing.assert_array_equal(grads, 4.0 * 2.0 * x * x * params)  # 4 * d/dp sum((x p)^2)


def test_scaled_value_and_grad_casts_fp16_loss_before_scaling():
  def loss16(params):
    p = params.astype(jnp.float16)
    return jnp.float16(100.0) + jnp.float16(0.5) * jnp.sum(p * p)  # 100.25 in fp16

  params = jnp.asarray([0.5, 0.5], jnp.float32)
  fn = jax.jit(_deprecated()(loss16))
  for log2 in (15, 16):
    tx = optax_accum.accumulate(
      optax.sgd(1.0), 1, loss_scale=optax_accum.static_loss_scale(2.0**log2)
    )
    loss, grads = fn(tx.init(params), params)
    # loss * scale = 3.3e6 / 6.6e6 would be inf in fp16; the returned loss is the unscaled value.
    assert loss.dtype == jnp.float32 and float(loss) == 100.25
    if log2 == 15:
      np.testing.assert_array_equal(grads, [2.0**14, 2.0**14])  # 2**15 * p, finite


def test_the_04_spelling_gives_the_same_values(token_data):
  params, batch = token_data
  tx = optax_accum.accumulate(optax.sgd(1.0), 2, loss_scale=optax_accum.static_loss_scale(8.0))
  state = tx.init(params)
  old = _deprecated()(models.token_loss)(state, params, batch)
  new = optax_accum.microbatched_value_and_grad(
    models.token_loss, 1, loss_scale=optax_accum.metrics(state).loss_scale
  )(params, batch)
  chex.assert_trees_all_close(new, old, rtol=1e-6, atol=1e-7)
