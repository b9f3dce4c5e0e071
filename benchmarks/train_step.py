"""End-to-end train step of a small transformer LM: physical batch vs across-step vs in-step.

One window of ``B`` sequences (bytes of the standard library's sources, padded,
so rows hold different numbers of real tokens) is processed three ways, on the
same params, in one process, all steps jitted with params and optimizer state
donated:

* ``physical``: ``jax.value_and_grad`` over all ``B`` rows, then ``adam``.
* ``across_step``: ``every_k`` calls, one per microbatch of ``B / every_k`` rows,
  of ``value_and_grad`` + ``update_and_apply(accumulate(adam, every_k), ...,
  weight=tokens, value=loss)`` (the recommended train step).
* ``in_step``: one call of ``microbatched_value_and_grad(loss, every_k)`` (a
  ``lax.scan`` over the microbatches) + ``adam``; skipped if
  ``optax_accum.microbatched_value_and_grad`` is missing.

Reported per variant: median wall time per window (``B`` rows) with its
25th/75th percentiles, and the compiled step's memory (``temp`` bytes hold the
activations: they shrink with the microbatch).

With ``--devices D`` (``D`` fake CPU devices, set before JAX starts) or more
than one device, the ``mesh`` rows run the same window with the batch sharded
on a ``data`` axis and the params replicated:

* ``physical``: one jitted ``value_and_grad`` + ``adam`` over all ``B`` rows.
* ``across_step_shard_map``: ``accumulate(adam, every_k, axis_name='data')``
  inside ``jax.shard_map``, one call per microbatch (the ``docs/scaling.md`` recipe).
* ``in_step_jit_per_microbatch``: ``microbatched_value_and_grad`` under ``jit``
  without ``axis_name`` (the compiler all-reduces every microbatch's gradient).
* ``in_step_jit``: the same with ``axis_name='data'`` (one reduction after the scan).
* ``in_step_shard_map``: inside ``jax.shard_map`` with ``axis_name='data'``.
* ``across_step_shard_map_zero1``: the across-step recipe with ``shard_optimizer=True`` (ZeRO-1:
  a reduce-scatter and an all-gather at the boundary, ``1/D`` of Adam's state per device).

The across-step rows also report the bytes each device sends in the window's collectives
(``bytes_per_window``) and the inner optimizer's state bytes one device holds
(``inner_state_bytes_per_device``).

With at least 4 devices, the ``hsdp`` rows (``benchmarks/train_step_hsdp.py``) run the window
on a ``replica`` x ``fsdp`` mesh (``--replica`` replicas, 2 by default): physical batch,
across-step under plain ``jit`` (before), across-step with the HSDP ``shard_map`` recipe
(after) and in-step with ``axis_name='replica'``, each with its collectives per window by
mesh axis and the bytes it moves across ``replica`` per window.

Each mesh row reports the collectives of its compiled step(s) outside loops,
in loop bodies and in conditionals
(:func:`optax_accum.testing.count_collectives`) and ``collectives_per_window``:
loop-body ones count ``every_k`` times, the across-step boundary's once.

  python benchmarks/train_step.py --out train_step.json
  python benchmarks/train_step.py --devices 8 --out benchmarks/results/train_step_8dev.json
  python benchmarks/train_step.py --quick
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any


def _host_devices(argv: list[str]) -> None:
  """``--devices D``: D fake CPU devices; XLA reads the flag once, before JAX starts."""
  for i, arg in enumerate(argv):
    value = arg.split("=", 1)[1] if arg.startswith("--devices=") else None
    if arg == "--devices" and i + 1 < len(argv):
      value = argv[i + 1]
    if value and int(value) > 1:
      flag = f"--xla_force_host_platform_device_count={int(value)}"
      os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


if __name__ == "__main__":
  _host_devices(sys.argv[1:])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_accum  # noqa: E402
from optax_accum.demo.data import batches  # noqa: E402
from optax_accum.demo.model import CharTransformer, token_loss  # noqa: E402
from optax_accum.testing import count_collectives  # noqa: E402

try:
  from benchmarks.microstep import fresh, machine, write_report  # noqa: E402
  from benchmarks.train_step_hsdp import hsdp_runs  # noqa: E402
except ImportError:  # run as a script: benchmarks/ is on sys.path
  from microstep import fresh, machine, write_report  # type: ignore[no-redef]  # noqa: E402
  from train_step_hsdp import hsdp_runs  # type: ignore[no-redef]  # noqa: E402


def memory(compiled: Any) -> dict[str, int]:
  mem = compiled.memory_analysis()
  return {
    "argument_bytes": int(mem.argument_size_in_bytes),
    "output_bytes": int(mem.output_size_in_bytes),
    "alias_bytes": int(mem.alias_size_in_bytes),
    "temp_bytes": int(mem.temp_size_in_bytes),
  }


def time_runs(runs: dict[str, dict[str, Any]], params0: Any, rounds: int, copy: Any) -> dict:
  """Warm-up, one reference window, then ``rounds`` interleaved timed windows per variant."""
  live = {name: [copy(r.get("params", params0)), copy(r["state"])] for name, r in runs.items()}
  losses = {}
  for name, r in runs.items():  # warm-up and one reference window from the same params
    p, s, loss = r["calls"](*live[name])
    losses[name] = float(loss)
    live[name] = [p, s]
  jax.block_until_ready(live)
  times: dict[str, list[float]] = {name: [] for name in runs}
  names = list(runs)
  for rnd in range(rounds):
    for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
      t0 = time.perf_counter()
      p, s, _ = runs[name]["calls"](*live[name])
      jax.block_until_ready((p, s))
      times[name].append(time.perf_counter() - t0)
      live[name] = [p, s]
  variants = {}
  for name, r in runs.items():
    t = np.array(times[name]) * 1e3
    variants[name] = {
      "window_ms": float(np.median(t)),
      "window_p25_ms": float(np.percentile(t, 25)),
      "window_p75_ms": float(np.percentile(t, 75)),
      "first_window_loss": losses[name],
      **r["memory"],
      **r.get("collectives", {}),
    }
  return variants


def _placed_copy(tree: Any) -> Any:
  """A copy of ``tree`` in new buffers, placed as before (donation never hits a shared one)."""
  return jax.tree.map(lambda x: jax.device_put(np.asarray(x), x.sharding), tree)


def _collectives(compiled: Any, every_k: int, calls: int) -> dict[str, Any]:
  """Counts of a compiled step and how many collectives one window runs.

  ``calls`` steps per window; a loop body runs ``every_k`` times per step; a
  conditional (the across-step boundary) runs once per window.
  """
  counts = count_collectives(compiled.as_text())
  per_window = (
    calls * sum(counts["outside"].values())
    + calls * every_k * sum(counts["in_loop"].values())
    + sum(counts["in_conditional"].values())
  )
  return {
    "collectives": {where: dict(c) for where, c in counts.items()},
    "collectives_per_window": per_window,
  }


def ring_bytes(by_kind: dict[str, int], n: int) -> int:
  """Bytes one device sends for these collectives on a ring of ``n`` devices (``by_kind``: each
  collective's result bytes per device, ``count_collectives(unit='bytes')``): an all-reduce of
  ``S`` sends ``2 (n-1)/n S``, a reduce-scatter to ``s`` sends ``(n-1) s``, an all-gather to
  ``S`` sends ``(n-1)/n S`` (so a reduce-scatter plus an all-gather sends what an all-reduce
  does)."""
  share = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1, "all-gather": (n - 1) / n}
  return round(sum(share.get(kind, 0) * b for kind, b in by_kind.items()))


def mesh_rows(args: Any, loss_fn: Any, params0: Any, window: Any, inner: Any) -> dict:
  """The window on a ``data`` mesh axis over every device, params replicated."""
  k, axis = args.every_k, "data"
  n_dev = jax.device_count()
  if args.batch % (k * n_dev):
    raise ValueError(f"--batch {args.batch} must be divisible by every_k * devices = {k * n_dev}")
  mesh = jax.make_mesh((n_dev,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
  put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
  params = put(params0, P())
  batch = put(window, P(axis))
  # Microbatch i of the across-step rows: the strided split, rows i, i+K, ... on their device.
  micro = [put(jax.tree.map(lambda x, i=i: np.asarray(x)[i::k], window), P(axis)) for i in range(k)]
  tokens = lambda mb: mb["mask"].sum()
  runs: dict[str, dict[str, Any]] = {}

  def donated(step):
    return jax.jit(step, donate_argnums=(0, 1))

  @donated
  def physical(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  def in_step_fn(axis_name):
    vg = optax_accum.microbatched_value_and_grad(loss_fn, k, weight_fn=tokens, axis_name=axis_name)

    def step(params, state, batch):
      loss, grads = vg(params, batch)
      updates, state = inner.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss

    return step

  state0 = put(inner.init(params0), P())
  specs_in = (P(), P(), P(axis))
  in_step_sm = jax.shard_map(
    in_step_fn(axis), mesh=mesh, in_specs=specs_in, out_specs=(P(), P(), P())
  )
  with jax.set_mesh(mesh):
    for name, step, calls in [
      ("physical", physical, 1),
      ("in_step_jit_per_microbatch", donated(in_step_fn(None)), 1),
      ("in_step_jit", donated(in_step_fn(axis)), 1),
      ("in_step_shard_map", donated(in_step_sm), 1),
    ]:
      compiled = step.lower(params, state0, batch).compile()
      runs[name] = {
        "calls": lambda p, s, c=compiled: c(p, s, batch),
        "params": params,
        "state": state0,
        "memory": memory(compiled),
        "collectives": _collectives(compiled, k, calls),
      }

  # Across-step: accumulate(..., axis_name) in shard_map, window sums on a device axis; and
  # the same with ZeRO-1 (shard_optimizer=True): the inner state 1/D per device.
  for name, shard in (("across_step_shard_map", False), ("across_step_shard_map_zero1", True)):
    tx = optax_accum.accumulate(inner, every_k=k, axis_name=axis, shard_optimizer=shard)
    acc_state = optax_accum.sharding.init_sharded(tx, params, axis)
    specs = optax_accum.sharding.window_specs(acc_state, axis)

    def microstep(params, opt_state, batch, tx=tx):
      opt_state = optax_accum.sharding.local_state(opt_state)
      local = jax.lax.pcast(params, axis, to="varying")
      loss, grads = jax.value_and_grad(loss_fn)(local, batch)
      params, opt_state = optax_accum.update_and_apply(
        tx, grads, opt_state, params, weight=tokens(batch), value=loss
      )
      new = params, optax_accum.sharding.stacked_state(opt_state)
      return *new, loss[None]  # each device's own loss: no collective outside the boundary

    across = donated(
      jax.shard_map(
        microstep, mesh=mesh, in_specs=(P(), specs, P(axis)), out_specs=(P(), specs, P(axis))
      )
    )
    across_c = across.lower(params, acc_state, micro[0]).compile()

    def across_window(p, s, c=across_c):
      for m in micro:
        p, s, _ = c(p, s, m)
      return p, s, optax_accum.metrics(s).window_loss

    moved = count_collectives(across_c.as_text(), unit="bytes")
    n = jax.device_count()
    runs[name] = {
      "calls": across_window,
      "params": params,
      "state": acc_state,
      "memory": memory(across_c),
      "collectives": {
        **_collectives(across_c, k, calls=k),
        "bytes_per_window": k * sum(moved["outside"].values())
        + sum(moved["in_conditional"].values()),
        "bytes_by_collective": {w: dict(c) for w, c in moved.items()},
        "ring_bytes_per_window": ring_bytes(moved["in_conditional"], n)
        + k * ring_bytes(moved["outside"], n),
        "inner_state_bytes_per_device": sum(
          x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(acc_state.inner_state)
        ),
      },
    }
  return time_runs(runs, params, args.rounds, _placed_copy)


def model_and_window(args: Any) -> tuple[Any, Any, dict[str, jax.Array]]:
  """``(loss_fn, params, window)``: the transformer's token loss, its params and ``B`` rows."""
  model = CharTransformer(
    seq_len=args.seq_len, dim=args.dim, depth=args.depth, heads=args.heads, rngs=nnx.Rngs(0)
  )
  graphdef, params0, rest = nnx.split(model, nnx.Param, ...)
  params0 = jax.tree.map(jnp.asarray, nnx.to_pure_dict(params0))

  def loss_fn(params, batch):
    p = nnx.State(params)
    return token_loss(nnx.merge(graphdef, p, rest), batch)

  data = batches(args.seq_len, args.batch, max_files=4)
  return loss_fn, params0, {key: jnp.asarray(v) for key, v in data[0].items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=64, help="rows per window (B)")
  parser.add_argument("--every-k", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=10, help="interleaved windows per variant")
  parser.add_argument("--replica", type=int, default=2, help="replicas of the hsdp rows")
  parser.add_argument("--out", default=None)
  parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds")
  parser.add_argument(
    "--devices",
    type=int,
    default=0,
    help="fake CPU devices for the mesh rows (0: mesh rows if JAX already has > 1 device)",
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.batch, args.every_k, args.seq_len, args.dim, args.depth = 16, 2, 16, 32, 1
    args.heads, args.rounds = 2, 2
  k = args.every_k
  if args.batch % k:
    raise ValueError(f"--batch {args.batch} must be divisible by --every-k {k}")

  loss_fn, params0, window = model_and_window(args)
  micro = [jax.tree.map(lambda x, i=i: x[i::k], window) for i in range(k)]
  weights = [jnp.sum(m["mask"]) for m in micro]

  inner = optax.adam(1e-3)
  tx_acc = optax_accum.accumulate(inner, every_k=k)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def physical(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def across(params, state, batch, weight):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params, state = optax_accum.update_and_apply(
      tx_acc, grads, state, params, weight=weight, value=loss
    )
    # The window's token-weighted mean loss, once the window closes.
    return params, state, optax_accum.metrics(state).window_loss

  # Compiled once, ahead of time; the same executables are timed.
  physical_c = physical.lower(params0, inner.init(params0), window).compile()
  across_c = across.lower(params0, tx_acc.init(params0), micro[0], weights[0]).compile()
  runs: dict[str, dict[str, Any]] = {
    "physical": {
      "calls": lambda p, s: physical_c(p, s, window),
      "state": inner.init(params0),
      "memory": memory(physical_c),
    },
  }

  def across_window(p, s):
    loss = None
    for m, w in zip(micro, weights, strict=True):
      p, s, loss = across_c(p, s, m, w)
    return p, s, loss

  runs["across_step"] = {
    "calls": across_window,
    "state": tx_acc.init(params0),
    "memory": memory(across_c),
  }
  skipped = []
  mvg = getattr(optax_accum, "microbatched_value_and_grad", None)
  if mvg is None:
    skipped.append(
      {"variant": "in_step", "reason": "optax_accum.microbatched_value_and_grad missing"}
    )
  else:
    vg = mvg(loss_fn, k, weight_fn=lambda mb: mb["mask"].sum())

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def in_step(params, state, batch):
      loss, grads = vg(params, batch)
      updates, state = inner.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss

    in_step_c = in_step.lower(params0, inner.init(params0), window).compile()
    runs["in_step"] = {
      "calls": lambda p, s: in_step_c(p, s, window),
      "state": inner.init(params0),
      "memory": memory(in_step_c),
    }

  variants = time_runs(runs, params0, args.rounds, fresh)
  if args.devices > 1 or (args.devices == 0 and jax.device_count() > 1):
    mesh_variants = mesh_rows(args, loss_fn, params0, window, inner)
  else:
    mesh_variants = {}
  hsdp = None
  if jax.device_count() >= 2 * args.replica and jax.device_count() % args.replica == 0:
    hsdp_mesh, hsdp_params, runs = hsdp_runs(loss_fn, params0, window, inner, k, args.replica)
    hsdp = {
      "mesh": dict(hsdp_mesh.shape),
      "variants": time_runs(runs, hsdp_params, args.rounds, _placed_copy),
    }
  num_params = int(sum(x.size for x in jax.tree.leaves(params0)))
  report = {
    "benchmark": "train_step",
    "machine": machine(),
    "args": vars(args),
    "num_params": num_params,
    "tokens_per_window": float(jnp.sum(window["mask"])),
    "variants": variants,
    "mesh": {"devices": jax.device_count(), "variants": mesh_variants} if mesh_variants else None,
    "hsdp": hsdp,
    "skipped": skipped,
  }
  hsdp_variants = ((f"hsdp {n}", v) for n, v in (hsdp or {"variants": {}})["variants"].items())
  mesh_rows_ = ((f"mesh {n}", v) for n, v in mesh_variants.items())
  for name, v in [*variants.items(), *mesh_rows_, *hsdp_variants]:
    per_window = v.get("collectives_per_window", v.get("collectives_per_window_by_axis"))
    print(
      f"{name:36s} {v['window_ms']:8.1f} ms/window  temp {v['temp_bytes'] / 2**20:7.2f} MiB"
      + ("" if per_window is None else f"  collectives/window {per_window}"),
      file=sys.stderr,
    )
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
