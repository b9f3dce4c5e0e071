"""Renders the README's and docs' performance tables and demo samples from recorded JSON.

The numbers in README.md between ``<!-- microstep-table:begin -->`` and
``<!-- microstep-table:end -->`` (and the ``eager-table`` markers), in docs/in_step.md
between the ``mesh-table`` and ``preflight-table`` markers, in docs/scaling.md between the
``hsdp-table`` and ``zero1-table`` markers, in docs/noise_scale.md between the
``adaptive-table`` markers, in docs/porting.md between the ``drift-table`` markers, in
docs/performance.md between the ``compile-table`` markers and in README.md between the
``compile-summary`` markers are never edited by hand: run the benchmarks, then this script. The
demo's printed samples (README.md's ``demo-sample``, docs/demo.md's ``demo-output`` and
``demo-every-k``, docs/planning.md's ``demo-plan`` and ``demo-refusal``) are rendered from
recorded runs (``optax-accum demo --record``) the same way.

  python benchmarks/microstep.py --sizes 4e6 16e6 --inner adam adamw --every-k 4 16 \\
      --out benchmarks/results/microstep.json
  python benchmarks/eager.py --out benchmarks/results/eager.json
  python benchmarks/train_step.py --devices 8 --batch 64 --every-k 4 --seq-len 64 --dim 128 \\
      --depth 2 --heads 4 --rounds 5 --out benchmarks/results/train_step_8dev.json
  python benchmarks/preflight.py --out benchmarks/results/preflight.json
  optax-accum demo --record benchmarks/results/demo.json > demo.log 2>&1
  optax-accum demo --tokens-per-update 0 --record benchmarks/results/demo_every_k.json \\
      > demo.log 2>&1
  optax-accum demo --memory-budget 200MB --updates 1 --no-progress \\
      --record benchmarks/results/demo_plan_200MB.json
  optax-accum demo --memory-budget 20MB --updates 1 --no-progress \\
      --record benchmarks/results/demo_plan_20MB.json
  optax-accum demo --quick --microbatch-size 100000000 \\
      --record benchmarks/results/demo_refusal.json
  python benchmarks/adaptive_windows.py --out benchmarks/results/adaptive_windows.json
  python benchmarks/float32_drift.py --out benchmarks/results/float32_drift.json
  python benchmarks/compile.py --out benchmarks/results/compile.json
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
RESULTS = ROOT / "benchmarks" / "results"
JSON = ROOT / "benchmarks" / "results" / "microstep.json"
EAGER_JSON = ROOT / "benchmarks" / "results" / "eager.json"
TRAIN_STEP_JSON = ROOT / "benchmarks" / "results" / "train_step_8dev.json"
ADAPTIVE_JSON = ROOT / "benchmarks" / "results" / "adaptive_windows.json"
DRIFT_JSON = ROOT / "benchmarks" / "results" / "float32_drift.json"
PORTING_DOC = ROOT / "docs" / "porting.md"
DRIFT = ("<!-- drift-table:begin -->", "<!-- drift-table:end -->")
NOISE_DOC = ROOT / "docs" / "noise_scale.md"
ADAPTIVE = ("<!-- adaptive-table:begin -->", "<!-- adaptive-table:end -->")
ADAPTIVE_ARMS = ("fixed", "adaptive", "adaptive_same_lr", "fixed_mean")
README = ROOT / "README.md"
IN_STEP_DOC = ROOT / "docs" / "in_step.md"
SCALING_DOC = ROOT / "docs" / "scaling.md"
DEMO_DOC = ROOT / "docs" / "demo.md"
PLANNING_DOC = ROOT / "docs" / "planning.md"
PREFLIGHT = ("<!-- preflight-table:begin -->", "<!-- preflight-table:end -->")
DEMO_SAMPLE = ("<!-- demo-sample:begin -->", "<!-- demo-sample:end -->")
DEMO_OUTPUT = ("<!-- demo-output:begin -->", "<!-- demo-output:end -->")
DEMO_EVERY_K = ("<!-- demo-every-k:begin -->", "<!-- demo-every-k:end -->")
DEMO_PLAN = ("<!-- demo-plan:begin -->", "<!-- demo-plan:end -->")
DEMO_REFUSAL = ("<!-- demo-refusal:begin -->", "<!-- demo-refusal:end -->")
MESH = ("<!-- mesh-table:begin -->", "<!-- mesh-table:end -->")
HSDP = ("<!-- hsdp-table:begin -->", "<!-- hsdp-table:end -->")
ZERO1 = ("<!-- zero1-table:begin -->", "<!-- zero1-table:end -->")
ZERO1_ROWS = [
  ("across_step_shard_map", "replicated inner optimizer (`shard_optimizer=False`)"),
  ("across_step_shard_map_zero1", "ZeRO-1 (`shard_optimizer=True`)"),
]
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
COMPILE_JSON = ROOT / "benchmarks" / "results" / "compile.json"
PERFORMANCE_DOC = ROOT / "docs" / "performance.md"
COMPILE = ("<!-- compile-table:begin -->", "<!-- compile-table:end -->")
COMPILE_SUMMARY = ("<!-- compile-summary:begin -->", "<!-- compile-summary:end -->")
# (variant, label) of compile.py's rows, in order; all_features is against multisteps_clip.
COMPILE_ROWS = [
  ("adam", "plain `optax.adam` step"),
  ("multisteps", "`optax.MultiSteps(adam, 4)` + `optax.apply_updates`"),
  ("accumulate", "`accumulate(adam, 4)` + `optax.apply_updates`"),
  ("update_and_apply", "`update_and_apply(accumulate(adam, 4), ...)`"),
  ("multisteps_clip", "`optax.MultiSteps(chain(clip, adam), 4)` + `optax.apply_updates`"),
  (
    "all_features",
    "`accumulate(chain(clip, adam), 4, loss_scale=dynamic_loss_scale(), skip_if=spike_rule())`,"
    " `value=` (x the row above)",
  ),
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
  (
    "accumulate_noise",
    "`accumulate(..., observe=(noise_scale(0.9),))` + `optax.apply_updates`",
  ),
  ("accumulate_fused_noise", "`update_and_apply`, `observe=(noise_scale(0.9),)`"),
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


def _compile_model(result: dict[str, Any]) -> str:
  if result["model"] == "transformer":
    return f"{result['depth']}-block transformer ({result['leaves']} leaves)"
  return f"{result['leaves']} leaves"


def _compile_table(results: list[dict[str, Any]], head: str, cell: Any) -> list[str]:
  """One row per variant, one column per model; ``cell(variant, reference)`` of a model's rows."""
  lines = [
    f"| {head} | " + " | ".join(_compile_model(r) for r in results) + " |",
    "| --- | " + " | ".join("---" for _ in results) + " |",
  ]
  for key, label in COMPILE_ROWS:
    ref = "multisteps_clip" if key == "all_features" else "multisteps"
    cells = [cell(r["variants"][key], r["variants"][ref]) for r in results]
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  return lines


def render_compile(report: dict[str, Any]) -> str:
  """docs/performance.md's tables of benchmarks/compile.py: compile and trace seconds, fusions."""
  results = report["results"]
  compile_s = lambda v, ref: f"{v['compile_s']:.2f} ({v['compile_s'] / ref['compile_s']:.1f}x)"

  def trace_s(v: dict[str, Any], ref: dict[str, Any]) -> str:
    total, ref_total = v["trace_s"] + v["lower_s"], ref["trace_s"] + ref["lower_s"]
    return f"{v['trace_s']:.2f} + {v['lower_s']:.2f} ({total / ref_total:.1f}x)"

  fusions = lambda v, ref: f"{v['distinct_fusions']} / {v['fusions']}"
  lines = _compile_table(results, "compile s, CPU (x MultiSteps)", compile_s)
  lines += ["", *_compile_table(results, "trace + lower s, CPU (x MultiSteps)", trace_s)]
  lines += ["", *_compile_table(results, "fused computations: distinct / fusions", fusions)]
  m = report["machine"]
  repeats = results[0]["variants"]["adam"]["repeats"]
  lines += [
    "",
    f"{f'Medians of {repeats} fresh processes' if repeats > 1 else 'One fresh process'} per"
    " case, each timing one jitted step (params and"
    " state donated, every_k 4) traced, lowered and compiled from abstract arguments, with no"
    " compilation cache; `time.process_time`, the CPU seconds of all the process's threads (wall"
    f" times are in the JSON); leaves of shape {tuple(report['leaf_shape'])} float32."
    f" {m['cpu_count']}-core {m['processor']} shared with other jobs, jax {m['jax']}, optax"
    f" {m['optax']}, {report['date'][:10]}. Source: `benchmarks/results/compile.json`, rendered"
    " by `benchmarks/render_tables.py`.",
  ]
  return "\n".join(lines)


def render_compile_summary(report: dict[str, Any]) -> str:
  """README.md's sentence on compile time: the largest model's cost beyond a plain adam step."""
  r = report["results"][-1]
  adam, extra = r["variants"]["adam"]["compile_s"], r["ratios"]["extra_compile_over_adam_s"]
  times = {
    name: f"{extra[name]:.1f} s" for name in ("accumulate", "update_and_apply", "multisteps")
  }
  ratio = r["ratios"]["accumulate_extra_over_multisteps_extra"]
  return (
    f"**Compile time.** Compiling one train step of a {_compile_model(r)} takes {adam:.1f} s"
    f" (CPU) with plain adam; `accumulate` + `optax.apply_updates` adds {times['accumulate']},"
    f" `update_and_apply` {times['update_and_apply']} and `optax.MultiSteps`"
    f" {times['multisteps']} ({ratio:.1f}x MultiSteps' extra for `accumulate`); per tree size"
    " and with every feature on:"
    " [Compile time](https://optax-accum.readthedocs.io/en/latest/performance.html#compile-time)."
  )


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


def render_zero1(report: dict[str, Any]) -> str:
  """docs/scaling.md's table of the across-step rows with and without ZeRO-1."""
  rows, n = report["mesh"]["variants"], report["mesh"]["devices"]
  lines = [
    f"| {_model(report)}, {n} devices | collectives at the boundary | bytes each device sends"
    " per window (ring) | inner state bytes per device | compiled temp"
    " | ms per window, median (p25-p75) |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for key, label in ZERO1_ROWS:
    v = rows[key]
    kinds = v["collectives"]["in_conditional"]
    where = ", ".join(f"{c} {kind}" for kind, c in sorted(kinds.items()))
    lines.append(
      f"| {label} | {where} | {v['ring_bytes_per_window']:,}"
      f" | {v['inner_state_bytes_per_device']:,} | {_mib(v['temp_bytes'])} | {_timing(v)} |"
    )
  lines += [
    "",
    "Bytes sent per device on a ring: an all-reduce of `S` bytes sends `2 (n-1)/n S`, a"
    " reduce-scatter and an all-gather `(n-1)/n S` each. Fake CPU devices: the times measure"
    " compute, not a network. Source: `benchmarks/results/train_step_8dev.json`, rendered by"
    " `benchmarks/render_tables.py`.",
  ]
  return "\n".join(lines)


def render_preflight(report: dict[str, Any]) -> str:
  """docs/in_step.md's table of benchmarks/preflight.py: the fit's pieces against the check."""
  lines = [
    "| params, K | Gram on the device | solve on the host | residual pass | allowance"
    " (2 inner updates) | the whole `check_equivalence` |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for r in report["results"]:
    ms = r["ms"]
    lines.append(
      f"| {_size(r['num_params'])}, {r['num_microbatches']} | {ms['gram']:.1f} ms"
      f" | {ms['solve']:.2f} ms | {ms['residuals']:.1f} ms | {ms['allowance']:.1f} ms"
      f" | {r['check_equivalence_s']:.2f} s (the fit: {100 * r['fit_over_check']:.1f}%) |"
    )
  m = report["machine"]
  lines += [
    "",
    f"A 2-layer tanh MLP, float32, adamw; medians of {report['results'][0]['calls']} calls after a"
    f" warm-up call, the check's of {max(1, report['results'][0]['calls'] // 5)} calls (each"
    f" compiles); {m['cpu_count']}-core {m['processor']}, jax {m['jax']}. Source:"
    " `benchmarks/results/preflight.json`, rendered by `benchmarks/render_tables.py`.",
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


def render_drift(report: dict[str, Any]) -> str:
  """docs/porting.md's table of float32_drift.py: each run's largest loss gap to the physical
  run, per compute dtype and optimizer, next to ``optax.MultiSteps``'."""
  runs = report["runs"]
  inners = list(runs[0]["results"])
  head = ["compute"]
  for name in inners:
    head += [f"{name}: `accumulate`", f"{name}: `optax.MultiSteps`"]
  lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  for run in runs:
    cells = [run["config"]["compute_dtype"]]
    for name in inners:
      gap = run["results"][name]["gap"]
      cells += [f"{gap['accumulate']:.1e}", f"{gap['multisteps']:.1e}"]
    lines.append("| " + " | ".join(cells) + " |")
  c, first = runs[0]["config"], runs[0]["results"]
  rates = ", ".join(f"{name}({first[name]['learning_rate']:g})" for name in inners)
  final = "; ".join(
    f"{name} {first[name]['physical_loss'][0]:.2f}, {first[name]['physical_loss'][-1]:.2f}"
    for name in inners
  )
  m = report["machine"]
  lines += [
    "",
    f"The largest difference of a run's held-out loss from the physical run's over"
    f" {c['updates']} updates, nats per token ({c['held_out_rows']} held-out rows);"
    f" {c['model']} ({c['num_params']:,} params, float32), K={c['every_k']} microbatches of"
    f" {c['microbatch_size']} full rows, {rates} (the physical run's held-out loss after the"
    f" first and the last update: {final}). {m['cpu_count']}-core {m['processor']} CPU, jax"
    f" {m['jax']}, optax {m['optax']}. Source: `benchmarks/results/float32_drift.json`,"
    " rendered by `benchmarks/render_tables.py`.",
  ]
  return "\n".join(lines)


def _where(record: dict[str, Any]) -> str:
  m = record["machine"]
  return f"{m['cpu_count']}-core {m['processor']} CPU, jax {m['jax']}, flax {m['flax']}"


def _demo_lines(record: dict[str, Any]) -> list[str]:
  assert record["exit_code"] == 0, record["command"]
  return record["output"].rstrip("\n").splitlines()


def render_demo_sample(record: dict[str, Any]) -> str:
  """README.md's abridged demo output: the pre-flight, the plan, first and last progress lines,
  the summary."""
  lines = _demo_lines(record)
  pre = next(i for i, line in enumerate(lines) if line.startswith("Pre-flight:"))
  train = next(i for i, line in enumerate(lines) if line.startswith("Training:"))
  timing = [line for line in lines if line.startswith("timing:")]
  updates = [line for line in lines if line.startswith("update ")]
  end = next(i for i, line in enumerate(lines) if line.startswith("training loss:"))
  shown = lines[pre:train] + [lines[train], *timing, *updates[:1], "...", *updates[-1:]]
  shown += lines[end:]
  head = (
    f"A real run of `{record['command']}` with its output in a file ({_where(record)},"
    f" {record['wall_seconds']:.0f} s), abridged:"
  )
  return "\n".join([head, "", "```text", *shown, "```"])


def render_demo_output(record: dict[str, Any]) -> str:
  """docs/demo.md's full demo output, and what it took."""
  s = record["summary"]
  head = (
    f"A real run of `{record['command']} > demo.log 2>&1` ({_where(record)}; with the output in a"
    " file the progress bar gives way to a plain line every tenth of the run), in full:"
  )
  tail = (
    f"The held-out loss (lines never trained on) falls from {s['eval_before']:.2f} to"
    f" {s['eval_after']:.2f} nats per byte in {record['wall_seconds']:.0f} s of wall time,"
    f" {s['train_seconds']:.0f} s of it training (the rest: imports, the pre-flight check, which"
    " compiles three copies of the model's backward pass and two `accumulate` steps, and the"
    " train step's compilation)."
  )
  return "\n".join([head, "", "```text", *_demo_lines(record), "```", "", tail])


def render_demo_every_k(record: dict[str, Any]) -> str:
  """docs/demo.md's lines of the run with windows of ``every_k`` microbatches."""
  keep = ("Training:", "held-out loss:", "tokens per update:", "critical batch")
  lines = [line for line in _demo_lines(record) if line.startswith(keep)]
  return "\n".join([f"`{record['command']}` prints", "", "```text", *lines, "```"])


def render_demo_plan(records: list[dict[str, Any]]) -> str:
  """docs/planning.md's plan lines of ``--memory-budget`` runs."""
  lines = []
  for record in records:
    lines += [line for line in _demo_lines(record) if line.startswith("memory plan:")]
  where = _where(records[0])
  return "\n".join([f"On a {where}:", "", "```text", *lines, "```"])


def render_demo_refusal(record: dict[str, Any]) -> str:
  """docs/planning.md's refusal of a microbatch the machine cannot hold."""
  assert record["exit_code"] == 2, record["command"]
  text = record["output"].rstrip("\n")
  return "\n".join([f"`{record['command']}` ({_where(record)}):", "", "```text", text, "```"])


def _indent(text: str, prefix: str) -> str:
  return "\n".join(prefix + line if line else line for line in text.splitlines())


def block(text: str, markers: tuple[str, str] = (BEGIN, END)) -> str:
  """The README's current block between the markers."""
  start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
  return text[start:end].rstrip(" ").strip("\n")  # an indented end marker's indentation


def _record(name: str) -> dict[str, Any]:
  return json.loads((RESULTS / name).read_text())


def tables() -> list[tuple[pathlib.Path, tuple[str, str], str]]:
  """Each rendered block's page, its markers and the table today's JSON renders to."""
  train_step = json.loads(TRAIN_STEP_JSON.read_text())
  plans = [_record("demo_plan_200MB.json"), _record("demo_plan_20MB.json")]
  compile_report = json.loads(COMPILE_JSON.read_text())
  return [
    (README, (BEGIN, END), render(json.loads(JSON.read_text()))),
    (README, EAGER, render_eager(json.loads(EAGER_JSON.read_text()))),
    (IN_STEP_DOC, MESH, render_mesh(train_step)),
    (SCALING_DOC, HSDP, render_hsdp(train_step)),
    (SCALING_DOC, ZERO1, render_zero1(train_step)),
    (IN_STEP_DOC, PREFLIGHT, render_preflight(_record("preflight.json"))),
    (README, DEMO_SAMPLE, render_demo_sample(_record("demo.json"))),
    (DEMO_DOC, DEMO_OUTPUT, render_demo_output(_record("demo.json"))),
    (DEMO_DOC, DEMO_EVERY_K, render_demo_every_k(_record("demo_every_k.json"))),
    (PLANNING_DOC, DEMO_PLAN, _indent(render_demo_plan(plans), "  ")),
    (PLANNING_DOC, DEMO_REFUSAL, _indent(render_demo_refusal(_record("demo_refusal.json")), "  ")),
    (NOISE_DOC, ADAPTIVE, render_adaptive(json.loads(ADAPTIVE_JSON.read_text()))),
    (PORTING_DOC, DRIFT, render_drift(json.loads(DRIFT_JSON.read_text()))),
    (PERFORMANCE_DOC, COMPILE, render_compile(compile_report)),
    (README, COMPILE_SUMMARY, render_compile_summary(compile_report)),
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
    indent = text[:end].rsplit("\n", 1)[-1]  # the end marker's, in a list item
    path.write_text(text[:start] + "\n" + table + "\n" + indent + text[end:])
  return 0


if __name__ == "__main__":
  sys.exit(main())
