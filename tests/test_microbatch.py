"""Tests for optax_accum._microbatch: in-step accumulation equals one physical batch."""

import _compat
import chex
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest

import optax_accum

K = 4
tokens = lambda mb: mb["mask"].sum()


def naive_token_loss(params, batch):
  """Masked mean WITHOUT a guard: 0/0 = NaN for an all-padding microbatch."""
  logits = models.token_logits(params, batch["inputs"])
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return (nll * batch["mask"]).sum() / batch["mask"].sum()


@pytest.fixture(scope="module")
def token_data():
  return models.token_params(), models.token_batch(num_rows=16, seq_len=8)


@pytest.mark.parametrize("strided", [True, False])
@pytest.mark.slow
def test_equals_value_and_grad_over_batch_unequal_tokens(token_data, strided):
  params, batch = token_data
  per_mb = optax_accum._microbatch_mesh.split_batch(batch, K, strided=strided)["mask"].sum(
    axis=(1, 2)
  )
  assert len(set(np.asarray(per_mb).tolist())) > 1  # the case where weighting matters
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(models.token_loss))(params, batch)
  f = optax_accum.microbatched_value_and_grad(
    models.token_loss, K, weight_fn=tokens, strided=strided
  )
  chex.clear_trace_counter()
  f = jax.jit(chex.assert_max_traces(f, n=1))
  loss, grads = f(params, batch)
  chex.assert_trees_all_close(loss, ref_loss, rtol=1e-5)
  chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_equal_dtypes(grads, params)
  # Same shapes, new data: no retrace, still equal.
  other = models.token_batch(num_rows=16, seq_len=8, seed=1)
  loss, grads = f(params, other)
  ref_loss, ref_grads = jax.value_and_grad(models.token_loss)(params, other)
  chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), rtol=1e-5, atol=1e-7)


def test_mean_of_means_would_differ(token_data):
  """The test above can fail: equal weights give a visibly different gradient."""
  params, batch = token_data
  f = optax_accum.microbatched_value_and_grad(models.token_loss, K)  # weight = rows
  _, grads = jax.jit(f)(params, batch)
  _, ref = jax.value_and_grad(models.token_loss)(params, batch)
  assert optax.tree.norm(optax.tree.sub(grads, ref)) > 1e-3 * optax.tree.norm(ref)


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_has_aux_weighted_mean_and_stack(token_data):
  params, batch = token_data

  def loss_fn(p, b):
    loss = models.token_loss(p, b)
    logits = models.token_logits(p, b["inputs"])
    hit = (jnp.argmax(logits, -1) == b["targets"]).astype(jnp.float32)
    acc = (hit * b["mask"]).sum() / jnp.maximum(b["mask"].sum(), 1.0)
    return loss, {"accuracy": acc, "loss_copy": loss}

  (ref_loss, ref_aux), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
  f = optax_accum.microbatched_value_and_grad(loss_fn, K, weight_fn=tokens, has_aux=True)
  (loss, aux), grads = jax.jit(f)(params, batch)
  chex.assert_trees_all_close(
    (loss, aux, grads), (ref_loss, ref_aux, ref_grads), rtol=1e-5, atol=1e-7
  )

  g = optax_accum.microbatched_value_and_grad(
    loss_fn, K, weight_fn=tokens, has_aux=True, aux_mode="stack"
  )
  (_, stacked), _ = jax.jit(g)(params, batch)
  micro = optax_accum._microbatch_mesh.split_batch(batch, K)
  per_mb = [loss_fn(params, jax.tree.map(lambda x, k=k: x[k], micro))[1] for k in range(K)]
  chex.assert_trees_all_close(stacked, jax.tree.map(lambda *xs: jnp.stack(xs), *per_mb))


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_zero_token_microbatches_no_nan(token_data):
  params, _ = token_data
  batch = models.token_batch(num_rows=8, seq_len=8)
  mask = np.asarray(batch["mask"]).copy()
  mask[1::2] = 0  # strided: microbatch 1 (rows 1, 3, 5, 7) is all padding
  batch = dict(batch, mask=jnp.asarray(mask))
  f = jax.jit(optax_accum.microbatched_value_and_grad(naive_token_loss, 2, weight_fn=tokens))
  loss, grads = f(params, batch)
  ref_loss, ref_grads = jax.value_and_grad(naive_token_loss)(params, batch)
  assert np.isfinite(ref_loss)
  chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), rtol=1e-5, atol=1e-7)
  # No real token anywhere: zero loss and zero gradients, not NaN.
  empty = dict(batch, mask=jnp.zeros_like(batch["mask"]))
  loss, grads = f(params, empty)
  chex.assert_trees_all_equal((loss, grads), (jnp.zeros(()), optax.tree.zeros_like(params)))


# Adam's first step is g / (|g| + eps): with eps = 1e-8 a gradient element of 5e-8 (the 65,536
# `mix` leaf has them) turns the two paths' 1e-8 summation-order difference into a 1e-3 relative
# update difference; eps = 1e-3 keeps the step well conditioned: a gradient difference d moves
# the update by at most lr * d / eps (2e-8 -> 2e-7), the adamw case's atol.
@pytest.mark.parametrize(
  "inner,atol",
  [(optax.sgd(1.0), 1e-7), (optax.adamw(1e-2, weight_decay=1e-2, eps=1e-3), 1e-6)],
  ids=["sgd", "adamw"],
)
@pytest.mark.slow
def test_in_step_and_across_step_give_the_same_update(token_data, inner, atol):
  params, batch = token_data
  f = optax_accum.microbatched_value_and_grad(models.token_loss, K, weight_fn=tokens)

  @jax.jit
  def in_step(p, b):
    _, g = f(p, b)
    return inner.update(g, inner.init(p), p)[0]

  tx = optax_accum.accumulate(inner, every_k=K)

  @jax.jit
  def microstep(g, state, p, w):
    return tx.update(g, state, p, weight=w)

  state = tx.init(params)
  micro = optax_accum._microbatch_mesh.split_batch(batch, K)
  for k in range(K):
    mb = jax.tree.map(lambda x, k=k: x[k], micro)
    updates, state = microstep(jax.grad(models.token_loss)(params, mb), state, params, tokens(mb))
  assert int(optax_accum.metrics(state).num_updates) == 1
  ref = inner.update(jax.grad(models.token_loss)(params, batch), inner.init(params), params)[0]
  chex.assert_trees_all_close(in_step(params, batch), updates, rtol=1e-5, atol=atol)
  chex.assert_trees_all_close(updates, ref, rtol=1e-5, atol=atol)


@pytest.mark.slow
def test_dropout_keys_fold_in_microbatch_index():
  params, batch = models.mlp_params(), models.linear_regression_data(8)
  key = jax.random.key(3)

  def loss_fn(p, b, *, key):
    return models.mlp_loss(p, b, key=key), jax.random.uniform(key)

  f = jax.jit(optax_accum.microbatched_value_and_grad(loss_fn, K, has_aux=True, aux_mode="stack"))
  (loss, draws), grads = f(params, batch, key=key)
  expected = jnp.stack([jax.random.uniform(jax.random.fold_in(key, k)) for k in range(K)])
  chex.assert_trees_all_equal(draws, expected)
  assert len(set(np.asarray(draws).tolist())) == K  # a different key per microbatch
  # The value equals the mean over microbatches with those keys (2 rows each).
  micro = optax_accum._microbatch_mesh.split_batch(batch, K)
  mbs = [jax.tree.map(lambda x, k=k: x[k], micro) for k in range(K)]
  vg = jax.jit(jax.value_and_grad(models.mlp_loss))
  per = [vg(params, mb, key=jax.random.fold_in(key, k))
         for k, mb in enumerate(mbs)]  # fmt: skip
  chex.assert_trees_all_close(loss, sum(v for v, _ in per) / K, rtol=1e-5)
  chex.assert_trees_all_close(grads, jax.tree.map(lambda *g: sum(g) / K, *[g for _, g in per]),
                              rtol=1e-5, atol=1e-7)  # fmt: skip
  # Reproducible: same inputs and key give bitwise-equal results; another key does not.
  chex.assert_trees_all_equal(f(params, batch, key=key), ((loss, draws), grads))
  (_, other), _ = f(params, batch, key=jax.random.key(4))
  assert not np.array_equal(other, draws)


def test_loss_scale_gives_the_scaled_gradient_for_accumulate_to_divide_out(token_data):
  params, batch = token_data
  ref_loss, ref_grads = jax.value_and_grad(models.token_loss)(params, batch)
  scale = 1024.0
  # The convention of scaled_value_and_grad: the loss unscaled, the gradient of loss * scale.
  f = optax_accum.microbatched_value_and_grad(
    models.token_loss, K, weight_fn=tokens, loss_scale=scale
  )
  loss, scaled = jax.jit(f)(params, batch)
  chex.assert_trees_all_close(loss, ref_loss, rtol=1e-5)
  scaled_ref = jax.grad(lambda p: scale * models.token_loss(p, batch))(params)
  chex.assert_trees_all_close(scaled, scaled_ref, rtol=1e-5, atol=1e-4)
  chex.assert_trees_all_close(scaled, optax.tree.scale(scale, ref_grads), rtol=1e-5, atol=1e-4)

  # With accumulate(every_k=1, loss_scale=...): the scale is divided out once, and the skip rules.
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=1, loss_scale=optax_accum.dynamic_loss_scale(init_scale=scale)
  )

  @jax.jit
  def step(p, state, b):
    s = optax_accum.metrics(state).loss_scale
    mvg = optax_accum.microbatched_value_and_grad(
      models.token_loss, K, weight_fn=tokens, loss_scale=s
    )
    _, grads = mvg(p, b)
    return tx.update(grads, state, p, weight=tokens(b))

  updates, state = step(params, tx.init(params), batch)
  chex.assert_trees_all_close(updates, optax.tree.scale(-1.0, ref_grads), rtol=1e-5, atol=1e-7)
  # A non-finite step is skipped by accumulate: params stay, the scale backs off.
  bad = dict(params, out=params["out"].at[0, 0].set(jnp.inf))
  updates, state = step(bad, state, batch)
  chex.assert_trees_all_equal(updates, optax.tree.zeros_like(params))
  m = optax_accum.metrics(state)
  assert (int(m.num_skipped), float(m.loss_scale)) == (1, scale / 2)


@pytest.mark.slow
def test_nnx_state_threaded_in_order():
  """BatchNorm statistics and dropout RNG counters go through the microbatches in order."""
  from flax import nnx

  model = models.nnx_mlp(batch_norm=True, dropout_rate=0.5)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  batch = models.linear_regression_data(16)

  def loss_fn(p, b, rest):
    # copy: fresh Variables in this trace
    m = nnx.merge(graphdef, p, rest, **_compat.merge_copy_kwargs())
    loss = models.nnx_mlp_loss(m, b)
    return loss, nnx.split(m, nnx.Param, ...)[2]

  f = jax.jit(optax_accum.microbatched_value_and_grad(loss_fn, K, has_state=True))
  (loss, new_rest), grads = f(params, batch, rest)

  # Reference: a Python loop, each microbatch sees the state the previous one left.
  micro = optax_accum._microbatch_mesh.split_batch(batch, K)
  ref_step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  state, losses, gs = rest, [], []
  for k in range(K):
    mb = jax.tree.map(lambda x, k=k: x[k], micro)
    (v, state), g = ref_step(params, mb, state)
    losses.append(v)
    gs.append(g)
  chex.assert_trees_all_close(loss, sum(losses) / K, rtol=1e-5)
  ref_grads = jax.tree.map(lambda *g: sum(g) / K, *gs)
  # BatchNorm cancels fc1's bias: its gradient is 0 up to rounding noise on both sides.
  chex.assert_trees_all_close(grads["fc1"]["bias"], ref_grads["fc1"]["bias"], atol=1e-4)
  del grads["fc1"]["bias"], ref_grads["fc1"]["bias"]
  chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
  unkey = lambda t: jax.tree.map(
    lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
    t,
  )
  chex.assert_trees_all_close(unkey(new_rest), unkey(state), rtol=1e-5, atol=1e-7)
  count = lambda s: int(s["drop"]["rngs"]["count"][...])
  assert count(new_rest) == count(rest) + K  # one dropout draw per microbatch
  assert not np.allclose(new_rest["bn"]["mean"][...], rest["bn"]["mean"][...])


def test_has_state_with_aux():
  params, batch = models.linear_regression_params(), models.linear_regression_data(8)

  def loss_fn(p, b, calls):
    loss = models.linear_regression_loss(p, b)
    return loss, ({"loss": loss}, calls + 1)

  f = optax_accum.microbatched_value_and_grad(loss_fn, 2, has_aux=True, has_state=True)
  (loss, (aux, calls)), grads = jax.jit(f)(params, batch, jnp.zeros((), jnp.int32))
  ref_loss, ref_grads = jax.value_and_grad(models.linear_regression_loss)(params, batch)
  chex.assert_trees_all_close((loss, aux["loss"], grads), (ref_loss, ref_loss, ref_grads),
                              rtol=1e-5)  # fmt: skip
  assert int(calls) == 2


def test_bfloat16_params_float32_carry():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), models.linear_regression_params())
  batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16), models.linear_regression_data(16))
  f = optax_accum.microbatched_value_and_grad(models.linear_regression_loss, K)
  loss, grads = jax.jit(f)(params, batch)
  chex.assert_trees_all_equal_dtypes(grads, params)
  assert loss.dtype == jnp.float32
  # float32 sum of the bf16 microbatch gradients, rounded once at the end.
  micro = optax_accum._microbatch_mesh.split_batch(batch, K)
  gs = [jax.grad(models.linear_regression_loss)(params, jax.tree.map(lambda x, k=k: x[k], micro))
        for k in range(K)]  # fmt: skip
  mean32 = jax.tree.map(lambda *g: sum(x.astype(jnp.float32) for x in g) / K, *gs)
  chex.assert_trees_all_equal(grads, jax.tree.map(lambda x: x.astype(jnp.bfloat16), mean32))


def test_errors():
  params, batch = models.linear_regression_params(), models.linear_regression_data(10)
  f = optax_accum.microbatched_value_and_grad(models.linear_regression_loss, 4)
  with pytest.raises(ValueError, match="10 rows, which is not divisible by num_microbatches=4"):
    jax.jit(f)(params, batch)
  with pytest.raises(ValueError, match="different leading"):
    f(params, {"x": batch["x"], "y": batch["y"][:8]})
  with pytest.raises(ValueError, match=">= 1"):
    optax_accum.microbatched_value_and_grad(models.linear_regression_loss, 0)
  with pytest.raises(ValueError, match="aux_mode"):
    optax_accum.microbatched_value_and_grad(models.linear_regression_loss, 2, aux_mode="median")
  g = optax_accum.microbatched_value_and_grad(lambda p, b: b["y"] * p["b"], 2)
  with pytest.raises(ValueError, match="scalar mean loss"):
    g(params, batch)
  h = optax_accum.microbatched_value_and_grad(
    models.linear_regression_loss, 2, weight_fn=lambda mb: mb["y"] > 0
  )
  with pytest.raises(TypeError, match="boolean"):
    h(params, batch)


def test_strict_dtype_promotion_and_integer_aux(token_data):
  params, batch = token_data

  def loss_fn(p, b):
    return models.token_loss(p, b), {"rows": jnp.asarray(b["mask"].shape[0], jnp.int32)}

  with jax.numpy_dtype_promotion("strict"):
    f = optax_accum.microbatched_value_and_grad(
      loss_fn, K, weight_fn=tokens, has_aux=True, loss_scale=8.0
    )
    (loss, aux), grads = jax.jit(f)(params, batch)
  ref_loss, ref_grads = jax.value_and_grad(models.token_loss)(params, batch)
  chex.assert_trees_all_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(grads, optax.tree.scale(8.0, ref_grads), rtol=1e-5, atol=1e-6)
  # An integer aux comes back as its float weighted mean: every microbatch has 4 rows.
  chex.assert_trees_all_equal(aux["rows"], jnp.asarray(16 / K, jnp.float32))


def test_python_scalar_aux_leaf_is_averaged_like_an_array():
  grad_fn = optax_accum.microbatched_value_and_grad(
    lambda p, b: (((b * p) ** 2).mean(), {"lr": 0.1, "n": b.shape[0]}), 2, has_aux=True
  )
  (loss, aux), g = jax.jit(grad_fn)(1.0, jnp.arange(4.0))
  ref_loss, ref_g = jax.value_and_grad(lambda p: ((jnp.arange(4.0) * p) ** 2).mean())(1.0)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(g, ref_g, rtol=1e-6)
  np.testing.assert_allclose(aux["lr"], 0.1, rtol=1e-6)
  np.testing.assert_allclose(aux["n"], 2.0)  # every microbatch has 2 rows


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_concrete_bad_loss_scale_raises(scale):
  grad_fn = optax_accum.microbatched_value_and_grad(
    lambda p, b: (b * p).mean(), 2, loss_scale=scale
  )
  with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
    grad_fn(1.0, jnp.ones(4))


def test_unscale_is_gone():
  """The deprecation is finished: the gradient is always that of the scaled loss."""
  with pytest.raises(TypeError, match="unscale"):
    optax_accum.microbatched_value_and_grad(lambda p, b: b.mean(), 2, loss_scale=4.0, unscale=True)


def test_loss_scale_policy_is_refused_with_the_value_to_pass_instead():
  f = optax_accum.microbatched_value_and_grad(
    lambda p, b: (b * p).mean(), 2, loss_scale=optax_accum.dynamic_loss_scale()
  )
  with pytest.raises(TypeError, match=r"metrics\(opt_state\).loss_scale"):
    f(1.0, jnp.ones(4))


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw_uint32"])
def test_keys_anywhere_in_the_keyword_arguments_are_folded(raw):
  """rngs={'dropout': key} (Flax's spelling) gets microbatch k's fold_in, as key= does."""
  params, batch = models.mlp_params(), models.linear_regression_data(8)
  key = jax.random.PRNGKey(5) if raw else jax.random.key(5)

  def loss_fn(p, b, *, rngs, scale):
    return models.mlp_loss(p, b) * scale, jax.random.uniform(rngs["dropout"])

  f = optax_accum.microbatched_value_and_grad(loss_fn, K, has_aux=True, aux_mode="stack")
  (_, draws), _ = jax.jit(f)(params, batch, rngs={"dropout": key}, scale=2.0)
  expected = jnp.stack([jax.random.uniform(jax.random.fold_in(key, k)) for k in range(K)])
  chex.assert_trees_all_equal(draws, expected)
