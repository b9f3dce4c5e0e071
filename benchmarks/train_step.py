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

  python benchmarks/train_step.py --out train_step.json
  python benchmarks/train_step.py --quick
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_accum
from optax_accum.demo.data import batches
from optax_accum.demo.model import CharTransformer, token_loss

try:
  from benchmarks.microstep import fresh, machine, write_report
except ImportError:  # run as a script: benchmarks/ is on sys.path
  from microstep import fresh, machine, write_report  # type: ignore[no-redef]


def memory(compiled: Any) -> dict[str, int]:
  mem = compiled.memory_analysis()
  return {
    "argument_bytes": int(mem.argument_size_in_bytes),
    "output_bytes": int(mem.output_size_in_bytes),
    "alias_bytes": int(mem.alias_size_in_bytes),
    "temp_bytes": int(mem.temp_size_in_bytes),
  }


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=64, help="rows per window (B)")
  parser.add_argument("--every-k", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=10, help="interleaved windows per variant")
  parser.add_argument("--out", default=None)
  parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds")
  args = parser.parse_args(argv)
  if args.quick:
    args.batch, args.every_k, args.seq_len, args.dim, args.depth = 8, 2, 16, 32, 1
    args.heads, args.rounds = 2, 2
  k = args.every_k
  if args.batch % k:
    raise ValueError(f"--batch {args.batch} must be divisible by --every-k {k}")

  model = CharTransformer(
    seq_len=args.seq_len, dim=args.dim, depth=args.depth, heads=args.heads, rngs=nnx.Rngs(0)
  )
  graphdef, params0, rest = nnx.split(model, nnx.Param, ...)
  params0 = jax.tree.map(jnp.asarray, nnx.to_pure_dict(params0))

  def loss_fn(params, batch):
    p = nnx.State(params)
    return token_loss(nnx.merge(graphdef, p, rest), batch)

  data = batches(args.seq_len, args.batch, max_files=4)
  window = {key: jnp.asarray(v) for key, v in data[0].items()}
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

  live = {name: [fresh(params0), fresh(r["state"])] for name, r in runs.items()}
  losses = {}
  for name, r in runs.items():  # warm-up and one reference window from the same params
    p, s, loss = r["calls"](*live[name])
    losses[name] = float(loss)
    live[name] = [p, s]
  jax.block_until_ready(live)
  times: dict[str, list[float]] = {name: [] for name in runs}
  names = list(runs)
  for rnd in range(args.rounds):
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
    }
  num_params = int(sum(x.size for x in jax.tree.leaves(params0)))
  report = {
    "benchmark": "train_step",
    "machine": machine(),
    "args": vars(args),
    "num_params": num_params,
    "tokens_per_window": float(jnp.sum(window["mask"])),
    "variants": variants,
    "skipped": skipped,
  }
  for name, v in variants.items():
    print(
      f"{name:12s} {v['window_ms']:8.1f} ms/window  temp {v['temp_bytes'] / 2**20:7.1f} MiB",
      file=sys.stderr,
    )
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
