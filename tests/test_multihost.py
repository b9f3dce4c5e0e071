"""Two processes on localhost (jax.distributed, CPU collectives over gloo) apply one update.

Each process has 2 CPU devices; the mesh spans all 4. Both run the documented
shard_map recipe (default ``check_vma=True``; ``jax.grad`` of
``jax.lax.pcast(params, 'data', to='varying')``, the replicated params passed to
``tx.update``) over the same global microbatches (each feeds only its own devices'
rows) and must end with bitwise-identical params, equal to a single-process
run of ``accumulate`` without ``axis_name`` on the concatenated microbatches.
"""

import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _processes import run_workers

import optax_accum

EVERY_K = 2
STEPS = 4  # two windows
ROWS = 16  # per microbatch, 4 per device
LOCAL_DEVICES = 2
TIMEOUT_S = 45

COMMON = textwrap.dedent(
  """
  import numpy as np

  def make_batches():
    rng = np.random.default_rng(0)
    counts = [[4, 0, 2, 3], [1, 4, 4, 2], [3, 3, 0, 1], [4, 2, 1, 4]]  # rows per device
    out = []
    for row in counts:
      mask = np.zeros((4, 4), bool)
      for d, c in enumerate(row):
        mask[d, :c] = True
      out.append({"x": rng.normal(size=(16, 3)).astype(np.float32),
                  "y": rng.normal(size=(16,)).astype(np.float32),
                  "mask": mask.reshape(-1)})
    return out

  def loss_fn(params, batch):
    import jax.numpy as jnp
    err = batch["x"] @ params["theta"] + params["b"] - batch["y"]
    return jnp.sum(jnp.where(batch["mask"], 0.5 * err**2, 0.0)) / jnp.sum(batch["mask"])

  PARAMS0 = {"theta": np.array([0.5, -1.0, 2.0], np.float32), "b": np.float32(0.25)}
  """
)

WORKER = COMMON + textwrap.dedent(
  """
  import sys
  import jax
  pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
    initialization_timeout=30,
  )
  import jax.numpy as jnp
  import optax
  import optax_accum
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  shard = sys.argv[4] == "zero1"  # ZeRO-1: the inner state 1/4 per device, made in shard_map
  tx = optax_accum.accumulate(optax.adam(0.1), %(every_k)d, axis_name="data",
                              shard_optimizer=shard)

  def global_array(x, spec):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

  params = jax.tree.map(lambda x: global_array(x, P()), PARAMS0)
  if shard:
    opt_state = optax_accum.sharding.init_sharded(tx, params, "data")
  else:
    opt_state = optax_accum.sharding.stack_windows(tx.init(PARAMS0), mesh, "data")
  specs = optax_accum.sharding.window_specs(opt_state, "data")

  def body(params, opt_state, batch):
    opt_state = optax_accum.sharding.local_state(opt_state)
    # Differentiate w.r.t. a device-varying copy: the gradient stays local (no
    # all-reduce per microstep). tx.update and apply_updates get the replicated params.
    grads = jax.grad(loss_fn)(jax.lax.pcast(params, "data", to="varying"), batch)
    updates, opt_state = tx.update(grads, opt_state, params, weight=jnp.sum(batch["mask"]))
    return optax.apply_updates(params, updates), optax_accum.sharding.stacked_state(opt_state)

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("data")),
                               out_specs=(P(), specs)))
  for batch in make_batches():
    params, opt_state = step(params, opt_state, jax.tree.map(
      lambda x: global_array(x, P("data")), batch))
  local = lambda x: np.stack([np.asarray(s.data) for s in x.addressable_shards])
  np.savez(out, theta=local(params["theta"]), b=local(params["b"]),
           num_updates=local(opt_state.num_updates))
  jax.distributed.shutdown()
  """
) % {"every_k": EVERY_K}


def single_process_reference():
  namespace = {}
  exec(COMMON, namespace)
  tx = optax_accum.accumulate(optax.adam(0.1), EVERY_K)
  params = jax.tree.map(jnp.asarray, namespace["PARAMS0"])

  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(namespace["loss_fn"])(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, weight=jnp.sum(batch["mask"]))
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  for batch in namespace["make_batches"]():
    params, opt_state = step(params, opt_state, batch)
  assert int(opt_state.num_updates) == STEPS // EVERY_K
  return params


@pytest.mark.slow  # two processes start JAX and compile: about 20 s
@pytest.mark.parametrize("optimizer", ["replicated", "zero1"])
def test_two_processes_apply_the_single_process_update(tmp_path, optimizer):
  outs = run_workers(tmp_path, WORKER, 2, LOCAL_DEVICES, TIMEOUT_S, extra=(optimizer,))

  results = [np.load(out) for out in outs]
  for r in results:  # every local device of every process holds the same bits
    for key in ("theta", "b", "num_updates"):
      assert all(np.array_equal(x, r[key][0]) for x in r[key]), key
  for key in ("theta", "b", "num_updates"):
    np.testing.assert_array_equal(results[0][key], results[1][key])
  assert int(results[0]["num_updates"][0]) == STEPS // EVERY_K

  expected = single_process_reference()
  got = {"theta": results[0]["theta"][0], "b": results[0]["b"][0]}
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
  assert not np.allclose(got["theta"], [0.5, -1.0, 2.0])  # the updates did happen
