"""In-step aux modes (optax_accum/_aux.py): each equals one call on the whole batch, and a mode
that would change a per-example leaf raises."""

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

import optax_accum

K = 4
tokens = lambda mb: mb["mask"].sum()


@pytest.fixture
def token_data():
  return models.token_params(), models.token_batch(num_rows=16, seq_len=8)


def _metrics_loss(p, b):
  """lm1b-style aux: sum metrics (correct predictions, tokens) and per-example logits."""
  logits = models.token_logits(p, b["inputs"])
  hit = (jnp.argmax(logits, -1) == b["targets"]) & (b["mask"] > 0)
  aux = {"correct": hit.sum(), "tokens": b["mask"].sum(), "logits": logits}
  return models.token_loss(p, b), aux


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
@pytest.mark.parametrize("strided", [True, False])
def test_aux_mode_sum_and_concat_equal_the_batch(token_data, strided):
  """'sum' adds the microbatches' sum metrics (integers stay exact), 'concat' returns the
  per-example values in the batch's rows and order; both equal one call on the batch."""
  params, batch = token_data
  (_, ref), _ = jax.value_and_grad(_metrics_loss, has_aux=True)(params, batch)
  without = lambda aux, key: {k: v for k, v in aux.items() if k != key}
  make = lambda mode, loss_fn: optax_accum.microbatched_value_and_grad(
    loss_fn, K, weight_fn=tokens, has_aux=True, aux_mode=mode, strided=strided
  )
  summed = lambda p, b: (_metrics_loss(p, b)[0], without(_metrics_loss(p, b)[1], "logits"))
  (_, sums), _ = jax.jit(make("sum", summed))(params, batch)
  assert sums["correct"].dtype == jnp.int32 and int(sums["correct"]) == int(ref["correct"])
  np.testing.assert_array_equal(sums["tokens"], ref["tokens"])
  logits_only = lambda p, b: (_metrics_loss(p, b)[0], _metrics_loss(p, b)[1]["logits"])
  (_, logits), _ = jax.jit(make("concat", logits_only))(params, batch)
  assert logits.shape == ref["logits"].shape
  np.testing.assert_allclose(logits, ref["logits"], rtol=1e-6, atol=1e-6)


def test_aux_modes_refuse_to_change_a_leaf_silently(token_data):
  params, batch = token_data
  for mode in ("mean", "sum"):  # per-example logits averaged (or added) row by row: refused
    f = optax_accum.microbatched_value_and_grad(_metrics_loss, K, has_aux=True, aux_mode=mode)
    with pytest.raises(ValueError, match=r"\['logits'\] has shape \(4, 8, 11\).*aux_mode='concat'"):
      jax.jit(f)(params, batch)
  f = optax_accum.microbatched_value_and_grad(_metrics_loss, K, has_aux=True, aux_mode="concat")
  with pytest.raises(ValueError, match=r"aux_mode='concat' joins per-example.*\['correct'\]"):
    jax.jit(f)(params, batch)
