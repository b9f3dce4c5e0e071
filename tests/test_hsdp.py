"""HSDP on 8 devices: replica 2 x fsdp 4, params FSDP-sharded, one replica reduction per window.

The documented spelling (docs/scaling.md, "HSDP"): a partial-manual ``jax.shard_map`` over
``replica`` with ``fsdp`` left to the compiler (an Auto axis), ``accumulate(axis_name='replica')``
and a state from ``init_sharded`` + ``stack_windows``. The compiled step is read with
``count_collectives(mesh=)``; the updates are checked against one device accumulating the
global batch.
"""

import _compat
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _markdown import ROOT, section_blocks
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.testing import count_collectives

R, F, K = 2, 4, 4
ROWS = 32  # per microbatch: 4 per device


def loss_fn(params, batch):  # MEAN over the unmasked rows
  err = ((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2).mean(axis=-1)
  return (err * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1)


def make_data(steps):
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(16, 8)).astype(np.float32), "b": np.zeros(8, np.float32)}
  batches = [
    {
      "x": rng.normal(size=(ROWS, 16)).astype(np.float32),
      "y": rng.normal(size=(ROWS, 8)).astype(np.float32),
      "mask": (rng.random(ROWS) < 0.7).astype(np.float32),
    }
    for _ in range(steps)
  ]
  return params, batches


def hsdp_mesh():
  return _compat.make_mesh(
    (R, F), ("replica", "fsdp"), axis_types=(AxisType.Explicit, AxisType.Auto)
  )


def place(mesh, params, batch):
  shardings = {"w": NamedSharding(mesh, P("fsdp", None)), "b": NamedSharding(mesh, P())}
  data = NamedSharding(mesh, P(("replica", "fsdp")))
  return jax.device_put(params, shardings), jax.device_put(batch, data)


def across_step(mesh, params):
  tx = optax_accum.accumulate(optax.adam(0.05), every_k=K, axis_name="replica")
  opt_state = optax_accum.sharding.init_sharded(tx, params)
  opt_state = optax_accum.sharding.stack_windows(opt_state, mesh, "replica")
  specs = optax_accum.sharding.window_specs(opt_state, "replica")

  def local_step(params, opt_state, batch):
    opt_state = optax_accum.sharding.local_state(opt_state)
    local = _compat.pcast_varying(params, "replica")
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    weight = batch["mask"].sum()
    updates, opt_state = tx.update(grads, opt_state, params, weight=weight, value=loss)
    return updates, optax_accum.sharding.stacked_state(opt_state)

  step = jax.shard_map(
    local_step,
    mesh=mesh,
    in_specs=(P(), specs, P("replica")),
    out_specs=(P(), specs),
    axis_names={"replica"},
  )
  return jax.jit(step), opt_state


def flat_updates(params, batches):
  """One device, no axis_name, the same global microbatches: the data-parallel reference."""
  tx = optax_accum.accumulate(optax.adam(0.05), every_k=K)
  opt_state, out = tx.init(params), []
  for batch in batches:
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, weight=batch["mask"].sum())
    params = optax.apply_updates(params, updates)
    out.append(updates)
  return out


def rel(x, ref):
  num = sum(
    float(jnp.sum((a - b) ** 2))
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(ref), strict=True)
  )
  den = sum(float(jnp.sum(b**2)) for b in jax.tree.leaves(ref))
  return (num / den) ** 0.5


def by_axis(counter, axis):
  return sum(n for (_, axes), n in counter.items() if axis in axes)


def test_across_step_reduces_over_replica_once_per_window():
  mesh = hsdp_mesh()
  params, batches = make_data(1)
  params, batch = place(mesh, params, batches[0])
  step, opt_state = across_step(mesh, params)
  text = step.lower(params, opt_state, batch).compile().as_text()
  counts = count_collectives(text, mesh)
  assert by_axis(counts["outside"], "replica") == 0, counts  # between boundaries: none
  assert by_axis(counts["in_loop"], "replica") == 0, counts
  replica = {k: n for k, n in counts["in_conditional"].items() if "replica" in k[1]}
  # one psum of weight_sum, the two gradient sums, value_sum and value_weight: one variadic
  # all-reduce (five on JAX 0.7, which does not combine them)
  assert replica == {("all-reduce", ("replica",)): _compat.all_reduces_per_psum(5)}, counts
  # fsdp stays per microbatch: the forward gathers w, the backward reduces its gradient.
  fsdp = {k: n for k, n in counts["outside"].items() if k[1] == ("fsdp",)}
  assert fsdp.get(("all-gather", ("fsdp",)), 0) >= 1, counts
  assert fsdp.get(("all-reduce", ("fsdp",)), 0) + fsdp.get(("reduce-scatter", ("fsdp",)), 0) >= 1
  # What crosses replica: w's sum sharded 1/fsdp, b's, weight_sum, value_sum, value_weight.
  data = count_collectives(text, mesh, unit="bytes")["in_conditional"]
  assert data[("all-reduce", ("replica",))] == 4 * (16 * 8 // F + 8 + 3)
  assert opt_state.window.grad_sum["w"].sharding.spec == P("replica", "fsdp", None)


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_across_step_updates_equal_the_flat_data_parallel_run():
  mesh = hsdp_mesh()
  params0, batches = make_data(2 * K)
  params, _ = place(mesh, params0, batches[0])
  step, opt_state = across_step(mesh, params)
  expected = flat_updates(jax.tree.map(jnp.asarray, params0), batches)
  for i, batch in enumerate(batches):
    updates, opt_state = step(params, opt_state, place(mesh, params0, batch)[1])
    if (i + 1) % K:
      assert all(not np.any(u) for u in jax.tree.leaves(updates))  # exact zeros
    else:
      assert rel(updates, expected[i]) < 1e-6, (i, rel(updates, expected[i]))
      assert np.abs(expected[i]["w"]).min() > 1e-3  # a real update
    params = optax.apply_updates(params, updates)
  assert int(opt_state.num_updates) == 2
  assert params["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 2)


@pytest.mark.parametrize("spelling", ["shard_map", "jit"])
def test_in_step_reduces_over_replica_once_per_step(spelling):
  """``microbatched_value_and_grad(axis_name='replica')``: the gradient of the whole batch."""
  mesh = hsdp_mesh()
  params0, batches = make_data(1)
  params, batch = place(mesh, params0, batches[0])
  value_and_grad = optax_accum.microbatched_value_and_grad(
    loss_fn, K, weight_fn=lambda mb: mb["mask"].sum(), axis_name="replica"
  )
  if spelling == "shard_map":
    f = jax.shard_map(
      value_and_grad,
      mesh=mesh,
      in_specs=(P(), P("replica")),
      out_specs=(P(), P()),
      axis_names={"replica"},
    )
  else:
    f = value_and_grad
  with _compat.set_mesh(mesh):
    compiled = jax.jit(f).lower(params, batch).compile()
    loss, grads = compiled(params, batch)
  counts = count_collectives(compiled.as_text(), mesh)
  assert by_axis(counts["in_loop"], "replica") == 0, counts
  # one psum of the value, the two gradients and the weight (four all-reduces on JAX 0.7)
  assert counts["outside"][("all-reduce", ("replica",))] == _compat.all_reduces_per_psum(4)
  assert by_axis(counts["outside"], "replica") == _compat.all_reduces_per_psum(4), counts
  assert by_axis(counts["in_loop"], "fsdp") >= 1, counts  # the fsdp reduction per microbatch
  # K strided microbatches weighted by their unmasked rows are the global batch's mean loss.
  ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params0, batches[0])
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  assert rel(grads, ref_grads) < 1e-6


def docs_hsdp_block() -> dict:
  """Runs docs/scaling.md's one Python block of its HSDP section; returns its namespace."""
  blocks = section_blocks(ROOT / "docs" / "scaling.md", "HSDP")
  assert len(blocks) == 1, len(blocks)
  namespace = {"__name__": "docs_hsdp"}
  exec(compile(blocks[0], "docs/scaling.md, HSDP block", "exec"), namespace)
  return namespace


@_compat.requires(jax.lax, "pcast", "JAX 0.8")  # the page spells jax.lax.pcast
@pytest.mark.slow
def test_docs_hsdp_block_reduces_over_replica_once_per_window_and_equals_one_device():
  ns = docs_hsdp_block()
  mesh, k, train_step = ns["mesh"], ns["K"], ns["train_step"]
  params, opt_state, batch = ns["params"], ns["opt_state"], ns["batch"]
  assert dict(mesh.shape) == {"replica": 2, "fsdp": 4} and k == 4
  assert int(optax_accum.metrics(opt_state).mini_step) == 1  # the block ran one microstep

  text = train_step.lower(params, opt_state, batch).compile().as_text()
  counts = count_collectives(text, mesh)
  assert by_axis(counts["outside"], "replica") == 0, counts  # a non-boundary microstep: none
  assert by_axis(counts["in_loop"], "replica") == 0, counts
  replica = {key: n for key, n in counts["in_conditional"].items() if "replica" in key[1]}
  # the window sums of w and b, the weight, value and value-weight sums in one psum
  assert replica == {("all-reduce", ("replica",)): _compat.all_reduces_per_psum(5)}, counts
  assert counts["outside"][("all-gather", ("fsdp",))] >= 1, counts  # fsdp: every microstep
  fsdp_reductions = [("all-reduce", ("fsdp",)), ("reduce-scatter", ("fsdp",))]
  assert sum(counts["outside"][key] for key in fsdp_reductions) >= 1, counts
  data = count_collectives(text, mesh, unit="bytes")["in_conditional"]
  shard = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
  assert data[("all-reduce", ("replica",))] == shard + 3 * 4  # 3 float32 scalars

  # Two windows from the block's state (one microbatch in) vs one device on the global batch.
  params0 = jax.tree.map(np.asarray, params)
  rng = np.random.default_rng(1)
  host = [jax.tree.map(np.asarray, batch)]
  host += [jax.tree.map(lambda x: rng.permutation(x), host[0]) for _ in range(2 * k - 1)]
  for b in host[1:]:
    params, opt_state = train_step(params, opt_state, jax.device_put(b, batch["x"].sharding))
  ref_tx = optax_accum.accumulate(ns["inner"], every_k=k)
  ref_params = jax.tree.map(jnp.asarray, params0)
  ref_state = ref_tx.init(ref_params)
  for b in host:
    loss, grads = jax.value_and_grad(ns["loss_fn"])(ref_params, b)
    updates, ref_state = ref_tx.update(grads, ref_state, ref_params, weight=b["mask"].sum())
    ref_params = optax.apply_updates(ref_params, updates)
  assert int(opt_state.num_updates) == int(ref_state.num_updates) == 2
  assert rel(params, ref_params) < 1e-6, rel(params, ref_params)
  assert np.abs(params["w"] - params0["w"]).min() > 1e-3  # every weight moved
  adam, ref_adam = opt_state.inner_state[0], ref_state.inner_state[0]  # the averaged gradients
  assert rel(adam.mu, ref_adam.mu) < 1e-6 and rel(adam.nu, ref_adam.nu) < 1e-6
  assert params["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 2)
