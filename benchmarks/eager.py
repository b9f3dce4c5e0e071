"""Eager (un-jitted) calls: ``accumulate`` against a plain adam update and ``optax.MultiSteps``.

Notebooks, debugging sessions and quick scripts call ``tx.update`` without ``jax.jit``.
Each row is the median wall time of one eager call after a warm-up call (the first call
compiles), on the same params, all in one process:

* ``adam``: ``optax.adam(1e-3).update`` (optax runs op by op: the baseline).
* ``multisteps``: ``optax.MultiSteps(adam, 4).update`` (re-traces its ``lax.cond`` every call).
* ``accumulate``: ``accumulate(adam, every_k=4).update`` (its compiled step, cached).
* ``update_and_apply``, ``flush``, ``metrics``: the other eager entry points.

Ratios are against ``adam`` measured in the same run.

  python benchmarks/eager.py --out benchmarks/results/eager.json
  python benchmarks/eager.py --quick     # CI smoke run
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import optax
from microstep import machine, median_ms, write_report

import optax_accum


def run(num_params: int, calls: int) -> dict[str, object]:
  """Median ms per eager call of each entry point, for ``num_params`` float32 params."""
  rows = max(1, num_params // (4 * 1024))
  params = {f"w{i}": jnp.full((rows, 1024), 0.01, jnp.float32) for i in range(4)}
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  adam = optax.adam(1e-3)
  multi = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4)
  tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4)
  a_state, m_state, state = adam.init(params), multi.init(params), tx.init(params)
  _, open_state = tx.update(grads, state, params, weight=3)  # one microbatch pending
  entry = {
    "adam": lambda: adam.update(grads, a_state, params),
    "multisteps": lambda: multi.update(grads, m_state, params),
    "accumulate": lambda: tx.update(grads, state, params, weight=3),
    "update_and_apply": lambda: optax_accum.update_and_apply(tx, grads, state, params, weight=3),
    "flush": lambda: optax_accum.flush(tx, open_state, params),
    "metrics": lambda: optax_accum.metrics(open_state),
  }
  slow = {"multisteps": max(3, calls // 10)}  # about half a second per call
  ms = {name: median_ms(fn, slow.get(name, calls)) for name, fn in entry.items()}
  return {
    "num_params": rows * 1024 * 4,
    "calls": calls,
    "ms": ms,
    "over_adam": {name: t / ms["adam"] for name, t in ms.items()},
  }


def main(argv: list[str] | None = None) -> dict[str, object]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", type=float, nargs="+", default=[1e5, 1e6])
  parser.add_argument("--calls", type=int, default=30, help="timed calls per entry point")
  parser.add_argument("--out", default=None, help="write the JSON here (else stdout)")
  parser.add_argument("--quick", action="store_true", help="16k params, 5 calls")
  args = parser.parse_args(argv)
  if args.quick:
    args.sizes, args.calls = [2**14], 5
  results = [run(int(n), args.calls) for n in args.sizes]
  for r in results:
    cells = "  ".join(f"{k} {v:.2f}" for k, v in r["ms"].items())
    print(f"n={r['num_params']:,}: ms {cells}", file=sys.stderr)
  report = {"benchmark": "eager", "machine": machine(), "args": vars(args), "results": results}
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
