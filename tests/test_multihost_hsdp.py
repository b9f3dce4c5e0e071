"""HSDP across two processes: each process one replica, its own 4 CPU devices the ``fsdp`` axis.

Two processes on localhost (``jax.distributed``, CPU collectives over gloo) run the
docs/scaling.md HSDP recipe (a partial-manual ``jax.shard_map`` over ``replica``, ``fsdp``
left to the compiler, ``accumulate(axis_name='replica')``) on a ``replica`` 2 x ``fsdp`` 4 mesh
whose ``replica`` axis is the process. Each feeds only its own devices' rows of the same global
microbatches. Both must end with bitwise-identical params, equal to one process accumulating
the global batch without ``axis_name``.

Mid-window (after microbatch 6 of 8, ``every_k=4``) they write one Orbax checkpoint together;
this process (8 devices, one process) restores it into the same mesh shape and continues: its
final params equal the two processes' within 1e-6 (measured: not bitwise, the last window's
all-reduce over ``replica`` now runs inside one process, not over gloo).
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _processes import run_workers

import optax_accum

LOCAL_DEVICES = 4
TIMEOUT_S = 120

COMMON = textwrap.dedent(
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import optax_accum
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

  K, STEPS, SAVE_AFTER = 4, 8, 6  # two windows; the checkpoint is mid-window
  ROWS = 32  # per microbatch: 4 per device

  def loss_fn(params, batch):  # MEAN over the unmasked rows
    err = ((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2).mean(axis=-1)
    return (err * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1)

  def make_data():
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(16, 8)).astype(np.float32), "b": np.zeros(8, np.float32)}
    batches = [{"x": rng.normal(size=(ROWS, 16)).astype(np.float32),
                "y": rng.normal(size=(ROWS, 8)).astype(np.float32),
                "mask": (rng.random(ROWS) < 0.7).astype(np.float32)} for _ in range(STEPS)]
    return params, batches

  def make_tx(axis_name=None):
    return optax_accum.accumulate(optax.adam(0.05), every_k=K, axis_name=axis_name)

  def hsdp_mesh():
    # Devices ordered by process: each row (a replica) is one process's devices.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(2, len(devices) // 2)
    return Mesh(grid, ("replica", "fsdp"), axis_types=(AxisType.Explicit, AxisType.Auto))

  def global_array(mesh, x, spec):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

  PARAM_SPECS = {"w": P("fsdp", None), "b": P()}

  def place_params(mesh, params):
    return {k: global_array(mesh, v, PARAM_SPECS[k]) for k, v in params.items()}

  def place_batch(mesh, batch):
    return jax.tree.map(lambda x: global_array(mesh, x, P(("replica", "fsdp"))), batch)

  def hsdp_step(tx, mesh, specs):
    def local_step(params, opt_state, batch):
      opt_state = optax_accum.sharding.local_state(opt_state)
      local = jax.lax.pcast(params, "replica", to="varying")
      loss, grads = jax.value_and_grad(loss_fn)(local, batch)
      updates, opt_state = tx.update(grads, opt_state, params,
                                     weight=batch["mask"].sum(), value=loss)
      return optax.apply_updates(params, updates), optax_accum.sharding.stacked_state(opt_state)

    return jax.jit(jax.shard_map(local_step, mesh=mesh, axis_names={"replica"},
                                 in_specs=(P(), specs, P("replica")), out_specs=(P(), specs)))

  def local_copy(x):
    # This process's copy of a global array, assembled from its own shards only; every
    # shard that overlaps another must hold the same bits.
    out, seen = np.zeros(x.shape, x.dtype), np.zeros(x.shape, bool)
    for shard in x.addressable_shards:
      data = np.asarray(shard.data)
      assert np.array_equal(out[shard.index][seen[shard.index]], data[seen[shard.index]])
      out[shard.index], seen[shard.index] = data, True
    assert seen.all()
    return out
  """
)

WORKER = COMMON + textwrap.dedent(
  """
  import sys
  pid, port, out, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
    initialization_timeout=60,
  )
  import orbax.checkpoint as ocp

  mesh = hsdp_mesh()
  assert {d.process_index for d in mesh.devices[pid]} == {pid}  # replica pid: this process
  params0, batches = make_data()
  tx = make_tx("replica")
  params = place_params(mesh, params0)
  opt_state = optax_accum.sharding.init_sharded(tx, params)
  opt_state = optax_accum.sharding.stack_windows(opt_state, mesh, "replica")
  step = hsdp_step(tx, mesh, optax_accum.sharding.window_specs(opt_state, "replica"))
  for i, batch in enumerate(batches):
    params, opt_state = step(params, opt_state, place_batch(mesh, batch))
    if i + 1 == SAVE_AFTER:
      with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(ckpt, {"params": params, "opt_state": opt_state})
        ckptr.wait_until_finished()
  np.savez(out, w=local_copy(params["w"]), b=local_copy(params["b"]),
           mu_w=local_copy(opt_state.inner_state[0].mu["w"]),
           num_updates=local_copy(opt_state.num_updates))
  jax.distributed.shutdown()
  """
)


def run_two_processes(tmp_path):
  ckpt = tmp_path / "ckpt"
  outs = run_workers(tmp_path, WORKER, 2, LOCAL_DEVICES, TIMEOUT_S, (str(ckpt),))
  return [dict(np.load(out)) for out in outs], ckpt


def common():
  namespace = {}
  exec(COMMON, namespace)
  return namespace


def single_process_reference(ns):
  """One device, no ``axis_name``: ``accumulate`` on the global microbatches."""
  params0, batches = ns["make_data"]()
  tx = ns["make_tx"]()
  params = jax.tree.map(jnp.asarray, params0)
  opt_state = tx.init(params)
  for batch in batches:
    grads = jax.grad(ns["loss_fn"])(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, weight=batch["mask"].sum())
    params = optax.apply_updates(params, updates)
  assert int(opt_state.num_updates) == ns["STEPS"] // ns["K"]
  return params, opt_state


def resume_in_one_process(ns, ckpt):
  """This process's 8 devices, the same mesh shape: restore mid-window and run to the end."""
  import orbax.checkpoint as ocp

  mesh = ns["hsdp_mesh"]()
  assert {d.process_index for d in mesh.devices.flat} == {jax.process_index()}
  params0, batches = ns["make_data"]()
  tx = ns["make_tx"]("replica")
  params = ns["place_params"](mesh, params0)
  fresh = optax_accum.sharding.init_sharded(tx, params)
  fresh = optax_accum.sharding.stack_windows(fresh, mesh, "replica")
  like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  target = {"params": jax.tree.map(like, params), "opt_state": jax.tree.map(like, fresh)}
  with ocp.StandardCheckpointer() as ckptr:
    meta = ckptr.metadata(ckpt).item_metadata.tree["opt_state"]
    optax_accum.sharding.check_compatible(tx, params0, meta, stacked=True)
    restored = ckptr.restore(ckpt, target)
  params = restored["params"]
  opt_state = optax_accum.sharding.check_compatible(
    tx, params0, restored["opt_state"], stacked=True
  )
  skip = int(optax_accum.metrics(opt_state).num_microbatches)
  assert skip == ns["SAVE_AFTER"] and int(optax_accum.metrics(opt_state).mini_step) == 2
  assert opt_state.window.grad_sum["w"].sharding.spec == jax.sharding.PartitionSpec(
    "replica", "fsdp", None
  )
  step = ns["hsdp_step"](tx, mesh, optax_accum.sharding.window_specs(opt_state, "replica"))
  for batch in batches[skip:]:
    params, opt_state = step(params, opt_state, ns["place_batch"](mesh, batch))
  return params, opt_state


@pytest.mark.slow  # three JAX starts, two of them with gloo, and five compilations: about 30 s
def test_two_processes_one_replica_each_and_a_checkpoint_restored_into_one(tmp_path):
  ns = common()
  results, ckpt = run_two_processes(tmp_path)
  for key in ("w", "b", "mu_w", "num_updates"):  # the two replicas hold the same bits
    np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)
  assert int(results[0]["num_updates"]) == 2

  ref_params, ref_state = single_process_reference(ns)
  got = {"w": results[0]["w"], "b": results[0]["b"]}
  np.testing.assert_allclose(got["w"], ref_params["w"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(got["b"], ref_params["b"], rtol=1e-6, atol=1e-7)
  ref_mu = ref_state.inner_state[0].mu["w"]  # the window's averaged gradient, scaled
  np.testing.assert_allclose(results[0]["mu_w"], ref_mu, rtol=1e-5, atol=1e-7)
  assert np.abs(got["w"] - ns["make_data"]()[0]["w"]).min() > 1e-3  # every weight moved

  params, opt_state = resume_in_one_process(ns, ckpt)
  assert int(opt_state.num_updates) == 2
  np.testing.assert_allclose(np.asarray(params["w"]), got["w"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(params["b"]), got["b"], rtol=1e-6, atol=1e-7)
