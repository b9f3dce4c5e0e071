"""Tests for optax_accum._scaled_grad: the gradient of the loss times the scale in force."""

import chex
import jax
import models
import optax
import pytest

import optax_accum

K = 4
tokens = lambda mb: mb["mask"].sum()


@pytest.fixture(scope="module")
def token_data():
  return models.token_params(), models.token_batch(num_rows=16, seq_len=8)


def test_gradient_of_the_scaled_loss_and_the_unscaled_loss(token_data):
  params, batch = token_data
  tx = optax_accum.accumulate(optax.sgd(1.0), 2, loss_scale=optax_accum.static_loss_scale(8.0))
  f = jax.jit(optax_accum.scaled_value_and_grad(models.token_loss))
  loss, grads = f(tx.init(params), params, batch)
  ref_loss, ref_grads = jax.value_and_grad(models.token_loss)(params, batch)
  chex.assert_trees_all_close(loss, ref_loss, rtol=1e-6)
  chex.assert_trees_all_close(grads, optax.tree.scale(8.0, ref_grads), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_equal_dtypes(grads, params)


def test_has_aux_and_no_accumulation_state(token_data):
  params, batch = token_data
  loss_aux = lambda p, b: (models.token_loss(p, b), {"rows": b["mask"].shape[0]})
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)  # no loss scale: the scale in force is 1
  (loss, aux), grads = optax_accum.scaled_value_and_grad(loss_aux, has_aux=True)(
    tx.init(params), params, batch
  )
  ref_loss, ref_grads = jax.value_and_grad(models.token_loss)(params, batch)
  chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), rtol=1e-5, atol=1e-7)
  assert aux == {"rows": 16}
  with pytest.raises(ValueError):
    optax_accum.scaled_value_and_grad(models.token_loss)(optax.sgd(1.0).init(params), params, batch)


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
      models.token_loss, K, weight_fn=tokens, loss_scale=optax_accum.get_loss_scale(s)
    )
    loss, grads = f(p, b)
    return loss, grads, tx.update(grads, s, p, weight=tokens(b))[0]

  @jax.jit
  def whole_batch(p, s, b):
    loss, grads = optax_accum.scaled_value_and_grad(models.token_loss)(s, p, b)
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
