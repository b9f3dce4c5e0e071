"""The in-step helper on a device mesh (optax_accum/_microbatch_mesh.py): the batch cut so that
rows stay on their device, and the one reduction after the scan (counted in the compiled HLO)."""

import _compat
import chex
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import testing

tokens = lambda mb: mb["mask"].sum()

N_DEV = 8
REDUCTIONS = ("all-reduce", "reduce-scatter")


def mlp_loss(p, b):
  """Masked mean squared error of a 2-layer MLP (the loss of each lane's rows)."""
  pred = jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] + p["b"]
  m = b["mask"]
  return (0.5 * (pred - b["y"]) ** 2 * m).sum() / jnp.maximum(m.sum(), 1.0)


def mesh_data(rows=64):
  rng = np.random.default_rng(0)
  mask = rng.integers(0, 2, rows).astype(np.float32)
  mask[: rows // N_DEV] = 0  # device 0 (strided: lane 0 of every microbatch) is all padding
  batch = {
    "x": jnp.asarray(rng.normal(size=(rows, 16)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=(rows,)), jnp.float32),
    "mask": jnp.asarray(mask),
  }
  params = {
    "w1": jnp.asarray(rng.normal(size=(16, 32)) / 4, jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(32,)) / 4, jnp.float32),
    "b": jnp.zeros((), jnp.float32),
  }
  return params, batch


def place_on_mesh(axis_type, layout, params, batch):
  mesh = _compat.make_mesh((N_DEV,), ("data",), axis_types=(axis_type,))
  fsdp = {"w1": P(None, "data"), "w2": P("data"), "b": P()}
  specs = fsdp if layout == "fsdp" else jax.tree.map(lambda _: P(), params)
  params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
  return mesh, params, jax.device_put(batch, NamedSharding(mesh, P("data")))


def reductions(counts, where):
  return sum(counts[where][op] for op in REDUCTIONS)


def test_strided_split_keeps_rows_on_their_device():
  assert len(jax.devices()) == 8
  mesh = _compat.make_mesh((8,), ("data",))
  rows = np.arange(32)
  x = jax.device_put(jnp.asarray(rows), NamedSharding(mesh, P("data")))
  y = jax.jit(lambda x: optax_accum._microbatch_mesh.split_batch(x, 2))(x)
  # Microbatch k is rows k, k+2, ...
  np.testing.assert_array_equal(np.asarray(y), np.stack([rows[0::2], rows[1::2]]))
  for shard in y.addressable_shards:  # each device holds only rows it held before
    own = {r for s in x.addressable_shards if s.device == shard.device for r in np.asarray(s.data)}
    assert set(np.asarray(shard.data).ravel().tolist()) <= own


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
@pytest.mark.parametrize("strided", [True, False])
def test_batch_sharded_over_8_devices(strided, axis_type):
  batch = models.linear_regression_data(32)
  batch["mask"] = jnp.asarray(np.random.default_rng(0).integers(0, 2, 32), jnp.float32)
  params = models.linear_regression_params()
  mesh = _compat.make_mesh((8,), ("data",), axis_types=(axis_type,))
  sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
  replicated = jax.device_put(params, NamedSharding(mesh, P()))
  f = optax_accum.microbatched_value_and_grad(
    models.linear_regression_loss, 2, weight_fn=tokens, strided=strided
  )
  with _compat.set_mesh(mesh):
    loss, grads = jax.jit(f)(replicated, sharded)
  ref = jax.value_and_grad(models.linear_regression_loss)(params, batch)
  chex.assert_trees_all_close((loss, grads), ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
@pytest.mark.slow
def test_jit_axis_name_reduces_once_after_the_scan(axis_type, layout):
  params, batch = mesh_data()
  per_device = np.asarray(batch["mask"]).reshape(N_DEV, -1).sum(1)
  assert per_device[0] == 0 and len(set(per_device.tolist())) > 2  # unequal tokens per device
  ref = jax.value_and_grad(mlp_loss)(params, batch)
  mesh, p_mesh, b_mesh = place_on_mesh(axis_type, layout, params, batch)
  f = optax_accum.microbatched_value_and_grad(mlp_loss, 2, weight_fn=tokens, axis_name="data")
  with _compat.set_mesh(mesh):
    compiled = jax.jit(f).lower(p_mesh, b_mesh).compile()
    counts = testing.count_collectives(compiled.as_text())
    out = compiled(p_mesh, b_mesh)
  assert reductions(counts, "in_loop") == 0, counts
  assert 1 <= reductions(counts, "outside") <= len(jax.tree.leaves(params)) + 2, counts
  chex.assert_trees_all_close(out, ref, rtol=1e-5, atol=1e-6)
  if axis_type == jax.sharding.AxisType.Explicit:  # gradients come back placed like params
    for g, p in zip(jax.tree.leaves(out[1]), jax.tree.leaves(p_mesh), strict=True):
      assert jax.typeof(g).sharding.spec == jax.typeof(p).sharding.spec


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
def test_without_axis_name_the_reduction_is_in_the_loop(axis_type):
  """The counter can fail the test above: the default all-reduces every microbatch."""
  params, batch = mesh_data()
  mesh, p_mesh, b_mesh = place_on_mesh(axis_type, "replicated", params, batch)
  f = optax_accum.microbatched_value_and_grad(mlp_loss, 2, weight_fn=tokens)
  with _compat.set_mesh(mesh):
    counts = testing.count_collectives(jax.jit(f).lower(p_mesh, b_mesh).compile().as_text())
  assert reductions(counts, "in_loop") >= 1, counts


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_axis_name_one_psum_weighted_by_global_tokens(check_vma):
  params, batch = mesh_data()
  ref_loss, ref_grads = jax.value_and_grad(mlp_loss)(params, batch)
  mesh = _compat.make_mesh((N_DEV,), ("data",))
  p_mesh = jax.device_put(params, NamedSharding(mesh, P()))
  b_mesh = jax.device_put(batch, NamedSharding(mesh, P("data")))
  loss_aux = lambda p, b: (mlp_loss(p, b), {"loss": mlp_loss(p, b)})

  def step(axis_name, out_specs):
    f = optax_accum.microbatched_value_and_grad(
      loss_aux, 2, weight_fn=tokens, has_aux=True, axis_name=axis_name
    )
    specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=out_specs, check_vma=check_vma)
    return jax.jit(jax.shard_map(f, **specs))

  compiled = step("data", P()).lower(p_mesh, b_mesh).compile()
  counts = testing.count_collectives(compiled.as_text())
  one = _compat.all_reduces_per_psum(6)  # grads (3 leaves), weight, loss, aux
  assert reductions(counts, "in_loop") == 0 and counts["outside"]["all-reduce"] == one, counts
  (loss, aux), grads = compiled(p_mesh, b_mesh)
  chex.assert_trees_all_close((loss, grads), (ref_loss, ref_grads), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(aux["loss"], ref_loss, rtol=1e-5)
  # Without axis_name each device returns its own rows' mean: device 0 holds no token.
  plain = optax_accum.microbatched_value_and_grad(loss_aux, 2, weight_fn=tokens, has_aux=True)

  def local(p, b):
    p = _compat.pcast_varying(p, "data") if check_vma else p
    (loss, _), _ = plain(p, b)
    return loss[None]

  specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"), check_vma=check_vma)
  local_loss = np.asarray(jax.jit(jax.shard_map(local, **specs))(p_mesh, b_mesh))
  assert float(local_loss[0]) == 0.0 and not np.allclose(local_loss, ref_loss, rtol=1e-3)


def test_axis_name_errors():
  params, batch = mesh_data()
  mesh, p_mesh, b_mesh = place_on_mesh(jax.sharding.AxisType.Auto, "replicated", params, batch)
  f = optax_accum.microbatched_value_and_grad(mlp_loss, 2, axis_name="model")
  with _compat.set_mesh(mesh), pytest.raises(ValueError, match="has no axis \\['model'\\]"):
    jax.jit(f).lower(p_mesh, b_mesh)
  f = optax_accum.microbatched_value_and_grad(mlp_loss, 2, axis_name="data")
  with pytest.raises(ValueError, match="jax.set_mesh"):  # Auto mesh, no set_mesh
    jax.jit(f).lower(p_mesh, b_mesh)
  with _compat.set_mesh(mesh), pytest.raises(ValueError, match="num_microbatches \\* devices"):
    jax.jit(f).lower(p_mesh, jax.tree.map(lambda x: x[:24], b_mesh))  # 24 % (2 * 8)
  g = optax_accum.microbatched_value_and_grad(
    lambda p, b, s: (mlp_loss(p, b), s), 2, has_state=True, axis_name="data"
  )
  with _compat.set_mesh(mesh), pytest.raises(ValueError, match="has_state=True"):
    jax.jit(g).lower(p_mesh, b_mesh, jnp.zeros(()))


def test_jit_axis_name_aux_mean_and_stack_over_lanes():
  params, batch = mesh_data()
  loss_aux = lambda p, b: (mlp_loss(p, b), {"loss": mlp_loss(p, b)})
  mesh, p_mesh, b_mesh = place_on_mesh(jax.sharding.AxisType.Auto, "replicated", params, batch)
  make = lambda mode: optax_accum.microbatched_value_and_grad(
    loss_aux, 2, weight_fn=tokens, has_aux=True, aux_mode=mode, axis_name="data"
  )
  with _compat.set_mesh(mesh):
    (_, mean), _ = jax.jit(make("mean"))(p_mesh, b_mesh)
    (_, stacked), _ = jax.jit(make("stack"))(p_mesh, b_mesh)
  chex.assert_trees_all_close(mean["loss"], mlp_loss(params, batch), rtol=1e-5)
  # Per microbatch: the token-weighted mean over its lanes = the loss of the whole microbatch.
  micro = optax_accum._microbatch_mesh.split_batch(batch, 2)
  per_mb = [mlp_loss(params, jax.tree.map(lambda x, k=k: x[k], micro)) for k in range(2)]
  chex.assert_trees_all_close(stacked["loss"], jnp.stack(per_mb), rtol=1e-5)


def test_jit_axis_name_folds_the_key_with_microbatch_then_lane():
  params, batch = mesh_data()
  key = jax.random.key(3)

  def loss_fn(p, b, key):
    return mlp_loss(p, b), {"draw": jax.random.uniform(key)}

  mesh, p_mesh, b_mesh = place_on_mesh(jax.sharding.AxisType.Auto, "replicated", params, batch)
  f = optax_accum.microbatched_value_and_grad(
    loss_fn, 2, weight_fn=tokens, has_aux=True, axis_name="data"
  )
  with _compat.set_mesh(mesh):
    (_, aux), _ = jax.jit(f)(p_mesh, b_mesh, key=key)
  # By hand: lane d of microbatch k draws with fold_in(fold_in(key, k), d), weighted by tokens.
  mask = np.asarray(batch["mask"]).reshape(N_DEV, -1, 2)  # [device, row, microbatch] (strided)
  draws, weights = [], []
  for k in range(2):
    for d in range(N_DEV):
      draws.append(float(jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, k), d))))
      weights.append(mask[d, :, k].sum())
  expected = np.dot(draws, weights) / np.sum(weights)
  np.testing.assert_allclose(aux["draw"], expected, rtol=1e-5)
  assert len(set(draws)) == len(draws)  # every lane draws its own numbers


def _tutorial_mesh(shape, padded):
  """The Flax miniGPT tutorial's layout on 2 devices: Explicit axes (``jax.make_mesh``'s
  default), params sharded over ``model``, the batch over ``batch``."""
  explicit = jax.sharding.AxisType.Explicit
  mesh = _compat.make_mesh(shape, ("batch", "model"), axis_types=(explicit, explicit))
  params, batch = mesh_data(rows=16)
  if not padded:
    batch["mask"] = jnp.ones_like(batch["mask"])
  specs = {"w1": P(None, "model"), "w2": P("model"), "b": P()}
  params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
  return mesh, params, jax.device_put(batch, NamedSharding(mesh, P("batch")))


def aux_loss(p, b):
  """``(masked mean loss, aux)`` of mlp_loss's MLP, the hidden layer sharded over ``model`` (the
  second layer as a product and a sum: a sharded contraction needs an explicit out_sharding)."""
  pred = (jnp.tanh(b["x"] @ p["w1"]) * p["w2"]).sum(-1) + p["b"]
  m = b["mask"]
  loss = (0.5 * (pred - b["y"]) ** 2 * m).sum() / jnp.maximum(m.sum(), 1.0)
  return loss, {"pred_sum": pred.sum()}


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
@pytest.mark.parametrize("axis_name", [None, "batch"])
def test_explicit_mesh_params_sharded_over_model(shape, axis_name):
  """The carry's zeros are typed and sharded like the gradients: the default weight (rows, a
  constant) and a has_aux loss included, within 1e-6 of jax.value_and_grad on the batch."""
  mesh, params, batch = _tutorial_mesh(shape, padded=False)
  host = jax.device_get((params, batch))
  (loss_ref, aux_ref), g_ref = jax.value_and_grad(aux_loss, has_aux=True)(*host)
  f = optax_accum.microbatched_value_and_grad(aux_loss, 4, has_aux=True, axis_name=axis_name)
  with _compat.set_mesh(mesh):
    (loss, aux), g = jax.jit(f)(params, batch)
  chex.assert_trees_all_close((loss, g), (loss_ref, g_ref), rtol=1e-6, atol=1e-6)
  # aux_mode='mean': the mean of equal pieces' sums, the batch's sum / (K * lanes).
  pieces = 4 * (mesh.shape["batch"] if axis_name else 1)
  np.testing.assert_allclose(aux["pred_sum"], aux_ref["pred_sum"] / pieces, rtol=1e-5)
  for leaf, p in zip(jax.tree.leaves(g), jax.tree.leaves(params), strict=True):
    assert jax.typeof(leaf).sharding.spec == jax.typeof(p).sharding.spec


@pytest.mark.slow
def test_check_equivalence_on_the_tutorial_mesh_with_aux():
  mesh, params, batch = _tutorial_mesh((1, 2), padded=True)
  with _compat.set_mesh(mesh):
    report = testing.check_equivalence(
      aux_loss, params, batch, optax.adam(1e-3), num_microbatches=4, weight_fn=tokens,
      has_aux=True,
    )  # fmt: skip
  report.assert_passed(rtol=1e-6, atol=1e-6)
  assert report.num_updates == 1
  # Computed another way: the mean of the microbatch means differs from the batch's gradient.
  assert report.mean_of_means.max_rel > 1e-3


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
def test_jit_axis_name_aux_sum_and_concat_over_lanes(axis_type):
  """Over 8 lanes: 'sum' is the batch's sum (one reduction with the gradient), 'concat' the
  batch's per-example values in its row order."""
  params, batch = mesh_data()

  def loss_aux(p, b):
    pred = jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] + p["b"]
    return mlp_loss(p, b), {"pred": pred, "tokens": b["mask"].sum(), "rows": b["x"].shape[0]}

  (_, ref), _ = jax.value_and_grad(loss_aux, has_aux=True)(params, batch)
  mesh, p_mesh, b_mesh = place_on_mesh(axis_type, "replicated", params, batch)
  make = lambda mode, loss_fn: optax_accum.microbatched_value_and_grad(
    loss_fn, 2, weight_fn=tokens, has_aux=True, aux_mode=mode, axis_name="data"
  )
  sums_only = lambda p, b: (
    loss_aux(p, b)[0],
    {k: loss_aux(p, b)[1][k] for k in ("tokens", "rows")},
  )  # noqa: E501
  pred_only = lambda p, b: (loss_aux(p, b)[0], loss_aux(p, b)[1]["pred"])
  with _compat.set_mesh(mesh):
    compiled = jax.jit(make("sum", sums_only)).lower(p_mesh, b_mesh).compile()
    (_, sums), _ = compiled(p_mesh, b_mesh)
    (_, pred), _ = jax.jit(make("concat", pred_only))(p_mesh, b_mesh)
  assert reductions(testing.count_collectives(compiled.as_text()), "in_loop") == 0
  assert int(sums["rows"]) == ref["rows"] == 64
  np.testing.assert_array_equal(sums["tokens"], ref["tokens"])
  np.testing.assert_allclose(pred, ref["pred"], rtol=1e-6, atol=1e-6)
