"""The HSDP rows of ``benchmarks/train_step.py``: one window on a ``replica`` x ``fsdp`` mesh.

Params and optimizer state sharded over ``fsdp`` (each leaf's first dimension that divides
evenly; the rest replicated), replicated over ``replica``; the batch over both. Rows:

* ``physical``: one jitted ``value_and_grad`` + ``adam`` over all ``B`` rows.
* ``across_step_jit`` (before): ``accumulate(adam, every_k)`` under plain ``jax.jit`` with the
  mesh set, one call per microbatch: the compiler reduces every microbatch's gradient over
  ``replica``.
* ``across_step_shard_map`` (after): the docs/scaling.md HSDP recipe, a partial-manual
  ``jax.shard_map`` over ``replica`` (``fsdp`` left to the compiler) with
  ``accumulate(adam, every_k, axis_name='replica')``, one call per microbatch.
* ``in_step``: ``microbatched_value_and_grad(loss, every_k, axis_name='replica')`` under
  ``jax.jit`` with the mesh set (a ``lax.scan``), then ``adam``.

Per row: ``collectives_per_window_by_axis`` (``'replica'``, ``'fsdp'``, ``'replica+fsdp'``:
the mesh axes a collective spans, from ``count_collectives(text, mesh)``; a loop body counts
``every_k`` times per call, a conditional (the across-step boundary) once per window) and
``replica_bytes_per_window`` (each device's data in the collectives that span ``replica``,
``count_collectives(..., unit='bytes')``, weighted the same way).
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.testing import count_collectives

AXES = ("replica", "fsdp")
ROWS = ("physical", "across_step_jit", "across_step_shard_map", "in_step")


def hsdp_mesh(replica: int) -> Mesh:
  """``replica`` x ``fsdp`` over every device, ordered by process (a process is in one replica
  when it holds ``device_count / replica`` devices). Both axes Auto: under plain ``jit`` an
  Explicit ``replica`` axis makes the model's embedding gather ask for an ``out_sharding``."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  if len(devices) % replica:
    raise ValueError(f"{len(devices)} devices do not split into {replica} replicas")
  grid = np.array(devices).reshape(replica, len(devices) // replica)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def fsdp_spec(shape: tuple[int, ...], n: int) -> P:
  """``fsdp`` on the first dimension that ``n`` divides, else replicated."""
  for i, size in enumerate(shape):
    if size >= n and size % n == 0:
      return P(*([None] * i), "fsdp")
  return P()


def by_axis(compiled: Any, mesh: Mesh, every_k: int, calls: int) -> dict[str, Any]:
  """Collectives per window keyed by the mesh axes they span, and bytes across ``replica``."""
  text = compiled.as_text()
  counts, data = count_collectives(text, mesh), count_collectives(text, mesh, unit="bytes")
  times = {"outside": calls, "in_loop": calls * every_k, "in_conditional": 1}
  per_axis: collections.Counter = collections.Counter()
  replica_bytes = 0
  for where, counter in counts.items():
    for (_, axes), n in counter.items():
      per_axis["+".join(axes)] += times[where] * n
  for where, counter in data.items():
    replica_bytes += sum(times[where] * n for (_, axes), n in counter.items() if "replica" in axes)
  return {
    "collectives": {
      where: {f"{op} {'+'.join(axes)}": n for (op, axes), n in sorted(c.items())}
      for where, c in counts.items()
    },
    "collectives_per_window_by_axis": dict(sorted(per_axis.items())),
    "replica_bytes_per_window": int(replica_bytes),
  }


def hsdp_runs(
  loss_fn: Any, params0: Any, window: Any, inner: Any, every_k: int, replica: int
) -> tuple[Mesh, Any, dict[str, dict[str, Any]]]:
  """``(mesh, params, runs)``: each row's window function, state, memory and collectives."""
  mesh = hsdp_mesh(replica)
  k, fsdp = every_k, mesh.shape["fsdp"]
  rows = jax.tree.leaves(window)[0].shape[0]
  if rows % (k * mesh.size):
    raise ValueError(f"--batch {rows} must be divisible by every_k * devices = {k * mesh.size}")
  data = NamedSharding(mesh, P(AXES))
  params = jax.tree.map(
    lambda x: jax.device_put(x, NamedSharding(mesh, fsdp_spec(x.shape, fsdp))), params0
  )
  batch = jax.device_put(window, data)
  micro = [jax.device_put(jax.tree.map(lambda x, i=i: x[i::k], window), data) for i in range(k)]
  tokens = lambda mb: mb["mask"].sum()
  donated = lambda f: jax.jit(f, donate_argnums=(0, 1))
  runs: dict[str, dict[str, Any]] = {}

  def physical(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  vg = optax_accum.microbatched_value_and_grad(loss_fn, k, weight_fn=tokens, axis_name="replica")

  def in_step(params, state, batch):
    loss, grads = vg(params, batch)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  tx_jit = optax_accum.accumulate(inner, every_k=k)

  def across_jit(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx_jit.update(grads, state, params, weight=tokens(batch), value=loss)
    return optax.apply_updates(params, updates), state, loss

  tx = optax_accum.accumulate(inner, every_k=k, axis_name="replica")
  acc_state = optax_accum.sharding.init_sharded(tx, params)
  acc_state = optax_accum.sharding.stack_windows(acc_state, mesh, "replica")
  specs = optax_accum.sharding.window_specs(acc_state, "replica")

  def local_step(params, opt_state, batch):  # one replica; fsdp is the compiler's
    opt_state = optax_accum.sharding.local_state(opt_state)
    local = jax.lax.pcast(params, "replica", to="varying")
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    updates, opt_state = tx.update(grads, opt_state, params, weight=tokens(batch), value=loss)
    new = optax.apply_updates(params, updates), optax_accum.sharding.stacked_state(opt_state)
    return *new, loss[None]  # each replica's own loss: no collective for it

  across_sm = jax.shard_map(
    local_step,
    mesh=mesh,
    axis_names={"replica"},
    in_specs=(P(), specs, P("replica")),
    out_specs=(P(), specs, P("replica")),
  )
  inner_state = optax_accum.sharding.init_sharded(inner, params)
  jit_state = optax_accum.sharding.init_sharded(tx_jit, params)
  with jax.set_mesh(mesh):
    for name, step, state, arg, calls in [
      ("physical", physical, inner_state, batch, 1),
      ("in_step", in_step, inner_state, batch, 1),
      ("across_step_jit", across_jit, jit_state, micro[0], k),
      ("across_step_shard_map", across_sm, acc_state, micro[0], k),
    ]:
      compiled = donated(step).lower(params, state, arg).compile()
      if calls == 1:
        window_fn = lambda p, s, c=compiled: c(p, s, batch)
      else:

        def window_fn(p, s, c=compiled):
          for m in micro:
            p, s, _ = c(p, s, m)
          return p, s, optax_accum.metrics(s).window_loss

      mem = compiled.memory_analysis()
      runs[name] = {
        "calls": window_fn,
        "params": params,
        "state": state,
        "memory": {"temp_bytes": int(mem.temp_size_in_bytes)},
        "collectives": {"calls_per_window": calls, **by_axis(compiled, mesh, k, calls)},
      }
  return mesh, params, {name: runs[name] for name in ROWS}
