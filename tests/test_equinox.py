"""Equinox (optax_accum/_equinox.py, docs/equinox.md): an ``eqx.nn.MLP`` trained with Equinox's own
pattern (``eqx.filter(model, eqx.is_array)``, ``eqx.apply_updates``) equals the physical batch,
across steps and in step; a whole ``eqx.Module`` as params is refused with that fix named.

The reference is one ``jax.grad`` of the masked mean loss on the concatenated microbatches and
plain ``optax.adam``; the microbatches have unequal token counts, so a mean of means would differ.
"""

import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from packaging.version import Version

import optax_accum
from optax_accum._equinox import check_params

# Equinox segfaults with jax 0.7.0 and 0.7.1 (equinox issue 1084; equinox >= 0.13.1 refuses them,
# so the oldest stack, jax 0.7.0, gets equinox 0.13.0): the compiled steps run on newer jax only.
jax_equinox_supports = pytest.mark.skipif(
  Version(jax.__version__) in (Version("0.7.0"), Version("0.7.1")),
  reason="Equinox does not support jax 0.7.0 and 0.7.1 (equinox issue 1084)",
)

K = 4  # microbatches per window
ROWS = 6  # rows per microbatch


def _model():
  return eqx.nn.MLP(in_size=3, out_size=1, width_size=8, depth=2, key=jax.random.key(0))


def loss_fn(model, batch):  # mean over the batch's unmasked rows
  err = (jax.vmap(model)(batch["x"])[:, 0] - batch["y"]) ** 2
  return (err * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1)


def _microbatches(n):
  rng = np.random.default_rng(0)
  return [
    {
      "x": rng.normal(size=(ROWS, 3)).astype(np.float32),
      "y": rng.normal(size=ROWS).astype(np.float32),
      "mask": (np.arange(ROWS) < rng.integers(1, ROWS + 1)).astype(np.float32),  # 1 to 6 tokens
    }
    for _ in range(n)
  ]


def _concat(microbatches):
  return {k: np.concatenate([mb[k] for mb in microbatches]) for k in microbatches[0]}


def _physical_batch_run(microbatches, lr=1e-2):
  """One adam step per window, on one ``jax.grad`` of the window's concatenated rows."""
  params, static = eqx.partition(_model(), eqx.is_array)
  tx = optax.adam(lr)
  state = tx.init(params)
  for i in range(0, len(microbatches), K):
    batch = _concat(microbatches[i : i + K])
    grads = jax.grad(lambda p, b: loss_fn(eqx.combine(p, static), b))(params, batch)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return eqx.combine(params, static)


def _assert_same_model(ours, ref):
  for a, b in zip(
    jax.tree.leaves(eqx.filter(ours, eqx.is_array)),
    jax.tree.leaves(eqx.filter(ref, eqx.is_array)),
    strict=True,
  ):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)


def _assert_not_mean_of_means(microbatches):
  """The test can fail: equal weights per microbatch would give another gradient."""
  params, static = eqx.partition(_model(), eqx.is_array)
  grad = lambda b: jax.grad(lambda p: loss_fn(eqx.combine(p, static), b))(params)
  weighted = grad(_concat(microbatches[:K]))
  mean_of_means = jax.tree.map(lambda *g: sum(g) / K, *(grad(mb) for mb in microbatches[:K]))
  diff = max(
    jax.tree.leaves(jax.tree.map(lambda a, b: jnp.abs(a - b).max(), weighted, mean_of_means))
  )
  assert diff > 1e-3, diff


@jax_equinox_supports
@pytest.mark.slow
def test_across_step_tx_update_and_eqx_apply_updates_equal_the_physical_batch():
  microbatches = _microbatches(2 * K)
  _assert_not_mean_of_means(microbatches)
  model = _model()
  tx = optax_accum.accumulate(optax.adam(1e-2), every_k=K)
  opt_state = tx.init(eqx.filter(model, eqx.is_array))

  @eqx.filter_jit
  def step(model, opt_state, batch):
    grads = eqx.filter_grad(loss_fn)(model, batch)
    updates, opt_state = tx.update(
      grads, opt_state, eqx.filter(model, eqx.is_array), weight=batch["mask"].sum()
    )
    return eqx.apply_updates(model, updates), opt_state

  for batch in microbatches:
    model, opt_state = step(model, opt_state, batch)
  assert int(optax_accum.metrics(opt_state).num_updates) == 2
  _assert_same_model(model, _physical_batch_run(microbatches))


@jax_equinox_supports
def test_across_step_update_and_apply_equals_the_physical_batch():
  microbatches = _microbatches(2 * K)
  params, static = eqx.partition(_model(), eqx.is_array)
  tx = optax_accum.accumulate(optax.adam(1e-2), every_k=K)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(lambda p: loss_fn(eqx.combine(p, static), batch))(params)
    return optax_accum.update_and_apply(tx, grads, opt_state, params, weight=batch["mask"].sum())

  for batch in microbatches:
    params, opt_state = step(params, opt_state, batch)
  _assert_same_model(eqx.combine(params, static), _physical_batch_run(microbatches))


@jax_equinox_supports
def test_in_step_microbatched_value_and_grad_equals_the_physical_batch():
  microbatches = _microbatches(K)
  batch = _concat(microbatches)  # microbatch k takes rows k, k+K, ...: any split of these rows
  model = _model()
  params, static = eqx.partition(model, eqx.is_array)
  inner = optax.adam(1e-2)
  inner_state = inner.init(eqx.filter(model, eqx.is_array))
  grad_fn = optax_accum.microbatched_value_and_grad(
    lambda p, b: loss_fn(eqx.combine(p, static), b), K, weight_fn=lambda mb: mb["mask"].sum()
  )

  @eqx.filter_jit
  def step(model, inner_state, batch):
    loss, grads = grad_fn(eqx.filter(model, eqx.is_array), batch)
    updates, inner_state = inner.update(grads, inner_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), inner_state, loss, grads

  new_model, _, loss, grads = step(model, inner_state, batch)
  ref_loss, ref_grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), batch))(params)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  _assert_same_model(new_model, _physical_batch_run(microbatches))


def test_a_whole_module_as_params_raises_naming_the_filter():
  tx = optax_accum.accumulate(optax.adam(1e-2), every_k=K)
  with pytest.raises(
    TypeError, match=r"leaf \.activation is a .*eqx\.filter\(model, eqx\.is_array\)"
  ):
    tx.init(_model())
  with pytest.raises(TypeError, match=r"eqx\.filter\(model, eqx\.is_array\)"):  # inside a tree
    tx.init({"mlp": _model(), "scale": jnp.ones(())})


def test_check_params_passes_arrays_and_trees_without_modules():
  check_params(eqx.filter(_model(), eqx.is_array))  # None where the functions were
  check_params({"w": jnp.ones(3), "n": 1.0})  # no eqx.Module: not this check's business
  check_params(jnp.ones(3))


def test_docs_page_shows_the_message_raised():
  page = (pathlib.Path(__file__).parents[1] / "docs" / "equinox.md").read_text()
  shown = re.search(r"```text\n(.*?)```", page, flags=re.S)[1]
  tx = optax_accum.accumulate(optax.adam(1e-2), every_k=K)
  with pytest.raises(TypeError) as raised:
    tx.init(_model())
  assert " ".join(shown.split()) == str(raised.value)
