"""What one microstep costs: accumulate vs optax.MultiSteps vs a plain step vs the floor.

Every variant is a jitted ``tx.update`` + apply step with params and optimizer
state donated, run on the same params in one process. Variants:

* ``floor``: ``acc += g`` alone (acc donated): the least any across-step
  accumulation can cost per microstep.
* ``plain``: the inner optimizer alone, ``tx.update`` + ``optax.apply_updates``.
* ``multisteps``: ``optax.MultiSteps(inner, every_k)`` + ``optax.apply_updates``.
* ``accumulate``: ``optax_accum.accumulate(inner, every_k)`` + ``optax.apply_updates``
  (the default optax path).
* ``accumulate_fused``: the recommended train step,
  ``optax_accum.update_and_apply(accumulate(...), ...)``: no update buffer.
* ``accumulate_noise``, ``accumulate_fused_noise``: the two above with
  ``observe=(optax_accum.noise_scale(0.9),)`` (the gradient noise scale: one more scalar per
  microstep, ``weight * |g|^2``, and its estimate at the boundary).
* ``accumulate_fused_guard``: ``accumulate_fused`` with
  ``skip_if=spike_rule("grad_norm")`` (the boundary guard: a few scalars and a
  ring of 128 norms at the boundary, nothing between).
* ``nnx_optimizer``: an NNX model step through ``optax_accum.flax.Optimizer``.
* ``train_state``: a Linen-style step through ``optax_accum.flax.TrainState``.

The README's performance table is rendered from this JSON by
``benchmarks/render_tables.py`` (never copied by hand).

Rounds are interleaved (one whole window of ``every_k`` calls per variant per
round, variant order rotated) so that load from other processes spreads over
all variants. Reported per variant: median time of non-boundary microsteps,
of boundary steps, the window average ``((k-1) * non_boundary + boundary) / k``,
their 25th/75th percentiles (the noise), the compiled memory
(``memory_analysis()``) and the number of parameter-sized ``copy`` instructions
in the optimized HLO.

  python benchmarks/microstep.py --out microstep.json
  python benchmarks/microstep.py --quick          # CI smoke run, seconds
  python benchmarks/microstep.py --sizes 4e6 --inner adam --every-k 4 --rounds 5 --no-flax \
      --variants accumulate accumulate_noise accumulate_fused accumulate_fused_noise
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from optax_accum.demo import record

# Trees kept alive per variant (params, optimizer state, temporaries), plus the gradient.
_TREES_ALIVE = 20


def make_params(n: int, leaves: int = 8) -> dict[str, jax.Array]:
  """``n`` float32 params in ``leaves`` equal matrices (typical equal-shape layers)."""
  rows = max(1, n // (leaves * 1024))
  return {f"w{i}": jnp.full((rows, 1024), 0.01 * (i + 1), jnp.float32) for i in range(leaves)}


def fresh(tree: Any) -> Any:
  """A copy of ``tree`` in new buffers (so that donation never hits a shared one)."""
  return jax.tree.map(lambda x: jax.device_put(np.asarray(x)), tree)


def make_inner(name: str) -> optax.GradientTransformation:
  if name == "adam":
    return optax.adam(1e-3)
  if name == "adamw":
    return optax.adamw(1e-3, weight_decay=1e-2)
  raise ValueError(f"unknown inner optimizer {name!r}")


def tx_step(tx: optax.GradientTransformation, apply: str) -> Callable:
  """A jitted, donated ``(params, state, grads) -> (params, state)`` step.

  ``apply``: ``"plain"`` (``tx.update`` + ``optax.apply_updates``) or
  ``"fused"`` (``update_and_apply``).
  """

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    if apply == "fused":
      return optax_accum.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def nnx_run(tx: optax.GradientTransformation, params: dict[str, jax.Array]) -> list[Any]:
  """``[step, model_state, None]``: a donated NNX step with ``optax_accum.flax.Optimizer``."""
  from flax import nnx

  import optax_accum.flax

  class Model(nnx.Module):
    def __init__(self):
      for name, p in params.items():
        setattr(self, name, nnx.Param(jnp.array(p)))

  model = Model()
  opt = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(state, _, grads):
    model, opt = nnx.merge(graphdef, state)
    opt.update(model, grads)
    return nnx.state((model, opt)), None

  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), nnx.state(model, nnx.Param))
  return [step, state, None, grads]


def train_state_run(tx: optax.GradientTransformation, params: dict[str, jax.Array]) -> list[Any]:
  """``[step, train_state, None]``: a donated step with ``optax_accum.flax.TrainState``."""
  import optax_accum.flax

  state = optax_accum.flax.TrainState.create(apply_fn=None, params=fresh(params), tx=tx)

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(state, _, grads):
    return state.apply_gradients(grads=grads), None

  return [step, state, None, None]


@functools.partial(jax.jit, donate_argnums=(0,))
def _floor_add(acc, grads):
  return jax.tree.map(jnp.add, acc, grads)


def floor_step(params, acc, grads):
  """``acc += g`` (acc donated): the floor of across-step accumulation."""
  return params, _floor_add(acc, grads)


def compiled_info(step: Callable, *args: Any, leaf_shape: tuple[int, ...]) -> dict[str, Any]:
  """Memory analysis and parameter-sized copies of the compiled step."""
  compiled = step.lower(*args).compile()
  mem = compiled.memory_analysis()
  shape = "f32[" + ",".join(str(d) for d in leaf_shape) + "]"
  copies = [
    line
    for line in compiled.as_text().splitlines()
    if re.search(r"= " + re.escape(shape) + r"\{[^}]*\} copy\(", line)
  ]
  return {
    "argument_bytes": int(mem.argument_size_in_bytes),
    "output_bytes": int(mem.output_size_in_bytes),
    "alias_bytes": int(mem.alias_size_in_bytes),
    "temp_bytes": int(mem.temp_size_in_bytes),
    "param_sized_copies": len(copies),
  }


def tree_bytes(tree: Any) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def summarize(samples: list[tuple[int, float]], k: int) -> dict[str, float]:
  non = np.array([t for i, t in samples if i != k - 1]) * 1e3
  bnd = np.array([t for i, t in samples if i == k - 1]) * 1e3
  out = {
    "all_ms": float(np.median(np.array([t for _, t in samples]) * 1e3)),
    "non_boundary_ms": float(np.median(non)) if non.size else float("nan"),
    "non_boundary_p25_ms": float(np.percentile(non, 25)) if non.size else float("nan"),
    "non_boundary_p75_ms": float(np.percentile(non, 75)) if non.size else float("nan"),
    "boundary_ms": float(np.median(bnd)),
    "boundary_p25_ms": float(np.percentile(bnd, 25)),
    "boundary_p75_ms": float(np.percentile(bnd, 75)),
  }
  non_ms = out["non_boundary_ms"] if non.size else out["boundary_ms"]
  out["window_avg_ms"] = ((k - 1) * non_ms + out["boundary_ms"]) / k
  return out


# The variants (and the README's rows, benchmarks/render_tables.py), in order.
VARIANTS = (
  "floor",
  "plain",
  "multisteps",
  "accumulate",
  "accumulate_fused",
  "accumulate_noise",
  "accumulate_fused_noise",
  "accumulate_fused_guard",
  "nnx_optimizer",
  "train_state",
)
NOISE_DECAY = 0.9


def run_config(
  n: int, inner_name: str, k: int, rounds: int, with_flax: bool, only: tuple[str, ...] = VARIANTS
) -> dict[str, Any]:
  """The variants in ``only`` for one (size, inner, every_k), interleaved."""
  inner = make_inner(inner_name)
  params = make_params(n)
  leaf_shape = next(iter(params.values())).shape
  grads = fresh(jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params))
  noisy = optax_accum.accumulate(inner, every_k=k, observe=(optax_accum.noise_scale(NOISE_DECAY),))
  txs = {
    "plain": (inner, "plain"),
    "multisteps": (optax.MultiSteps(inner, every_k_schedule=k), "plain"),
    "accumulate": (optax_accum.accumulate(inner, every_k=k), "plain"),
    "accumulate_fused": (optax_accum.accumulate(inner, every_k=k), "fused"),
    "accumulate_noise": (noisy, "plain"),
    "accumulate_fused_noise": (noisy, "fused"),
    "accumulate_fused_guard": (
      optax_accum.accumulate(inner, every_k=k, skip_if=optax_accum.spike_rule("grad_norm")),
      "fused",
    ),
  }
  txs = {name: v for name, v in txs.items() if name in only}
  # run = [step, first arg, second arg, grads]; step(a, b, grads) -> (a, b), a and b donated.
  runs: dict[str, list[Any]] = {}
  info: dict[str, dict[str, Any]] = {}
  if "floor" in only:
    acc = fresh(jax.tree.map(jnp.zeros_like, params))
    runs["floor"] = [floor_step, fresh(params), acc, grads]
    info["floor"] = compiled_info(_floor_add, acc, grads, leaf_shape=leaf_shape)
    info["floor"]["state_bytes"] = tree_bytes(acc)
  for name, (tx, apply) in txs.items():
    p = fresh(params)
    s = fresh(tx.init(p))
    step = tx_step(tx, apply)
    info[name] = compiled_info(step, p, s, grads, leaf_shape=leaf_shape)
    info[name]["state_bytes"] = tree_bytes(s)
    runs[name] = [step, p, s, grads]
  if with_flax:
    for name, make in (("nnx_optimizer", nnx_run), ("train_state", train_state_run)):
      if name not in only:
        continue
      run = make(optax_accum.accumulate(inner, every_k=k), params)
      run[3] = grads if run[3] is None else run[3]
      info[name] = compiled_info(*run, leaf_shape=leaf_shape)
      runs[name] = run
  # Warm-up: compile and run one whole window each.
  for run in runs.values():
    for _ in range(k):
      run[1], run[2] = run[0](run[1], run[2], run[3])
    jax.block_until_ready(run[1:3])
  samples: dict[str, list[tuple[int, float]]] = {name: [] for name in runs}
  names = list(runs)
  for r in range(rounds):
    order = names[r % len(names) :] + names[: r % len(names)]
    for name in order:
      run = runs[name]
      for i in range(k):
        t0 = time.perf_counter()
        run[1], run[2] = run[0](run[1], run[2], run[3])
        jax.block_until_ready(run[1:3])
        samples[name].append((i, time.perf_counter() - t0))
  variants = {name: {**summarize(samples[name], k), **info[name]} for name in runs}
  del runs
  inner_state_bytes = tree_bytes(jax.eval_shape(inner.init, params))
  param_bytes = tree_bytes(params)
  return {
    "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
    "inner": inner_name,
    "every_k": k,
    "rounds": rounds,
    "param_bytes": param_bytes,
    "inner_state_bytes": inner_state_bytes,
    "variants": variants,
    "ratios": ratios(variants, inner_state_bytes, param_bytes),
  }


def ratios(v: dict[str, dict[str, Any]], inner_state_bytes: int, param_bytes: int) -> dict:
  """The README's ratios, each where the variants it needs were run."""
  out = {}

  def put(key: str, needs: tuple[str, ...], fn: Callable[[], float]) -> None:
    if all(name in v for name in needs):
      out[key] = fn()

  floor = lambda: v["floor"]["all_ms"]
  # The default optax path (tx.update + optax.apply_updates); goal <= 2.6 (limit 7/3).
  put(
    "non_boundary_over_floor",
    ("accumulate", "floor"),
    lambda: v["accumulate"]["non_boundary_ms"] / floor(),
  )
  put(
    "window_avg_over_multisteps",
    ("accumulate", "multisteps"),
    lambda: v["accumulate"]["window_avg_ms"] / v["multisteps"]["window_avg_ms"],
  )
  # The fused path (update_and_apply); goals <= 1.15 and <= 1.3.
  put(
    "non_boundary_fused_over_floor",
    ("accumulate_fused", "floor"),
    lambda: v["accumulate_fused"]["non_boundary_ms"] / floor(),
  )
  put(
    "boundary_fused_over_plain_plus_floor",
    ("accumulate_fused", "plain", "floor"),
    lambda: v["accumulate_fused"]["boundary_ms"] / (v["plain"]["all_ms"] + floor()),
  )
  put(
    "window_avg_fused_over_multisteps",
    ("accumulate_fused", "multisteps"),
    lambda: v["accumulate_fused"]["window_avg_ms"] / v["multisteps"]["window_avg_ms"],
  )
  put(
    "temp_fused_minus_plain_in_grad_buffers",
    ("accumulate_fused", "plain"),
    lambda: (v["accumulate_fused"]["temp_bytes"] - v["plain"]["temp_bytes"]) / param_bytes,
  )
  put(
    "temp_minus_plain_in_grad_buffers",
    ("accumulate", "plain"),
    lambda: (v["accumulate"]["temp_bytes"] - v["plain"]["temp_bytes"]) / param_bytes,
  )
  put(
    "state_extra_bytes_over_inner_plus_acc",
    ("accumulate",),
    lambda: v["accumulate"]["state_bytes"] - inner_state_bytes - param_bytes,
  )
  # The noise scale's cost (the noise_scale observer on / off); goal <= 1.05 on both paths.
  for path in ("", "fused_"):
    on, off = f"accumulate_{path}noise", f"accumulate{'_fused' if path else ''}"
    put(
      f"non_boundary_{path}noise_over_off",
      (on, off),
      lambda on=on, off=off: v[on]["non_boundary_ms"] / v[off]["non_boundary_ms"],
    )
  # The boundary guard's cost (skip_if=spike_rule("grad_norm") on / off), fused path.
  for when in ("boundary", "non_boundary"):
    put(
      f"{when}_fused_guard_over_off",
      ("accumulate_fused_guard", "accumulate_fused"),
      lambda when=when: (
        v["accumulate_fused_guard"][f"{when}_ms"] / v["accumulate_fused"][f"{when}_ms"]
      ),
    )
  for name in ("nnx_optimizer", "train_state"):
    put(
      f"non_boundary_{name}_over_floor",
      (name, "floor"),
      lambda name=name: v[name]["non_boundary_ms"] / floor(),
    )
  return out


def available_bytes() -> float:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return float(line.split()[1]) * 1024
  except OSError:
    pass
  return float("inf")


def write_report(report: dict[str, Any], out: str | None) -> None:
  """Writes a benchmark's JSON report to the file ``out``, or to stdout when it is None."""
  text = json.dumps(report, indent=1) + "\n"
  if out:
    with open(out, "w") as f:
      f.write(text)
  else:
    sys.stdout.write(text)


def machine() -> dict[str, Any]:
  """Where the benchmark ran (the demo's record of it) and on which JAX devices."""
  return {**record.machine(), "devices": [str(d) for d in jax.devices()]}


def median_ms(fn: Callable[[], object], calls: int) -> float:
  """The median wall time of ``calls`` calls of ``fn`` in ms, after one call that compiles (or
  warms op-by-op caches)."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(calls):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - t) * 1e3)
  return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 16e6, 100e6])
  parser.add_argument("--inner", nargs="+", default=["adam", "adamw"])
  parser.add_argument("--every-k", type=int, nargs="+", default=[4, 16])
  parser.add_argument("--rounds", type=int, default=10, help="interleaved windows per variant")
  parser.add_argument("--max-gib", type=float, default=8.0, help="skip sizes above this")
  parser.add_argument("--out", default=None, help="write the JSON here (else stdout)")
  parser.add_argument("--quick", action="store_true", help="262k params, adam, every_k=4, 2 rounds")
  parser.add_argument("--no-flax", action="store_true", help="skip the NNX and TrainState rows")
  parser.add_argument(
    "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="run only these"
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.sizes, args.inner, args.every_k, args.rounds = [2**18], ["adam"], [4], 2
  results, skipped = [], []
  for size in args.sizes:
    n = int(size)
    need = _TREES_ALIVE * 4 * n
    if need > min(args.max_gib * 2**30, 0.6 * available_bytes()):
      skipped.append({"num_params": n, "reason": f"needs ~{need / 2**30:.1f} GiB"})
      continue
    for inner_name in args.inner:
      for k in args.every_k:
        rounds = max(args.rounds, 1)
        only = tuple(args.variants)
        res = run_config(n, inner_name, k, rounds, with_flax=not args.no_flax, only=only)
        results.append(res)
        g = res["variants"]
        if set(only) != set(VARIANTS):
          times = {name: round(v["non_boundary_ms"], 2) for name, v in g.items()}
          print(f"n={n:,} {inner_name} k={k} non-boundary ms {times}", file=sys.stderr)
          continue
        print(
          f"n={n:>11,} {inner_name:5s} k={k:<2d}  floor {g['floor']['all_ms']:7.1f}  "
          f"plain {g['plain']['all_ms']:7.1f}  multisteps {g['multisteps']['window_avg_ms']:7.1f}"
          f"  apply_updates non-bnd {g['accumulate']['non_boundary_ms']:7.1f} "
          f"bnd {g['accumulate']['boundary_ms']:7.1f}"
          f"  fused non-bnd {g['accumulate_fused']['non_boundary_ms']:7.1f} "
          f"bnd {g['accumulate_fused']['boundary_ms']:7.1f} ms",
          file=sys.stderr,
          flush=True,
        )
  report = {
    "benchmark": "microstep",
    "machine": machine(),
    "args": vars(args),
    "results": results,
    "skipped": skipped,
  }
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
