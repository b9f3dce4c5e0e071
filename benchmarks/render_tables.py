"""Renders the README's performance tables from the benchmarks' JSON.

The numbers in README.md between ``<!-- microstep-table:begin -->`` and
``<!-- microstep-table:end -->`` (and the ``eager-table`` markers), in docs/in_step.md
between the ``mesh-table`` markers and in docs/scaling.md between the ``hsdp-table``
markers and in docs/noise_scale.md between the ``adaptive-table`` markers are never edited by
hand: run the benchmarks, then this script.

  python benchmarks/microstep.py --sizes 4e6 16e6 --inner adam adamw --every-k 4 16 \\
      --out benchmarks/results/microstep.json
  python benchmarks/eager.py --out benchmarks/results/eager.json
  python benchmarks/train_step.py --devices 8 --batch 64 --every-k 4 --seq-len 64 --dim 128 \\
      --depth 2 --heads 4 --rounds 5 --out benchmarks/results/train_step_8dev.json
  python benchmarks/adaptive_windows.py --out benchmarks/results/adaptive_windows.json
  python benchmarks/render_tables.py            # rewrites the README blocks
  python benchmarks/render_tables.py --check    # exit 1 if README and JSON disagree
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
JSON = ROOT / "benchmarks" / "results" / "microstep.json"
EAGER_JSON = ROOT / "benchmarks" / "results" / "eager.json"
TRAIN_STEP_JSON = ROOT / "benchmarks" / "results" / "train_step_8dev.json"
ADAPTIVE_JSON = ROOT / "benchmarks" / "results" / "adaptive_windows.json"
NOISE_DOC = ROOT / "docs" / "noise_scale.md"
ADAPTIVE = ("<!-- adaptive-table:begin -->", "<!-- adaptive-table:end -->")
ADAPTIVE_ARMS = ("fixed", "adaptive", "adaptive_same_lr", "fixed_mean")
README = ROOT / "README.md"
IN_STEP_DOC = ROOT / "docs" / "in_step.md"
SCALING_DOC = ROOT / "docs" / "scaling.md"
MESH = ("<!-- mesh-table:begin -->", "<!-- mesh-table:end -->")
HSDP = ("<!-- hsdp-table:begin -->", "<!-- hsdp-table:end -->")
# (key, label, where the collectives run) of train_step.py's mesh rows, in order.
MESH_ROWS = [
  ("physical", "physical batch, `jit`", "after the backward pass"),
  (
    "in_step_jit_per_microbatch",
    "in-step, `jit`, no `axis_name` (before)",
    "{loop} all-reduces in the scan body, {k} times",
  ),
  ("in_step_jit", 'in-step, `jit`, `axis_name="data"`', "one variadic all-reduce after the scan"),
  ("in_step_shard_map", 'in-step, `shard_map`, `axis_name="data"`', "one psum after the scan"),
  (
    "across_step_shard_map",
    "across-step, `shard_map`, `accumulate(axis_name=)`",
    "in the boundary branch",
  ),
]
HSDP_ROWS = [
  ("physical", "physical batch, `jit`"),
  ("across_step_jit", "across-step, plain `jit` with the mesh set (before)"),
  ("across_step_shard_map", 'across-step, HSDP `shard_map`, `axis_name="replica"` (after)'),
  ("in_step", 'in-step, `jit`, `axis_name="replica"`'),
]
BEGIN, END = "<!-- microstep-table:begin -->", "<!-- microstep-table:end -->"
EAGER = ("<!-- eager-table:begin -->", "<!-- eager-table:end -->")
EAGER_ROWS = [
  ("adam", "plain `optax.adam` update"),
  ("multisteps", "`optax.MultiSteps(adam, 4)` update"),
  ("accumulate", "`accumulate(adam, 4)` update"),
  ("update_and_apply", "`update_and_apply`"),
  ("flush", "`flush`"),
  ("metrics", "`metrics`"),
]

ROWS = [
  ("floor", "floor: `acc += g` alone"),
  ("plain", "plain inner step (no accumulation)"),
  ("multisteps", "`optax.MultiSteps` + `optax.apply_updates`"),
  ("accumulate", "`accumulate` + `optax.apply_updates`"),
  ("accumulate_fused", "**`update_and_apply`**"),
  ("accumulate_noise", "`accumulate(..., noise_scale_decay=0.9)` + `optax.apply_updates`"),
  ("accumulate_fused_noise", "`update_and_apply`, `noise_scale_decay=0.9`"),
  ("accumulate_fused_guard", "`update_and_apply`, `skip_if=spike_rule(...)`"),
  ("nnx_optimizer", "`optax_accum.flax.Optimizer` (NNX)"),
  ("train_state", "`optax_accum.flax.TrainState`"),
]
GOALS = [
  ("non_boundary_over_floor", "`apply_updates` non-boundary / floor", "<= 2.6"),
  ("window_avg_over_multisteps", "`apply_updates` window avg / MultiSteps", "<= 0.17 at k=16"),
  ("non_boundary_fused_over_floor", "`update_and_apply` non-boundary / floor", "<= 1.15"),
  (
    "boundary_fused_over_plain_plus_floor",
    "`update_and_apply` boundary / (plain + floor)",
    "<= 1.3",
  ),
  ("non_boundary_noise_over_off", "noise scale on / off, `apply_updates` non-boundary", "<= 1.05"),
  (
    "non_boundary_fused_noise_over_off",
    "noise scale on / off, `update_and_apply` non-boundary",
    "<= 1.05",
  ),
  ("non_boundary_nnx_optimizer_over_floor", "`flax.Optimizer` non-boundary / floor", "-"),
  ("non_boundary_train_state_over_floor", "`TrainState` non-boundary / floor", "-"),
]


def _ms(x: float) -> str:
  return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _size(n: int) -> str:
  return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def render(report: dict[str, Any]) -> str:
  """The markdown block (without the markers) for a microstep benchmark report."""
  results = report["results"]
  main = max(results, key=lambda r: (r["num_params"], r["every_k"], r["inner"] == "adam"))
  head = f"{_size(main['num_params'])} params, {main['inner']}, every_k={main['every_k']}, ms"
  lines = [
    f"| {head} | non-boundary | boundary | window avg |",
    "| --- | --- | --- | --- |",
  ]
  for key, label in ROWS:
    v = main["variants"].get(key)
    if v is not None:
      cells = [v["non_boundary_ms"], v["boundary_ms"], v["window_avg_ms"]]
      lines.append(f"| {label} | " + " | ".join(_ms(c) for c in cells) + " |")
  configs = [f"{_size(r['num_params'])} {r['inner']} k={r['every_k']}" for r in results]
  lines += ["", "| ratio | goal | " + " | ".join(configs) + " |"]
  lines.append("| --- | --- | " + " | ".join("---" for _ in results) + " |")
  for key, label, goal in GOALS:
    if all(key in r["ratios"] for r in results):
      cells = " | ".join(f"{r['ratios'][key]:.2f}" for r in results)
      lines.append(f"| {label} | {goal} | {cells} |")
  extra = main["ratios"].get("state_extra_bytes_over_inner_plus_acc")
  if extra is not None:
    copies = {k: v["param_sized_copies"] for k, v in main["variants"].items()}
    lines += [
      "",
      f"Optimizer state: inner state + one accumulator + {extra:.0f} bytes. Parameter-sized"
      f" copies in the compiled step: `update_and_apply` {copies['accumulate_fused']},"
      f" `accumulate` + `optax.apply_updates` {copies['accumulate']} (the boundary's updates"
      f" copied into the accumulator, one per leaf), `optax.MultiSteps` {copies['multisteps']}.",
    ]
  m = report["machine"]
  load = m.get("load_average")
  shared = f", 1-minute load average {load[0]:.1f} at the end" if load else ""
  lines += [
    "",
    f"Medians of {main['rounds']} interleaved windows per variant, every step jitted with params"
    f" and state donated, all variants in one process; {m['cpu_count']}-core {m['processor']},"
    f" jax {m['jax']}, optax {m['optax']}{shared}. Source: `benchmarks/results/microstep.json`,"
    " rendered"
    " by `benchmarks/render_tables.py`.",
  ]
  return "\n".join(lines)


def render_eager(report: dict[str, Any]) -> str:
  """The markdown block (without the markers) for an eager benchmark report."""
  results = report["results"]
  sizes = [_size(r["num_params"]) for r in results]
  lines = [
    "| eager call, ms (x plain adam) | " + " | ".join(f"{s} params" for s in sizes) + " |",
    "| --- | " + " | ".join("---" for _ in results) + " |",
  ]
  for key, label in EAGER_ROWS:
    cells = [f"{r['ms'][key]:.2f} ({r['over_adam'][key]:.2g}x)" for r in results]
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  m = report["machine"]
  lines += [
    "",
    f"Medians of {results[0]['calls']} calls after a warm-up call, all in one process;"
    f" {m['cpu_count']}-core {m['processor']}, jax {m['jax']}, optax {m['optax']}. Source:"
    " `benchmarks/results/eager.json`, rendered by `benchmarks/render_tables.py`.",
  ]
  return "\n".join(lines)


def _timing(v: dict[str, Any]) -> str:
  return f"{v['window_ms']:.0f} ({v['window_p25_ms']:.0f}-{v['window_p75_ms']:.0f})"


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f} MiB" if n < 10 * 2**20 else f"{n / 2**20:.1f} MiB"


def _model(report: dict[str, Any]) -> str:
  a = report["args"]
  size = f"{report['num_params'] / 1e6:.2f}M"
  return f"{size}-param transformer, B={a['batch']}, K={a['every_k']}, T={a['seq_len']}"


def render_mesh(report: dict[str, Any]) -> str:
  """docs/in_step.md's table of train_step.py's ``data``-axis mesh rows."""
  rows, k = report["mesh"]["variants"], report["args"]["every_k"]
  lines = [
    f"| {_model(report)} | collectives per window | where | compiled temp"
    " | ms per window, median (p25-p75) |",
    "| --- | --- | --- | --- | --- |",
  ]
  for key, label, where in MESH_ROWS:
    v = rows[key]
    loop = sum(v["collectives"]["in_loop"].values())
    lines.append(
      f"| {label} | {v['collectives_per_window']} | {where.format(loop=loop, k=k)}"
      f" | {_mib(v['temp_bytes'])} | {_timing(v)} |"
    )
  return "\n".join(lines)


def render_hsdp(report: dict[str, Any]) -> str:
  """docs/scaling.md's table of train_step.py's ``replica`` x ``fsdp`` rows."""
  hsdp = report["hsdp"]
  r, f = hsdp["mesh"]["replica"], hsdp["mesh"]["fsdp"]
  lines = [
    f"| {_model(report)}, replica {r} x fsdp {f} | collectives per window over `replica`"
    " | over `replica`+`fsdp` | over `fsdp` | bytes across `replica` per window"
    " | ms per window, median (p25-p75) |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for key, label in HSDP_ROWS:
    v = hsdp["variants"][key]
    axes = v["collectives_per_window_by_axis"]
    cells = [axes.get(a, 0) for a in ("replica", "replica+fsdp", "fsdp")]
    cells += [f"{v['replica_bytes_per_window']:,}", _timing(v)]
    lines.append(f"| {label} | " + " | ".join(str(c) for c in cells) + " |")
  m = report["machine"]
  lines += [
    "",
    f"{len(m['devices'])} fake CPU devices on a {m['cpu_count']}-core {m['processor']}, jax"
    f" {m['jax']}: the times measure compute, not a network; the counts and bytes (each"
    " device's data in the collectives whose device groups span `replica`, loop bodies counted"
    " `K` times, the boundary once) are what carries over to accelerators. Source:"
    " `benchmarks/results/train_step_8dev.json`, rendered by `benchmarks/render_tables.py`.",
  ]
  return "\n".join(lines)


def render_adaptive(report: dict[str, Any]) -> str:
  """docs/noise_scale.md's table of adaptive_windows.py: held-out loss at equal tokens and
  updates, fixed token budget vs adaptive windows."""
  runs, summary, s = report["runs"], report["summary"], report["setting"]
  d = s["demo"]
  model = f"demo transformer (dim {d['dim']}, depth {d['depth']}, {d['seq_len']}-byte lines)"
  at = summary["eval_loss_at_equal_updates"]["updates"]
  lines = [
    f"| {model} | windows (tokens) | updates | tokens | held-out loss at the end"
    f" (equal tokens) | at update {at} | training s |",
    "| --- | --- | --- | --- | --- | --- | --- |",
  ]
  for arm in [a for a in ADAPTIVE_ARMS if a in runs]:
    r = runs[arm]
    w = r["windows"]["weight"]
    at_updates = [p["eval_loss"] for p in r["curve"] if p["updates"] == at]
    cells = [
      r["label"],
      f"{min(w):,}-{max(w):,}, mean {sum(w) / len(w):,.0f}",
      f"{r['updates']:,}",
      f"{r['tokens']:,}",
      f"{r['eval_loss']:.3f}",
      f"{at_updates[0]:.3f}" if at_updates else "-",
      f"{r['train_seconds']:.0f}",
    ]
    lines.append("| " + " | ".join(cells) + " |")
  reach, a = summary["fixed_to_reach_adaptive_loss"], runs["adaptive"]
  if reach is None:
    lines += ["", f"The fixed budget does not reach the adaptive run's {a['eval_loss']:.3f}."]
  else:
    before = reach["previous_eval"]
    lines += [
      "",
      f"The fixed budget first reaches the adaptive run's final {a['eval_loss']:.3f} at update"
      f" {reach['updates']:,} ({reach['eval_loss']:.3f}; the evaluation before, at update"
      f" {before['updates']:,}: {before['eval_loss']:.3f}): the adaptive run needs"
      f" {a['updates'] / reach['updates']:.2f}-{a['updates'] / before['updates']:.2f}x its"
      " updates for that loss.",
    ]
  m = report["machine"]
  lines += [
    "",
    f"Budgets {s['min_tokens']:,} tokens (fixed) and {s['min_tokens']:,}-"
    f"{s['min_tokens'] * s['range']:,} (adaptive: `fraction={s['fraction']}`,"
    f" `max_factor={s['max_factor']}`, `warmup={s['window_warmup']}`, `decay={s['decay']}`);"
    f" AdamW at {d['learning_rate']:g} after a {s['warmup_updates']}-update warm-up; one stream"
    f" of {d['microbatch_size']}-line microbatches for every arm. {m['cpu_count']}-core"
    f" {m['processor']} shared with other jobs, jax {m['jax']}. Source:"
    " `benchmarks/results/adaptive_windows.json`, rendered by `benchmarks/render_tables.py`.",
  ]
  return "\n".join(lines)


def block(text: str, markers: tuple[str, str] = (BEGIN, END)) -> str:
  """The README's current block between the markers."""
  start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
  return text[start:end].strip("\n")


def tables() -> list[tuple[pathlib.Path, tuple[str, str], str]]:
  """Each rendered block's page, its markers and the table today's JSON renders to."""
  train_step = json.loads(TRAIN_STEP_JSON.read_text())
  return [
    (README, (BEGIN, END), render(json.loads(JSON.read_text()))),
    (README, EAGER, render_eager(json.loads(EAGER_JSON.read_text()))),
    (IN_STEP_DOC, MESH, render_mesh(train_step)),
    (SCALING_DOC, HSDP, render_hsdp(train_step)),
    (NOISE_DOC, ADAPTIVE, render_adaptive(json.loads(ADAPTIVE_JSON.read_text()))),
  ]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--check", action="store_true", help="exit 1 if the README disagrees")
  args = parser.parse_args(argv)
  for path, markers, table in tables():
    text = path.read_text()
    if args.check:
      if block(text, markers) != table:
        print(f"{path.name}'s block {markers[0]} differs from the JSON: rerun this script.")
        return 1
      continue
    start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    path.write_text(text[:start] + "\n" + table + "\n" + text[end:])
  return 0


if __name__ == "__main__":
  sys.exit(main())
