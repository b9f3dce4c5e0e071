"""The HSDP and ZeRO-1 rows of ``benchmarks/train_step.py`` on real accelerators; prints a JSON.

Never needed by the tests. On a machine (or a cluster) with accelerators, it runs the same
window as ``train_step.py``'s ``hsdp`` rows (physical batch, across-step under plain ``jit``,
across-step with the HSDP ``shard_map`` recipe, in-step with ``axis_name='replica'``) on a
``replica`` x ``fsdp`` mesh of every device, ordered by process, and prints each row's
collectives per window by mesh axis, bytes across ``replica`` per window and window times; and
its ``mesh`` rows on a ``data`` axis over every device (with more than one device), among them
the across-step recipe with and without ZeRO-1 (``shard_optimizer=True``): ring bytes per window
and inner-state bytes per device.

  python benchmarks/hsdp_device.py                    # one host: 2 replicas of its devices
  python benchmarks/hsdp_device.py --distributed      # every host runs it; a replica per host
  python benchmarks/hsdp_device.py --dry-run          # the devices and mesh it would use
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def parse(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=256, help="rows per window (B)")
  parser.add_argument("--every-k", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=512)
  parser.add_argument("--dim", type=int, default=1024)
  parser.add_argument("--depth", type=int, default=8)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=10, help="interleaved windows per variant")
  parser.add_argument(
    "--replica", type=int, default=0, help="replicas (0: one per process, 2 on one process)"
  )
  parser.add_argument(
    "--distributed", action="store_true", help="jax.distributed.initialize() first (clusters)"
  )
  parser.add_argument("--dry-run", action="store_true", help="print the plan; compile nothing")
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse(argv)  # before JAX starts: --help is instant
  import jax

  if args.distributed:
    jax.distributed.initialize()
  replica = args.replica or (jax.process_count() if jax.process_count() > 1 else 2)
  plan = {
    "benchmark": "train_step_hsdp_device",
    "backend": jax.default_backend(),
    "devices": jax.device_count(),
    "processes": jax.process_count(),
    "mesh": {"replica": replica, "fsdp": jax.device_count() // replica},
    "args": vars(args),
  }
  if args.dry_run:
    print(json.dumps(plan, indent=1))
    return plan
  try:
    from benchmarks import train_step
    from benchmarks.microstep import machine
  except ImportError:  # run as a script: benchmarks/ is on sys.path
    import train_step  # type: ignore[no-redef]
    from microstep import machine  # type: ignore[no-redef]
  import optax

  loss_fn, params0, window = train_step.model_and_window(args)
  mesh, params, runs = train_step.hsdp_runs(
    loss_fn, params0, window, optax.adam(1e-3), args.every_k, replica
  )
  variants = train_step.time_runs(runs, params, args.rounds, train_step._placed_copy)
  mesh = None
  if jax.device_count() > 1 and args.batch % (args.every_k * jax.device_count()) == 0:
    mesh = train_step.mesh_rows(args, loss_fn, params0, window, optax.adam(1e-3))
  report = {
    **plan,
    "machine": machine(),
    "num_params": int(sum(x.size for x in jax.tree.leaves(params0))),
    "variants": variants,
    "mesh": mesh,
  }
  if jax.process_index() == 0:
    print(json.dumps(report, indent=1))
  return report


if __name__ == "__main__":
  main(sys.argv[1:])
