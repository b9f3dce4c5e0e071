"""What compiling one jitted step costs: accumulate vs optax.MultiSteps vs a plain adam step.

Each case is one jitted step with params and optimizer state donated, traced, lowered and
compiled once from abstract arguments (``jax.ShapeDtypeStruct``) in a fresh Python process (no
JAX cache, in memory or on disk, carries over between cases; each process first compiles a tiny
function so that backend start-up is not counted). Timed with ``time.process_time`` (the CPU time
of the process, all its threads): on a machine shared with other jobs it does not count the time
spent waiting for a core; wall times are recorded beside it. Models:

* ``leaves``: ``--leaves N`` float32 leaves of shape (64, 64); the step's gradients are an
  argument.
* ``transformer``: the demo's byte-level transformer (``optax_accum.demo.model``, ``--depth``
  blocks: 150 leaves at 12), forward + backward + optimizer in one step.

Variants (every_k 4):

* ``adam``: ``optax.adam(1e-3)`` update + ``optax.apply_updates``.
* ``multisteps``: ``optax.MultiSteps(adam, 4)`` update + ``optax.apply_updates``.
* ``accumulate``: ``optax_accum.accumulate(adam, 4)`` update + ``optax.apply_updates``.
* ``update_and_apply``: the fused step, ``optax_accum.update_and_apply(accumulate(adam, 4), ...)``.
* ``multisteps_clip``: ``optax.MultiSteps(chain(clip_by_global_norm(1.0), adam), 4)``, the
  reference of:
* ``all_features``: ``accumulate(chain(clip_by_global_norm(1.0), adam), 4,
  loss_scale=dynamic_loss_scale(), skip_if=spike_rule())`` update with ``value=`` (the loss, or a
  scalar argument) + ``optax.apply_updates``.

Reported per case: ``trace_s``, ``lower_s``, ``compile_s`` (medians over ``--repeats`` processes)
and the fusions of the compiled HLO (``tests/_hlo.py``: fusion instructions and distinct fused
computations, names stripped: a per-leaf difference makes one kernel per leaf); per model, ratios
against ``multisteps`` (``all_features`` against ``multisteps_clip``) and each variant's compile
time beyond ``adam``'s. docs/performance.md's compile table is rendered from this JSON by
``benchmarks/render_tables.py``.

  python benchmarks/compile.py --out benchmarks/results/compile.json
  python benchmarks/compile.py --quick                 # CI smoke run: 16 leaves, no transformer
  python benchmarks/compile.py --leaves 100 400 --depth 0 --variants accumulate multisteps
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
# This checkout's package and HLO helpers, not whichever optax_accum is installed.
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import optax_accum  # noqa: E402

try:
  from benchmarks.microstep import machine, write_report  # noqa: E402
except ImportError:  # run as a script: benchmarks/ is on sys.path
  from microstep import machine, write_report  # type: ignore[no-redef]  # noqa: E402

# The variants, in the table's order, and each one's reference for the ratios.
VARIANTS = (
  "adam",
  "multisteps",
  "accumulate",
  "update_and_apply",
  "multisteps_clip",
  "all_features",
)
REFERENCE = {"all_features": "multisteps_clip"}
EVERY_K = 4
LEAF_SHAPE = (64, 64)
PHASES = ("trace", "lower", "compile")


def make_tx(variant: str) -> optax.GradientTransformation:
  """The transformation of ``variant`` (see the module docstring)."""
  adam = optax.adam(1e-3)
  clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  if variant == "adam":
    return adam
  if variant == "multisteps":
    return optax.MultiSteps(adam, every_k_schedule=EVERY_K)
  if variant == "multisteps_clip":
    return optax.MultiSteps(clipped, every_k_schedule=EVERY_K)
  if variant in ("accumulate", "update_and_apply"):
    return optax_accum.accumulate(adam, every_k=EVERY_K)
  if variant == "all_features":
    return optax_accum.accumulate(
      clipped,
      every_k=EVERY_K,
      loss_scale=optax_accum.dynamic_loss_scale(),
      skip_if=optax_accum.spike_rule(),
    )
  raise ValueError(f"unknown variant {variant!r}; pass one of {', '.join(VARIANTS)}")


def apply(variant: str, tx: optax.GradientTransformation) -> Callable:
  """``(grads, state, params, value) -> (params, state)``: the variant's optimizer step."""

  def step(grads, state, params, value):
    if variant == "update_and_apply":
      return optax_accum.update_and_apply(tx, grads, state, params)
    extra = {"value": value} if variant == "all_features" else {}
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  return step


def leaves_case(num_leaves: int, variant: str) -> tuple[Callable, tuple]:
  """The jitted step of ``num_leaves`` (64, 64) float32 leaves and its abstract arguments."""
  params = {f"w{i:04d}": jax.ShapeDtypeStruct(LEAF_SHAPE, jnp.float32) for i in range(num_leaves)}
  tx = make_tx(variant)
  update = apply(variant, tx)
  step = lambda params, state, grads, value: update(grads, state, params, value)
  args = (params, jax.eval_shape(tx.init, params), params, jax.ShapeDtypeStruct((), jnp.float32))
  return jax.jit(step, donate_argnums=(0, 1)), args


def transformer_case(depth: int, variant: str) -> tuple[Callable, tuple]:
  """The demo transformer's jitted train step (loss, gradient, optimizer) and its arguments."""
  from flax import nnx

  from optax_accum.demo.model import CharTransformer, token_loss

  seq_len, batch = 64, 8
  model = CharTransformer(seq_len=seq_len, dim=64, depth=depth, heads=4, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(params))
  tx = make_tx(variant)
  update = apply(variant, tx)

  def loss_fn(params, batch):
    return token_loss(nnx.merge(graphdef, nnx.State(params), rest), batch)

  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return update(grads, state, params, loss)

  tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  data = {
    "inputs": tokens,
    "targets": tokens,
    "mask": jax.ShapeDtypeStruct(tokens.shape, jnp.float32),
  }
  return jax.jit(step, donate_argnums=(0, 1)), (params, jax.eval_shape(tx.init, params), data)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
  """``fn()``, its process CPU seconds and its wall seconds."""
  wall, cpu = time.perf_counter(), time.process_time()
  out = fn()
  return out, time.process_time() - cpu, time.perf_counter() - wall


def _warm_up() -> None:
  """Backend start-up, outside the timings: a tiny function with a gradient and a cond."""
  f = lambda x: jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, jax.grad(lambda y: (y * y).sum())(x))
  jax.jit(f).lower(jnp.ones(3)).compile()


def run_case(case: dict[str, Any]) -> dict[str, Any]:
  """Times one case in this process: ``{'trace': {'cpu_s', 'wall_s'}, ..., 'fusions', ...}``."""
  import _hlo

  jax.config.update("jax_enable_compilation_cache", False)
  _warm_up()
  if case["model"] == "leaves":
    jitted, args = leaves_case(case["leaves"], case["variant"])
  else:
    jitted, args = transformer_case(case["depth"], case["variant"])
  times = {}
  if hasattr(jitted, "trace"):  # JAX >= 0.4.30
    traced, *times["trace"] = _timed(lambda: jitted.trace(*args))
    lowered, *times["lower"] = _timed(traced.lower)
  else:  # the trace is part of lower
    lowered, *times["lower"] = _timed(lambda: jitted.lower(*args))
  compiled, *times["compile"] = _timed(lowered.compile)
  fusions = _hlo.fused_computations(compiled.as_text())
  return {
    **{phase: {"cpu_s": cpu, "wall_s": wall} for phase, (cpu, wall) in times.items()},
    "leaves": len(jax.tree.leaves(args[0])),
    "fusions": sum(fusions.values()),
    "distinct_fusions": len(fusions),
  }


def _in_fresh_process(case: dict[str, Any]) -> dict[str, Any]:
  """:func:`run_case` in a new Python process, with no persistent compilation cache."""
  env = dict(os.environ)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  cmd = [sys.executable, __file__, "--case", json.dumps(case)]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"case {case} failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.splitlines()[-1])


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
  """Medians over repeats: ``trace_s``, ``lower_s``, ``compile_s`` (CPU), their wall times, the
  samples, and the first repeat's fusion counts (``fusion_counts_differ`` lists them all if
  another repeat's differ: XLA should compile a program the same way every time)."""
  out: dict[str, Any] = {"repeats": len(samples)}
  for phase in PHASES:
    if phase in samples[0]:
      for clock, key in (("cpu_s", f"{phase}_s"), ("wall_s", f"{phase}_wall_s")):
        out[key] = statistics.median(s[phase][clock] for s in samples)
      out[f"{phase}_samples_s"] = [s[phase]["cpu_s"] for s in samples]
  out["fusions"], out["distinct_fusions"] = samples[0]["fusions"], samples[0]["distinct_fusions"]
  counts = {(s["fusions"], s["distinct_fusions"]) for s in samples}
  if len(counts) > 1:  # kept, not raised: the timings stand
    out["fusion_counts_differ"] = sorted(counts)
  return out


def ratios(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """Each variant's times over its reference's (``multisteps``; ``multisteps_clip`` for
  ``all_features``), and its compile seconds beyond ``adam``'s, where those were run."""
  out: dict[str, Any] = {}
  for name, v in variants.items():
    ref = variants.get(REFERENCE.get(name, "multisteps"))
    if ref is not None and name != "multisteps":
      phases = [p for p in PHASES if f"{p}_s" in v]
      out[f"{name}_over_{REFERENCE.get(name, 'multisteps')}"] = {
        p: v[f"{p}_s"] / ref[f"{p}_s"] for p in phases
      }
    if "adam" in variants and name != "adam":
      out.setdefault("extra_compile_over_adam_s", {})[name] = (
        v["compile_s"] - variants["adam"]["compile_s"]
      )
  extra = out.get("extra_compile_over_adam_s", {})
  if {"accumulate", "multisteps"} <= set(extra):
    out["accumulate_extra_over_multisteps_extra"] = extra["accumulate"] / extra["multisteps"]
  return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--leaves", type=int, nargs="+", default=[100, 400, 1000])
  parser.add_argument("--depth", type=int, default=12, help="transformer blocks; 0: no transformer")
  parser.add_argument("--repeats", type=int, default=3, help="fresh processes per case")
  parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
  parser.add_argument("--out", default=None, help="write the JSON here (else stdout)")
  parser.add_argument("--quick", action="store_true", help="16 leaves, no transformer, 1 repeat")
  parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process
  args = parser.parse_args(argv)
  if args.case:
    print(json.dumps(run_case(json.loads(args.case))))
    return {}
  if args.quick:
    args.leaves, args.depth, args.repeats = [16], 0, 1
  if args.repeats < 1 or any(n < 1 for n in args.leaves) or args.depth < 0:
    parser.error("--repeats and --leaves take positive counts, --depth one >= 0")
  models = [{"model": "leaves", "leaves": n} for n in args.leaves]
  models += [{"model": "transformer", "depth": args.depth}] if args.depth else []
  samples: dict[int, dict[str, list]] = {
    i: {v: [] for v in args.variants} for i in range(len(models))
  }
  for r in range(args.repeats):  # every case once per round: load from other jobs spreads over all
    for i, model in enumerate(models):
      for variant in args.variants:
        s = _in_fresh_process({**model, "variant": variant})
        samples[i][variant].append(s)
        cells = "  ".join(f"{p} {s[p]['cpu_s']:6.2f}" for p in PHASES if p in s)
        label = f"{model['model']} {model.get('leaves', model.get('depth'))}"
        print(f"round {r + 1} {label:15s} {variant:17s} {cells} s", file=sys.stderr, flush=True)
  results = []
  for i, model in enumerate(models):
    variants = {v: summarize(samples[i][v]) for v in args.variants}
    leaves = {v["leaves"] for s in samples[i].values() for v in s}
    results.append(
      {**model, "leaves": leaves.pop(), "variants": variants, "ratios": ratios(variants)}
    )
  report = {
    "benchmark": "compile",
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "machine": machine(),
    "timer": "time.process_time (CPU seconds of the process, all threads)",
    "args": {k: v for k, v in vars(args).items() if k != "case"},
    "every_k": EVERY_K,
    "leaf_shape": list(LEAF_SHAPE),
    "results": results,
  }
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
