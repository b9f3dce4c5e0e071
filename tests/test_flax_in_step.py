"""optax_accum.flax.microbatched_value_and_grad (optax_accum/flax/_in_step.py): an NNX loss,
microbatched, against nnx.value_and_grad on the same microbatches one call at a time."""

import _compat
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
import optax_accum.flax

K = 4
tokens = lambda mb: mb["mask"].sum()


class _Net(nnx.Module):
  def __init__(self, rngs, dropout):
    self.fc1, self.fc2 = nnx.Linear(3, 8, rngs=rngs), nnx.Linear(8, 1, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None

  def __call__(self, x):
    h = jax.nn.relu(self.fc1(x))
    return self.fc2(self.drop(h) if self.drop else h)[:, 0]


def _loss(m, b):
  """Masked mean squared error, and a sum metric."""
  err = (m(b["x"]) - b["y"]) ** 2
  return (err * b["mask"]).sum() / jnp.maximum(b["mask"].sum(), 1.0), {"tokens": b["mask"].sum()}


def _batch(rows=16, seed=0):
  rng = np.random.default_rng(seed)
  mask = (rng.random(rows) < 0.6).astype(np.float32)
  x, y = rng.normal(size=(rows, 3)), rng.normal(size=rows)
  return {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32), "mask": mask}


@pytest.mark.slow
def test_dropout_state_threaded_like_k_sequential_calls():
  """Dropout's RNG counter advances once per microbatch (masks differ within the window); the
  result is the token-weighted mean of K nnx.value_and_grad calls on the microbatches, in
  order, and the module's counter ends where those K calls leave it."""
  batch = _batch()
  model, ref_model = _Net(nnx.Rngs(0), 0.5), _Net(nnx.Rngs(0), 0.5)
  f = optax_accum.flax.microbatched_value_and_grad(
    _loss, K, weight_fn=tokens, has_aux=True, aux_mode="sum"
  )
  (loss, aux), grads = nnx.jit(f)(model, batch)
  micro = optax_accum._microbatch_mesh.split_batch(batch, K)
  parts = [
    nnx.value_and_grad(_loss, has_aux=True)(ref_model, jax.tree.map(lambda x, k=k: x[k], micro))
    for k in range(K)
  ]
  w = np.asarray([float(tokens(jax.tree.map(lambda x, k=k: x[k], micro))) for k in range(K)])
  ref_loss = sum(wk * float(p[0][0]) for wk, p in zip(w, parts, strict=True)) / w.sum()
  ref_grads = jax.tree.map(
    lambda *g: sum(wk * gk for wk, gk in zip(w, g, strict=True)) / w.sum(), *[p[1] for p in parts]
  )
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert float(aux["tokens"]) == float(batch["mask"].sum())
  chex.assert_trees_all_close(nnx.to_pure_dict(grads), nnx.to_pure_dict(ref_grads), rtol=1e-5)
  counts = lambda m: jax.tree.leaves(nnx.state(m, nnx.RngCount))
  chex.assert_trees_all_equal(counts(model), counts(ref_model))


def test_trains_with_nnx_optimizer_on_an_explicit_mesh_with_axis_name():
  """A stateless module on a 2-device Explicit mesh, lanes under jit: the gradient of the
  batch's masked mean within 1e-6, and an optimizer step equal to the physical batch's."""
  mesh = _compat.make_mesh((2,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
  batch, model, ref = _batch(), _Net(nnx.Rngs(1), 0.0), _Net(nnx.Rngs(1), 0.0)
  f = optax_accum.flax.microbatched_value_and_grad(
    lambda m, b: _loss(m, b)[0], K, weight_fn=tokens, axis_name="batch"
  )
  opt = optax_accum.flax.Optimizer(model, optax_accum.accumulate(optax.sgd(0.1), 1), wrt=nnx.Param)
  ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, batch):
    loss, grads = f(model, batch)
    opt.update(model, grads)
    return loss

  with _compat.set_mesh(mesh):
    loss = step(model, opt, jax.device_put(batch, NamedSharding(mesh, P("batch"))))
  ref_loss, ref_grads = nnx.value_and_grad(lambda m, b: _loss(m, b)[0])(ref, batch)
  ref_opt.update(ref, ref_grads)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  chex.assert_trees_all_close(
    nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    nnx.to_pure_dict(nnx.state(ref, nnx.Param)),
    rtol=1e-6,
    atol=1e-6,
  )


def test_state_options_refused():
  with pytest.raises(TypeError, match="takes no has_state="):
    optax_accum.flax.microbatched_value_and_grad(_loss, K, has_state=True)
