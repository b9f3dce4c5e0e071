"""How far an accumulated run's loss drifts from the physical run's, next to optax.MultiSteps'.

One window of ``K`` microbatches equals one physical batch to rounding (the pre-flight checks one
step). Over a run the two sum their gradients in another order, so every update differs by
rounding, and the runs can drift apart: a user comparing loss curves sees the difference and may
read it as a fault of the library. ``optax.MultiSteps`` on the same microbatches is the control:
its mean is the same arithmetic up to rounding, so a gap it shares is the precision's, not the
weighting's. SGD and Adam are both run (Adam divides each element by ``sqrt(v) + eps``, so a
rounding-sized gradient element can get a learning-rate-sized step).

The model is the demo's byte-level transformer at its ``--quick`` sizes, on the standard
library's text packed into full rows (no padding: every microbatch holds the same tokens, so
weight 1 and ``MultiSteps``' mean are exact, and only rounding differs), with float32 compute
and, as a second run, bfloat16 compute (float32 params: what a GPU's TF32 or 16-bit matmuls do
to the rounding). Each optimizer trains the same initial params for ``--updates`` updates three
ways: the physical batch (one ``jax.grad`` over the ``K`` microbatches' rows), ``accumulate(inner,
K)`` and ``optax.MultiSteps(inner, K)``; after each update, the held-out loss of each run's
params. The gap is ``max over updates |loss(run) - loss(physical)|``, in nats per token.

  python benchmarks/float32_drift.py --out benchmarks/results/float32_drift.json
  python benchmarks/float32_drift.py --quick --dtypes float32     # CI smoke run
  python benchmarks/render_tables.py      # docs/porting.md's drift table
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
from microstep import machine, write_report

import optax_accum
from optax_accum.demo import data, model, setup

# The optimizers compared, at the learning rates the demo's quick run trains well with.
INNERS = {"adam": ("optax.adam", 3e-3), "sgd": ("optax.sgd", 0.3)}
RUNS = ("accumulate", "multisteps")
HELD_OUT_ROWS = 64
DTYPES = ("float32", "bfloat16")


def packed(config: setup.DemoConfig, rows: int) -> dict[str, np.ndarray]:
  """``rows`` full rows of ``seq_len + 1`` bytes of the standard library's text, back to back."""
  text = b"\n".join(data.stdlib_lines(max_files=config.max_files))
  ids = np.frombuffer(text, np.uint8).astype(np.int32)
  n = config.seq_len + 1
  if rows * n > ids.size:
    raise ValueError(f"rows={rows} needs {rows * n} bytes of text; there are {ids.size}")
  tokens = ids[: rows * n].reshape(rows, n)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((rows, n - 1))}


def _inner(name: str) -> optax.GradientTransformation:
  return optax.adam(INNERS[name][1]) if name == "adam" else optax.sgd(INNERS[name][1])


def drift(
  updates: int = 30,
  every_k: int = 4,
  microbatch_size: int = 8,
  seed: int = 0,
  compute_dtype: str = "float32",
  config: setup.DemoConfig = setup.QUICK,
) -> dict[str, Any]:
  """Trains the quick demo model three ways per optimizer; returns each run's loss gaps.

  Args:
    updates: updates (windows) per run.
    every_k: microbatches per window (``K``).
    microbatch_size: rows per microbatch.
    seed: the params' init.
    compute_dtype: the model's compute dtype (``'float32'`` or ``'bfloat16'``; params float32).
    config: the model's sizes (the demo's ``--quick`` ones by default).

  Returns:
    ``{'config': ..., 'results': {inner: {'learning_rate', 'physical_loss': [...],
    'gap': {run: max gap}, 'final_gap': {run: gap after the last update}}}}``, losses in nats
    per token, gaps of ``accumulate`` and ``multisteps`` against the physical batch.
  """
  k, rows = every_k, every_k * microbatch_size
  text = packed(config, rows * updates + HELD_OUT_ROWS)
  train = {key: v[: rows * updates] for key, v in text.items()}
  held_out = {key: jnp.asarray(v[rows * updates :]) for key, v in text.items()}
  net = model.CharTransformer(
    seq_len=config.seq_len,
    dim=config.dim,
    depth=config.depth,
    heads=config.heads,
    rngs=nnx.Rngs(seed),
    dtype=jnp.dtype(compute_dtype),
  )
  graphdef, state = nnx.split(net, nnx.Param)
  params0 = (getattr(nnx, "as_pure", None) or nnx.pure)(state)  # arrays (nnx.pure before 0.12.7)

  def loss_fn(params, batch):
    return model.token_loss(nnx.merge(graphdef, params), batch)

  evaluate = jax.jit(loss_fn)
  grad = jax.jit(jax.grad(loss_fn))
  out: dict[str, Any] = {}
  for name in INNERS:
    inner = _inner(name)
    txs = {
      "physical": inner,
      "accumulate": optax_accum.accumulate(inner, every_k=k),
      "multisteps": optax.MultiSteps(inner, every_k_schedule=k),
    }
    steps = {run: jax.jit(functools.partial(_step, tx)) for run, tx in txs.items()}
    params = {run: params0 for run in txs}
    states = {run: tx.init(params0) for run, tx in txs.items()}
    losses: dict[str, list[float]] = {run: [] for run in txs}
    for t in range(updates):
      batch = {key: jnp.asarray(v[t * rows : (t + 1) * rows]) for key, v in train.items()}
      run = "physical"
      params[run], states[run] = steps[run](params[run], states[run], grad(params[run], batch))
      for run in RUNS:
        for i in range(k):
          mb = jax.tree.map(
            lambda v, i=i: v[i * microbatch_size : (i + 1) * microbatch_size], batch
          )
          params[run], states[run] = steps[run](params[run], states[run], grad(params[run], mb))
      for run in txs:
        losses[run].append(float(evaluate(params[run], held_out)))
    phys = np.asarray(losses["physical"], np.float64)
    gaps = {run: np.abs(np.asarray(losses[run], np.float64) - phys) for run in RUNS}
    out[name] = {
      "learning_rate": INNERS[name][1],
      "physical_loss": losses["physical"],
      "gap": {run: float(g.max()) for run, g in gaps.items()},
      "final_gap": {run: float(g[-1]) for run, g in gaps.items()},
    }
  cfg = {
    "model": "the demo's CharTransformer, --quick sizes",
    "compute_dtype": compute_dtype,
    "seq_len": config.seq_len,
    "dim": config.dim,
    "depth": config.depth,
    "heads": config.heads,
    "num_params": int(sum(x.size for x in jax.tree.leaves(params0))),
    "updates": updates,
    "every_k": k,
    "microbatch_size": microbatch_size,
    "held_out_rows": HELD_OUT_ROWS,
    "seed": seed,
  }
  return {"config": cfg, "results": out}


def _step(tx, params, state, grads):
  """One ``tx.update`` and ``optax.apply_updates``."""
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--updates", type=int, default=30)
  parser.add_argument("--every-k", type=int, default=4)
  parser.add_argument("--microbatch-size", type=int, default=8)
  parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
  parser.add_argument("--quick", action="store_true", help="3 updates: a smoke run")
  parser.add_argument("--out", help="JSON file (default: stdout)")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  updates = 3 if args.quick else args.updates
  runs = [drift(updates, args.every_k, args.microbatch_size, compute_dtype=d) for d in args.dtypes]
  report = {"benchmark": "float32_drift", "machine": machine(), "runs": runs}
  report["seconds"] = round(time.perf_counter() - start, 1)
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main(sys.argv[1:])
