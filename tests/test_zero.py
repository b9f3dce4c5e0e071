"""optax_accum/_zero.py: ZeRO-1 at the window boundary (issue 39), on eight fake CPU devices.

``accumulate(..., axis_name="data", shard_optimizer=True)`` against the replicated run of the same
recipe (``shard_optimizer=False``), whose equivalence to one physical batch tests/test_vma.py
shows: the params agree within 1e-6 over several windows with a flush and a skipped non-finite
window; each device holds 1/8 of the inner state (plus padding); the compiled step has one
reduce-scatter and one all-gather in the boundary and no parameter-sized all-reduce.
"""

import math

import _compat
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import testing
from optax_accum._zero import ShardError

AXIS, N_DEV, TOKENS = "data", 8, 4


def loss_fn(params, batch):
  pred = batch["x"] @ params["w"] + params["b"] + params["s"]
  per_token = 0.5 * jnp.sum((pred - batch["y"]) ** 2, axis=-1)
  return jnp.sum(jnp.where(batch["mask"], per_token, 0.0)) / jnp.maximum(batch["mask"].sum(), 1)


def make_params(mesh):
  """Leaves whose sizes do not divide by 8 (15 and 3): padded shards; a scalar leaf: whole."""
  rng = np.random.default_rng(1)
  params = {
    "w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32),
    "b": jnp.zeros(3),
    "s": jnp.asarray(0.5, jnp.float32),
  }
  return jax.device_put(params, NamedSharding(mesh, P()))


def make_data(steps, seed=0, nan_at=None):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(steps):
    x = rng.normal(size=(N_DEV * TOKENS, 5)).astype(np.float32)
    if nan_at == i:
      x[3, 0] = np.nan  # one device's microbatch: a non-finite window
    y = rng.normal(size=(N_DEV * TOKENS, 3)).astype(np.float32)
    mask = rng.random(N_DEV * TOKENS) < 0.7
    out.append({"x": x, "y": y, "mask": mask})
  return out


def make_step(tx, mesh, specs):
  def body(params, opt_state, batch, flush):
    opt_state = optax_accum.sharding.local_state(opt_state)
    local = _compat.pcast_varying(params, AXIS)
    grads = jax.grad(loss_fn)(local, batch)
    params, opt_state = optax_accum.update_and_apply(
      tx, grads, opt_state, params, weight=batch["mask"].sum(), flush=flush
    )
    return params, optax_accum.sharding.stacked_state(opt_state)

  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(AXIS), P()), out_specs=(P(), specs))
  )


def run(inner, shard, data, flush_at=(), every_k=3):
  mesh = jax.make_mesh((N_DEV,), (AXIS,))
  params = make_params(mesh)
  tx = optax_accum.accumulate(inner, every_k, axis_name=AXIS, shard_optimizer=shard)
  state = optax_accum.sharding.init_sharded(tx, params, AXIS)
  step = make_step(tx, mesh, optax_accum.sharding.window_specs(state, AXIS))
  for i, b in enumerate(data):
    b = jax.device_put(b, NamedSharding(mesh, P(AXIS)))
    params, state = step(params, state, b, jnp.asarray(i in flush_at))
  return params, state, (step, b)


INNERS = {
  "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(0.05, 0.9)),
  "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
  "lion_schedule": lambda: optax.lion(optax.linear_schedule(0.01, 0.001, 5)),
  "lamb": lambda: optax.lamb(0.01),  # per-leaf norms: whole-leaf reductions
}


@pytest.mark.parametrize("name", sorted(INNERS))
@pytest.mark.slow
def test_sharded_inner_equals_the_replicated_run(name):
  """Windows of 3, a flush after microbatch 4 (a window of 2), a NaN window, more windows."""
  data = make_data(11, nan_at=6)
  ref, ref_state, _ = run(INNERS[name](), False, data, flush_at=(4,))
  got, state, _ = run(INNERS[name](), True, data, flush_at=(4,))
  chex.assert_trees_all_close(got, ref, rtol=1e-6, atol=1e-6)
  m, m_ref = optax_accum.metrics(state), optax_accum.metrics(ref_state)
  assert (int(m.num_updates), int(m.num_skipped)) == (int(m_ref.num_updates), 1)
  assert int(m.num_updates) == 3  # [0-2], [3-4] flushed, [5-7] skipped, [8-10]
  np.testing.assert_allclose(m.grad_norm, m_ref.grad_norm, rtol=1e-6)
  assert_state_finite(state)


def test_inner_state_bytes_per_device_are_one_eighth():
  data = make_data(3)
  _, replicated, _ = run(optax.adam(0.01), False, data)
  _, sharded, _ = run(optax.adam(0.01), True, data)
  per_device = lambda tree: sum(
    x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
  )  # one device's bytes
  rep, shd = per_device(replicated.inner_state), per_device(sharded.inner_state)
  sizes = [15, 3]  # w, b: mu and nu of each, float32, padded to a multiple of 8; s whole
  assert rep == 2 * 4 * (sum(sizes) + 1) + 4  # + Adam's int32 count
  assert shd == 2 * 4 * (sum(math.ceil(s / N_DEV) for s in sizes) + 1) + 4
  assert shd < rep / 4


def test_one_reduce_scatter_and_one_all_gather_per_window():
  data = make_data(1)
  params, state, (step, batch) = run(optax.adamw(0.01), True, data)
  text = step.lower(params, state, batch, jnp.asarray(False)).compile().as_text()
  counts = testing.count_collectives(text)
  assert counts["outside"] == {} and counts["in_loop"] == {}
  inside = counts["in_conditional"]
  assert (inside["reduce-scatter"], inside["all-gather"]) == (1, 1)
  # One psum of the window's scalars: the weight, the loss's two sums, the shards' squares and
  # non-finite count, and the scalar leaf s (kept whole): 6 arrays (JAX 0.7: 6 all-reduces).
  assert inside["all-reduce"] == _compat.all_reduces_per_psum(6)
  for line in text.splitlines():  # no parameter-sized all-reduce anywhere
    if " all-reduce(" in line:
      assert all(s in ("[]", "") for s in _shapes(line.split(" all-reduce(")[0])), line
  bytes_by_kind = testing.count_collectives(text, unit="bytes")["in_conditional"]
  replicated = run(optax.adamw(0.01), False, data)
  text_r = replicated[2][0].lower(replicated[0], replicated[1], batch, jnp.asarray(False))
  r_bytes = testing.count_collectives(text_r.compile().as_text(), unit="bytes")["in_conditional"]
  # A ring all-reduce moves a reduce-scatter's and an all-gather's bytes: the same traffic.
  moved = bytes_by_kind["reduce-scatter"] + bytes_by_kind["all-gather"]
  assert moved <= 2 * r_bytes["all-reduce"] * 1.01


def _shapes(lhs: str) -> list[str]:
  import re

  return re.findall(r"\[([\d,]*)\]", lhs.split("=", 1)[-1]) or [""]


def _cumsum_sgd():
  """An inner optimizer whose update is a cumulative sum: a primitive (``cumsum``) outside the
  interpreter's tables, as a primitive a new JAX release adds would be."""
  return optax.GradientTransformation(
    lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree.map(jnp.cumsum, u), s)
  )


@pytest.mark.parametrize(
  "inner, match",
  [
    (
      lambda: optax.adafactor(1e-2, min_dim_size_to_factor=128),
      r"applies 'reduce_sum', which reduces over some axes",
    ),
    (_cumsum_sgd, r"applies 'cumsum', which moves elements between positions"),
  ],
  ids=["factored_adafactor", "unknown_primitive"],
)
def test_an_inner_optimizer_that_couples_elements_is_refused(inner, match):
  """Factored adafactor reduces a gradient over one axis, and a primitive the interpreter does
  not know (issue 48, item 4: experimental, it reads JAX's primitive names) is refused by name
  when the step is traced, never evaluated on shards."""
  mesh = jax.make_mesh((N_DEV,), (AXIS,))
  params = jax.device_put({"w": jnp.zeros((128, 128))}, NamedSharding(mesh, P()))
  tx = optax_accum.accumulate(inner(), 2, axis_name=AXIS, shard_optimizer=True)
  state = optax_accum.sharding.init_sharded(tx, params, AXIS)
  specs = optax_accum.sharding.window_specs(state, AXIS)

  def body(p, s):
    s = optax_accum.sharding.local_state(s)
    g = _compat.pcast_varying(p, AXIS)
    return optax_accum.update_and_apply(tx, g, s, p, flush=True)[0]

  step = jax.shard_map(body, mesh=mesh, in_specs=(P(), specs), out_specs=P())
  with pytest.raises(ShardError, match=match):
    jax.jit(step)(params, state)


def test_bad_spellings_name_the_recipe():
  with pytest.raises(ValueError, match=r"shard_optimizer=True .* no axis_name"):
    optax_accum.accumulate(optax.adam(0.1), 2, shard_optimizer=True)
  with pytest.raises(TypeError, match="shard_optimizer must be True or False"):
    optax_accum.accumulate(optax.adam(0.1), 2, axis_name=AXIS, shard_optimizer=1)
  tx = optax_accum.accumulate(optax.adam(0.1), 2, axis_name=AXIS, shard_optimizer=True)
  with pytest.raises(ValueError, match=r"inside jax.shard_map .*init_sharded"):
    tx.init({"w": jnp.zeros(3)})
  with pytest.raises(ValueError, match="per-leaf rules"):
    optax_accum.accumulate(
      optax.adam(0.1),
      2,
      axis_name=AXIS,
      shard_optimizer=True,
      aggregate=optax_accum.aggregate(reduce="max"),
    )


def test_a_replicated_state_into_a_sharded_configuration_is_named():
  data = make_data(2)
  mesh = jax.make_mesh((N_DEV,), (AXIS,))
  params = make_params(mesh)
  _, replicated, _ = run(optax.adam(0.01), False, data)
  sharded = optax_accum.accumulate(optax.adam(0.01), 3, axis_name=AXIS, shard_optimizer=True)
  with pytest.raises(ValueError, match=r"inner_state\.inner\..*missing from the restored state"):
    optax_accum.sharding.check_compatible(sharded, params, replicated, stacked=True)


def test_a_mid_window_checkpoint_resumes_bitwise_and_another_device_count_is_refused(tmp_path):
  """Orbax saves the sharded inner state and the windows mid-window; a restore continues
  bitwise; a checkpoint written on 8 devices is refused on 4, naming why."""
  import orbax.checkpoint as ocp

  data = make_data(9, seed=5)
  inner = optax.adamw(0.05)
  straight, _, _ = run(inner, True, data)
  mesh = jax.make_mesh((N_DEV,), (AXIS,))
  params = make_params(mesh)
  tx = optax_accum.accumulate(inner, 3, axis_name=AXIS, shard_optimizer=True)
  state = optax_accum.sharding.init_sharded(tx, params, AXIS)
  specs = optax_accum.sharding.window_specs(state, AXIS)
  step = make_step(tx, mesh, specs)
  place = lambda b: jax.device_put(b, NamedSharding(mesh, P(AXIS)))
  for b in data[:4]:  # a window and one microbatch of the next
    params, state = step(params, state, place(b), jnp.asarray(False))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "ckpt", state)
    ckptr.wait_until_finished()
    meta = ckptr.metadata(tmp_path / "ckpt").item_metadata.tree
    target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    restored = ckptr.restore(tmp_path / "ckpt", target)
  optax_accum.sharding.check_compatible(tx, params, restored, stacked=True)
  for b in data[4:]:
    params, restored = step(params, restored, place(b), jnp.asarray(False))
  chex.assert_trees_all_equal(params, straight)
  four = jax.make_mesh((4,), (AXIS,), devices=jax.devices()[:4])
  params4 = jax.device_put(jax.device_get(params), NamedSharding(four, P()))
  with pytest.raises(ValueError, match=r"written on another number of devices"):
    optax_accum.sharding.check_compatible(tx, params4, meta, stacked=True)


@pytest.mark.skipif(not hasattr(jax.lax, "pcast"), reason="HSDP sharding of the pieces: jax >= 0.8")
@pytest.mark.slow
def test_hsdp_shards_the_inner_state_over_replica_and_fsdp():
  """replica 2 x fsdp 4, manual over replica: the params equal the replicated HSDP run's, and
  each device holds 1/8 of Adam's moments (the HSDP recipe alone: 1/4)."""
  from jax.sharding import AxisType

  mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), axis_types=(AxisType.Explicit, AxisType.Auto))
  placement = {"w": NamedSharding(mesh, P("fsdp", None)), "b": NamedSharding(mesh, P())}
  params0 = {"w": jnp.arange(128.0).reshape(16, 8) / 100, "b": jnp.zeros(8)}

  def loss(params, batch):
    err = ((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2).mean(axis=-1)
    return (err * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1)

  rng = np.random.default_rng(0)
  batches = [
    jax.device_put(
      {"x": rng.normal(size=(32, 16)).astype(np.float32),
       "y": rng.normal(size=(32, 8)).astype(np.float32),
       "mask": (rng.random(32) < 0.7).astype(np.float32)},
      NamedSharding(mesh, P(("replica", "fsdp"))),
    )
    for _ in range(8)
  ]  # fmt: skip
  out = {}
  for shard in (False, True):
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    tx = optax_accum.accumulate(inner, 4, axis_name="replica", shard_optimizer=shard)
    params = jax.device_put(params0, placement)
    if shard:
      state = optax_accum.sharding.init_sharded(tx, params, "replica")
    else:
      state = optax_accum.sharding.init_sharded(tx, params)
      state = optax_accum.sharding.stack_windows(state, mesh, "replica")
    specs = optax_accum.sharding.window_specs(state, "replica")

    def body(params, state, batch, tx=tx):
      state = optax_accum.sharding.local_state(state)
      local = _compat.pcast_varying(params, "replica")
      grads = jax.grad(loss)(local, batch)
      params, state = optax_accum.update_and_apply(
        tx, grads, state, params, weight=batch["mask"].sum()
      )
      return params, optax_accum.sharding.stacked_state(state)

    step = jax.jit(
      jax.shard_map(
        body,
        mesh=mesh,
        axis_names={"replica"},
        in_specs=(P(), specs, P("replica")),
        out_specs=(P(), specs),
      )
    )
    for b in batches:
      params, state = step(params, state, b)
    inner_state = state.inner_state.inner if shard else state.inner_state
    mu = inner_state[1][0].mu["w"]
    out[shard] = (params, mu.addressable_shards[0].data.size)
  chex.assert_trees_all_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-7)
  assert (out[False][1], out[True][1]) == (128 // 4, 128 // 8)
