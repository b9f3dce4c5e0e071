"""Sharded states under jax.jit: placement, equality with one device, no gathered accumulator.

Eight fake CPU devices as a 4 x 2 ('data', 'model') mesh. Layouts: data parallel
(replicated params, batch sharded over 'data') and FSDP (params sharded over
'data'). Mesh modes: an Auto-axes Mesh without a mesh context, the same under
jax.set_mesh, and an Explicit mesh from jax.make_mesh.
"""

import contextlib
import re

import _compat
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import testing

SHAPE = (4, 2)
AXES = ("data", "model")
LAYOUTS = {
  "dp": {"w": P(), "b": P()},
  "fsdp": {"w": P("data", None), "b": P("model")},
}
MODES = ["auto", "auto_set_mesh", "explicit"]


def make_mesh(mode):
  if mode == "explicit":
    return _compat.make_mesh(SHAPE, AXES, axis_types=(AxisType.Explicit,) * 2)
  return Mesh(np.array(jax.devices()).reshape(SHAPE), AXES, axis_types=(AxisType.Auto,) * 2)


def mesh_context(mode, mesh):
  return _compat.set_mesh(mesh) if mode == "auto_set_mesh" else contextlib.nullcontext()


def make_params(mesh, layout, dtype=jnp.float32):
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(8, 4)), "b": rng.normal(size=(4,))}
  params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
  return jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in LAYOUTS[layout].items()})


def assert_placed_like(tree, params):
  for name, p in params.items():
    assert tree[name].sharding.is_equivalent_to(p.sharding, p.ndim), (name, tree[name].sharding)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_init_sharded_places_every_param_shaped_leaf_like_its_param(mode, layout):
  mesh = make_mesh(mode)
  params = make_params(mesh, layout, jnp.bfloat16)
  tx = optax_accum.accumulate(optax.adamw(1e-3), every_k=4)
  with mesh_context(mode, mesh):
    state = optax_accum.sharding.init_sharded(tx, params)
  for tree in (state.window.grad_sum, state.inner_state[0].mu, state.inner_state[0].nu):
    assert_placed_like(tree, params)
  chex.assert_trees_all_equal(
    state.window.grad_sum, jax.tree.map(lambda p: jnp.zeros(p.shape), params)
  )
  assert state.window.grad_sum["w"].dtype == jnp.float32  # float32 accumulator of bf16 params
  for scalar in (state.mini_step, state.window.weight_sum, state.inner_state[0].count):
    assert scalar.sharding.is_fully_replicated and scalar.sharding.mesh == mesh


@pytest.mark.parametrize(
  "mode",
  [
    "auto",
    "auto_set_mesh",
    "explicit",
    "explicit_set_mesh",
  ],
)
def test_jitted_init_places_the_accumulator_like_the_params(mode):
  mesh = make_mesh(mode.removesuffix("_set_mesh"))
  params = make_params(mesh, "fsdp", jnp.bfloat16)
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=4)
  ctx = _compat.set_mesh(mesh) if mode.endswith("set_mesh") else contextlib.nullcontext()
  with ctx:
    state = jax.jit(tx.init)(params)
  assert_placed_like(state.window.grad_sum, params)


def loss_fn(params, batch):
  """Masked mean squared error of a linear model; weight = unmasked rows."""
  err = batch["x"] @ params["w"] + params["b"] - batch["y"]
  per_row = 0.5 * jnp.sum(err**2, axis=-1)
  return jnp.sum(jnp.where(batch["mask"], per_row, 0.0)) / jnp.sum(batch["mask"])


def make_batches(n, rows=16, seed=1):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    mask = np.arange(rows) < rows - 3 * i  # 16, 13, 10, 7 valid rows
    out.append(
      {
        "x": rng.normal(size=(rows, 8)).astype(np.float32),
        "y": rng.normal(size=(rows, 4)).astype(np.float32),
        "mask": mask,
      }
    )
  return out


def make_train_step(tx):
  def step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, weight=jnp.sum(batch["mask"]))
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(chex.assert_max_traces(step, n=1))


def make_tx():
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
  return optax_accum.accumulate(inner, every_k=2)


@pytest.fixture(scope="module")
def single_device_run():
  """The reference: the same four microbatches with everything on one device."""
  tx = make_tx()
  chex.clear_trace_counter()
  out = {}
  for layout in LAYOUTS:
    params = jax.device_put(make_params(make_mesh("auto"), layout), jax.devices()[0])
    opt_state = jax.device_put(tx.init(params), jax.devices()[0])  # committed, like params
    out[layout] = (params, opt_state)
  step = make_train_step(tx)
  for batch in make_batches(4):
    out = {k: step(*v, batch) for k, v in out.items()}
  return out


@pytest.mark.parametrize(
  ("mode", "layout"), [("auto", "dp"), ("auto", "fsdp"), ("explicit", "dp"), ("explicit", "fsdp")]
)
def test_sharded_run_equals_single_device_run(mode, layout, single_device_run):
  batches = make_batches(4)
  tx = make_tx()
  chex.clear_trace_counter()
  mesh = make_mesh(mode)
  params = make_params(mesh, layout)
  opt_state = optax_accum.sharding.init_sharded(tx, params)
  step = make_train_step(tx)
  batch_sharding = NamedSharding(mesh, P("data"))
  for batch in batches:
    params, opt_state = step(params, opt_state, jax.device_put(batch, batch_sharding))
  assert_placed_like(opt_state.window.grad_sum, params)
  assert_placed_like(opt_state.inner_state[1][0].mu, params)  # chain(clip, adamw)
  assert int(opt_state.num_updates) == 2
  expected = single_device_run[layout]
  chex.assert_trees_all_close((params, opt_state), expected, rtol=1e-5, atol=1e-6)


def test_fsdp_update_never_gathers_the_accumulator():
  """Between boundaries no collective; at the boundary only scalar all-reduces (norm, finite)."""
  mesh = make_mesh("auto")
  params = make_params(mesh, "fsdp")
  tx = make_tx()
  opt_state = optax_accum.sharding.init_sharded(tx, params)

  def update(grads, opt_state, params, weight):
    return tx.update(grads, opt_state, params, weight=weight)

  compiled = jax.jit(update).lower(params, opt_state, params, jnp.float32(3)).compile()
  counts = testing.count_collectives(compiled.as_text())
  assert sum(counts["outside"].values()) == 0, counts
  assert set(counts["in_conditional"]) <= {"all-reduce"}, counts
  _, new_state = compiled(params, opt_state, params, jnp.float32(3))
  assert_placed_like(new_state.window.grad_sum, params)
  for line in compiled.as_text().splitlines():  # the boundary reduces scalars only
    if re.search(r" all-reduce(-start)?\(", line):
      types = line.split(" = ", 1)[1].split(" all-reduce", 1)[0]
      for dims in re.findall(r"\[([\d,]*)\]", types):
        assert np.prod([int(d) for d in dims.split(",") if d]) <= 1, line


def test_plain_jit_with_a_sharded_batch_all_reduces_every_microstep():
  """Why the shard_map recipe exists: jit reduces the replicated params' gradient per step."""
  mesh = make_mesh("auto")
  params = make_params(mesh, "dp")
  tx = make_tx()
  opt_state = optax_accum.sharding.init_sharded(tx, params)
  batch = jax.device_put(make_batches(1)[0], NamedSharding(mesh, P("data")))
  text = make_train_step(tx).lower(params, opt_state, batch).compile().as_text()
  assert testing.count_collectives(text)["outside"]["all-reduce"] >= 1


def test_stack_windows_with_an_unknown_axis_names_the_mesh_axes():
  """Issue 11, item 7: an unknown axis raised a bare KeyError('model')."""
  mesh = _compat.make_mesh((8,), ("data",))
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, axis_name="data")
  state = tx.init({"w": jnp.zeros(3)})
  for axis in ("model", ("data", "model")):
    with pytest.raises(KeyError, match=r"names no axis of the mesh.*the mesh has axes \('data',\)"):
      optax_accum.sharding.stack_windows(state, mesh, axis)


def test_local_state_on_an_unstacked_state_says_what_to_pass():
  """Issue 11, item 7: a state without the device axis raised IndexError on its 0-d weight_sum."""
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, axis_name="data")
  state = tx.init({"w": jnp.zeros(3)})
  with pytest.raises(
    ValueError, match=r"local_state: the window sums have no device axis.*stack_windows"
  ):
    optax_accum.sharding.local_state(state)
  block = optax_accum.sharding.stacked_state(state)  # the shard_map block of a stacked state
  assert optax_accum.sharding.local_state(block).window.grad_sum["w"].shape == (3,)
