"""Compiled memory of one train step: physical batch vs in-step vs across-step accumulation.

The model is the demo's ``CharTransformer`` with its token-weighted
``token_loss``, on real padded lines from ``optax_accum.demo.data``. Three
jitted train steps (gradient + ``optax.adam`` update, params and optimizer
state donated) are lowered and compiled, never run; XLA's
``compiled.memory_analysis()`` gives their argument, output, alias and temp
(scratch: activations, gradients, workspace) bytes:

* ``physical``: ``jax.grad`` on the whole batch of ``B`` rows.
* ``in_step``: :func:`optax_accum.microbatched_value_and_grad` with ``K``
  microbatches of ``B/K`` rows in one ``lax.scan``, the same batch.
* ``across_step``: one ``accumulate(adam, every_k=K).update`` call on one
  microbatch of ``B/K`` rows (its state holds the accumulator).
* ``in_step_scaled``: in-step with a loss scale, the documented companion
  ``accumulate(adam, every_k=1, loss_scale=...)`` (every microbatch is a window: its state
  holds no accumulator, issue 41).

``state_bytes`` gives each optimizer state's size next to plain Adam's: ``accumulate(adam, 1)``
adds a few scalars, ``accumulate(adam, K)`` one float32 accumulator.

The goal for ``in_step``: temp bytes close to ``physical_temp / K`` (one
microbatch's activations) plus one gradient-sized carry. Ratios are reported
against the physical batch measured in the same process.

  python benchmarks/memory.py --out memory.json
  python benchmarks/memory.py --quick          # CI smoke run, seconds
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optax_accum

try:
  from benchmarks.microstep import write_report
except ImportError:  # run as a script: benchmarks/ is on sys.path
  from microstep import write_report  # type: ignore[no-redef]


def memory(fn: Any, *args: Any) -> dict[str, int]:
  """Compiled memory of ``jax.jit(fn, donate_argnums=(0, 1))`` on ``args``, in bytes.

  ``temp`` is XLA's scratch allocation; ``argument + output - alias + temp`` is
  the step's footprint (donated params and optimizer state are aliased).
  """
  start = time.perf_counter()
  compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile()
  seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  fields = ("argument", "output", "alias", "temp")
  out = {f"{f}_bytes": int(getattr(m, f"{f}_size_in_bytes")) for f in fields}
  out["compile_seconds"] = seconds
  return out


def tree_bytes(tree: Any) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def run(batch_size: int, k: int, seq_len: int, dim: int, depth: int, heads: int) -> dict:
  """Measures the three steps; returns the JSON-ready report."""
  from flax import nnx

  from optax_accum.demo import data as demo_data
  from optax_accum.demo.model import CharTransformer, token_loss

  model = CharTransformer(seq_len=seq_len, dim=dim, depth=depth, heads=heads, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  batch = jax.tree.map(jnp.asarray, demo_data.batches(seq_len, batch_size, max_files=4)[0])
  micro = jax.tree.map(lambda x: x[: batch_size // k], batch)
  tokens = lambda mb: mb["mask"].sum()

  def loss_fn(p, b):
    return token_loss(nnx.merge(graphdef, p, rest), b)

  adam = optax.adam(1e-3)
  acc = optax_accum.accumulate(adam, every_k=k)
  scaled = optax_accum.accumulate(adam, 1, loss_scale=optax_accum.dynamic_loss_scale())
  in_step_grad = optax_accum.microbatched_value_and_grad(loss_fn, k, weight_fn=tokens)

  def physical(p, s, b):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    u, s = adam.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  def in_step(p, s, b):
    loss, g = in_step_grad(p, b)
    u, s = adam.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  def across_step(p, s, mb):
    loss, g = jax.value_and_grad(loss_fn)(p, mb)
    u, s = acc.update(g, s, p, weight=tokens(mb))
    return optax.apply_updates(p, u), s, loss

  def in_step_scaled(p, s, b):
    scale = optax_accum.metrics(s).loss_scale
    f = optax_accum.microbatched_value_and_grad(loss_fn, k, weight_fn=tokens, loss_scale=scale)
    loss, g = f(p, b)
    p, s = optax_accum.update_and_apply(scaled, g, s, p, weight=tokens(b))
    return p, s, loss

  start = time.perf_counter()
  results = {
    "physical": memory(physical, params, adam.init(params), batch),
    "in_step": memory(in_step, params, adam.init(params), batch),
    "across_step": memory(across_step, params, acc.init(params), micro),
    "in_step_scaled": memory(in_step_scaled, params, scaled.init(params), batch),
  }
  state_bytes = {
    "adam": tree_bytes(jax.eval_shape(adam.init, params)),
    "accumulate_k1_loss_scale": tree_bytes(jax.eval_shape(scaled.init, params)),
    "accumulate_k": tree_bytes(jax.eval_shape(acc.init, params)),
  }
  grad_bytes = tree_bytes(params)
  phys_temp = results["physical"]["temp_bytes"]
  target = phys_temp / k + grad_bytes
  ratios = {}
  for name in ("in_step", "across_step", "in_step_scaled"):
    temp = results[name]["temp_bytes"]
    ratios[f"{name}_temp_vs_physical"] = temp / phys_temp
    ratios[f"{name}_temp_vs_target"] = temp / target
    total = lambda r: r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
    ratios[f"{name}_total_vs_physical"] = total(results[name]) / total(results["physical"])
  return {
    "config": {
      "batch_size": batch_size,
      "num_microbatches": k,
      "seq_len": seq_len,
      "dim": dim,
      "depth": depth,
      "heads": heads,
      "real_tokens": float(tokens(batch)),
    },
    "param_count": sum(x.size for x in jax.tree.leaves(params)),
    "grad_bytes": grad_bytes,
    "target_in_step_temp_bytes": int(target),
    "steps": results,
    "state_bytes": state_bytes,
    "ratios": ratios,
    "compile_seconds": time.perf_counter() - start,
    "env": {
      "jax": jax.__version__,
      "optax": optax.__version__,
      "backend": jax.default_backend(),
      "device": str(jax.devices()[0].device_kind),
      "python": platform.python_version(),
    },
  }


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch-size", type=int, default=64, help="physical batch rows B")
  parser.add_argument("--microbatches", type=int, default=8, help="K")
  parser.add_argument("--seq-len", type=int, default=256)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--out", default=None, help="write the JSON here (else stdout)")
  parser.add_argument("--quick", action="store_true", help="B=16, K=4, a 1-block model")
  args = parser.parse_args(argv)
  if args.quick:
    args.batch_size, args.microbatches, args.seq_len = 16, 4, 32
    args.dim, args.depth, args.heads = 32, 1, 2
  if args.batch_size % args.microbatches:
    parser.error("--batch-size must be divisible by --microbatches")
  report = run(args.batch_size, args.microbatches, args.seq_len, args.dim, args.depth, args.heads)
  write_report(report, args.out)
  r = report["ratios"]
  print(
    f"temp bytes vs physical batch: in-step {r['in_step_temp_vs_physical']:.3f}, "
    f"across-step {r['across_step_temp_vs_physical']:.3f} (1/K = {1 / args.microbatches:.3f}); "
    f"in-step vs (physical/K + one gradient): {r['in_step_temp_vs_target']:.3f}",
    file=sys.stderr,
  )
  return report


if __name__ == "__main__":
  main()
