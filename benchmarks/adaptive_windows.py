"""Adaptive windows vs a fixed token budget on the demo's text: held-out loss per token and update.

The demo's byte-level transformer (``optax-accum demo``) on Python's standard-library lines, one
stream of microbatches (the same order for every arm), AdamW with the demo's peak learning rate
(a linear warm-up over the first updates, then constant: no schedule tied to a run length, which
the arms do not share). Arms:

* ``fixed``: ``accumulate(adamw, token_budget(B0))``, windows of ``B0`` real bytes (tokens);
* ``adaptive``: ``accumulate(adamw, adaptive_window(B0, B0 * range))`` with the learning rate
  scaled by ``sqrt(window weight / B0)`` (``scale_learning_rate``, Adam's rule);
* ``adaptive_same_lr``: the same windows' policy without the learning-rate scaling;
* ``fixed_mean``: a fixed budget at the ``adaptive`` arm's mean window, its learning rate
  scaled by the same rule (``token_budget(B).sqrt_scaled_schedule``): is it the adaptivity, or
  only the larger batch?

The adaptive arms run first, for ``--tokens`` tokens (to the first boundary past it); the fixed
arms then run to the same number of tokens as the scaled adaptive arm consumed, with an extra
evaluation at the adaptive arm's number of updates. Held-out loss (nats per byte, the demo's
``eval_lines`` lines, never trained on) is measured every ``--tokens / --evals`` tokens at the
first boundary past each mark. The JSON (``--out``) holds every curve, each window's weight,
budget and ``B_simple``, and a summary: the loss at equal tokens, at equal updates, and the
updates and tokens the fixed arm needs to reach the adaptive arm's final loss. A plot is saved
next to it (``--plot``). docs/noise_scale.md shows both (``benchmarks/render_tables.py``).

  python benchmarks/adaptive_windows.py --out benchmarks/results/adaptive_windows.json
  python benchmarks/adaptive_windows.py --quick --out /tmp/a.json    # CI smoke run, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import time
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from microstep import machine, write_report

import optax_accum
import optax_accum.flax
from optax_accum.demo import setup
from optax_accum.demo.model import token_loss

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARMS = ("adaptive", "adaptive_same_lr", "fixed", "fixed_mean")
LABELS = {
  "fixed": "fixed budget",
  "adaptive": "adaptive, lr x sqrt(window / min)",
  "adaptive_same_lr": "adaptive, same lr",
  "fixed_mean": "fixed at the adaptive mean, lr x sqrt",
}


@dataclasses.dataclass(frozen=True)
class Setting:
  """What an arm trains with (one per size: ``--quick`` or the full run)."""

  demo: setup.DemoConfig
  min_tokens: int
  range: int  # max_weight = min_tokens * range
  tokens: int
  evals: int
  warmup_updates: int
  window_warmup: int
  max_factor: float
  fraction: float
  decay: float


FULL = Setting(
  demo=setup.DemoConfig(),
  min_tokens=2048,
  range=16,
  tokens=1_500_000,
  evals=16,
  warmup_updates=20,
  window_warmup=10,
  max_factor=1.1,
  fraction=1.0,
  decay=0.95,
)
QUICK = Setting(
  demo=setup.QUICK,
  min_tokens=768,
  range=8,
  tokens=16_000,
  evals=4,
  warmup_updates=3,
  window_warmup=3,
  max_factor=1.5,
  fraction=1.0,
  decay=0.8,
)


def make_tx(s: Setting, arm: str, budget: int) -> optax.GradientTransformation:
  """AdamW (the demo's, at a constant peak after a linear warm-up) inside the arm's windows."""
  c = s.demo
  lr = optax.linear_schedule(c.learning_rate / 10, c.learning_rate, s.warmup_updates)
  noise = optax_accum.noise_scale(s.decay)
  if arm in ("fixed", "fixed_mean"):  # the same noise estimator, observed only
    policy = optax_accum.token_budget(budget)
    lr = policy.sqrt_scaled_schedule(lr, s.min_tokens)  # 1 for the fixed arm
    inner = optax.adamw(lr, weight_decay=c.weight_decay)
    return optax_accum.accumulate(inner, policy, observe=(noise,))
  inner = optax.adamw(lr, weight_decay=c.weight_decay)
  policy = optax_accum.adaptive_window(
    s.min_tokens,
    s.min_tokens * s.range,
    fraction=s.fraction,
    max_factor=s.max_factor,
    warmup=s.window_warmup,
    decay=s.decay,
  )
  tx = optax_accum.accumulate(inner, policy)
  return policy.scale_learning_rate(tx) if arm == "adaptive" else tx


def run_arm(
  s: Setting, arm: str, budget: int, stop_tokens: int, eval_at_update: int | None
) -> dict[str, Any]:
  """Trains one arm to the first boundary at or past ``stop_tokens``; its curves and windows."""
  c = s.demo
  train_lines, eval_lines = setup.split_lines(c)
  evals = setup.microbatches(eval_lines, c.seq_len, max(c.microbatch_size, 64))
  model = setup.make_model(c)
  optimizer = optax_accum.flax.Optimizer(model, make_tx(s, arm, budget), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(token_loss)(model, batch)
    optimizer.update(model, grads, weight=batch["mask"].sum(), value=loss)
    m = optax_accum.metrics(optimizer.opt_state)
    return nnx.state((model, optimizer)), (m.updated, m.noise_scale, m.window_budget)

  @jax.jit
  def loss_sum(state, batch):
    model, _ = nnx.merge(graphdef, state)
    n = batch["mask"].sum()
    return token_loss(model, batch) * n, n

  def evaluate(state) -> float:
    sums = [loss_sum(state, b) for b in evals]
    return float(sum(x for x, _ in sums) / sum(n for _, n in sums))

  stream = setup.microbatches(train_lines, c.seq_len, c.microbatch_size)
  step = step.lower(state, stream[0]).compile()  # compiled before the clock starts
  rng = np.random.default_rng(c.seed + 1)  # the demo's epoch order: every arm sees one stream
  every = stop_tokens / s.evals
  curve = [{"tokens": 0, "updates": 0, "eval_loss": evaluate(state)}]
  windows = {"tokens": [], "weight": [], "budget": [], "noise_scale": []}
  tokens = updates = pending = 0
  next_eval, train_seconds, t0 = every, 0.0, time.perf_counter()
  done = False
  while not done:
    for mb in stream:
      state, (updated, b_simple, next_budget) = step(state, mb)
      n = int(mb["mask"].sum())
      tokens, pending = tokens + n, pending + n
      if not bool(updated):
        continue
      updates += 1
      windows["tokens"].append(tokens)
      windows["weight"].append(pending)
      windows["budget"].append(None if next_budget is None else float(next_budget))
      windows["noise_scale"].append(float(b_simple))
      pending = 0
      done = tokens >= stop_tokens
      if tokens >= next_eval or updates == eval_at_update or done:
        train_seconds += time.perf_counter() - t0
        curve.append({"tokens": tokens, "updates": updates, "eval_loss": evaluate(state)})
        t0 = time.perf_counter()
        while next_eval <= tokens:
          next_eval += every
      if done:
        break
    rng.shuffle(train_lines)
    stream = setup.microbatches(train_lines, c.seq_len, c.microbatch_size)
  return {
    "label": LABELS[arm],
    "budget": budget if arm.startswith("fixed") else None,
    "tokens": tokens,
    "updates": updates,
    "eval_loss": curve[-1]["eval_loss"],
    "train_seconds": train_seconds,
    "curve": curve,
    "windows": windows,
  }


def _at(curve: list[dict[str, Any]], key: str, value: int) -> float:
  """The eval loss of ``curve`` at ``curve[key] == value`` (that evaluation must exist)."""
  (loss,) = [p["eval_loss"] for p in curve if p[key] == value]
  return loss


def _first_reaching(curve: list[dict[str, Any]], loss: float) -> dict[str, Any] | None:
  """The first evaluation of ``curve`` at or below ``loss``, or None."""
  return next((p for p in curve if p["eval_loss"] <= loss), None)


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """The comparison: equal tokens, equal updates, what the fixed arm needs for the same loss."""
  fixed, adaptive = runs["fixed"], runs["adaptive"]
  reach = _first_reaching(fixed["curve"], adaptive["eval_loss"])
  before = None if reach is None else fixed["curve"][fixed["curve"].index(reach) - 1]
  out = {
    "tokens": {arm: r["tokens"] for arm, r in runs.items()},
    "updates": {arm: r["updates"] for arm, r in runs.items()},
    "eval_loss_at_equal_tokens": {arm: r["eval_loss"] for arm, r in runs.items()},
    "eval_loss_at_equal_updates": {
      "updates": adaptive["updates"],
      "fixed": _at(fixed["curve"], "updates", adaptive["updates"]),
      "adaptive": adaptive["eval_loss"],
    },
    "fixed_to_reach_adaptive_loss": None
    if reach is None
    else {
      "updates": reach["updates"],
      "tokens": reach["tokens"],
      "eval_loss": reach["eval_loss"],
      "previous_eval": before,
    },
    "train_seconds": {arm: r["train_seconds"] for arm, r in runs.items()},
  }
  for arm in ("fixed_mean",):
    if arm in runs:
      curve = runs[arm]["curve"]
      at = [p["eval_loss"] for p in curve if p["updates"] == adaptive["updates"]]
      out["eval_loss_at_equal_updates"][arm] = at[0] if at else None
  return out


def plot(report: dict[str, Any], path: str) -> None:
  """Held-out loss vs tokens and vs updates, and the adaptive windows against ``B_simple``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs = report["runs"]
  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  for arm, r in runs.items():
    xs = {k: [p[k] for p in r["curve"]] for k in ("tokens", "updates", "eval_loss")}
    style = dict(marker=".", label=r["label"], ls=":" if arm.endswith(("_lr", "_mean")) else "-")
    axes[0].plot(xs["tokens"], xs["eval_loss"], **style)
    axes[1].plot(xs["updates"], xs["eval_loss"], **style)
  losses = [p["eval_loss"] for r in runs.values() for p in r["curve"][1:]]
  for ax, x in zip(axes[:2], ("tokens processed", "optimizer updates"), strict=True):
    ax.set_ylim(min(losses) - 0.05, max(losses) + 0.05)  # from the first evaluation after init
    ax.set_xlabel(x)
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.legend(fontsize=8)
  axes[0].set_title("per token")
  axes[1].set_title("per update")
  a, f = runs["adaptive"]["windows"], runs["fixed"]["windows"]
  axes[2].plot(a["tokens"], a["weight"], label="adaptive window (tokens)")
  axes[2].plot(a["tokens"], a["noise_scale"], lw=0.8, label="B_simple, adaptive run")
  axes[2].plot(f["tokens"], f["noise_scale"], lw=0.8, label="B_simple, fixed run")
  axes[2].axhline(report["setting"]["min_tokens"], color="gray", ls=":", label="fixed budget")
  axes[2].set_yscale("log")
  axes[2].set_xlabel("tokens processed")
  axes[2].set_ylabel("tokens")
  axes[2].set_title("window weight follows B_simple")
  axes[2].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a tiny run for CI (seconds)")
  parser.add_argument("--tokens", type=int, help="tokens per arm (default: the setting's)")
  parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
  parser.add_argument("--out", help="the JSON report (default: stdout)")
  parser.add_argument("--plot", help="the PNG (default: the JSON's path with .png)")
  args = parser.parse_args(argv)
  s = QUICK if args.quick else FULL
  if args.tokens:
    s = dataclasses.replace(s, tokens=args.tokens)
  arms = [a for a in ARMS if a in args.arms]
  if "adaptive" not in arms or "fixed" not in arms:
    parser.error("--arms needs at least 'adaptive' and 'fixed' (the comparison)")
  runs = {}
  for arm in arms:  # the adaptive arms first: the fixed ones run to their tokens and updates
    budget, stop, at = s.min_tokens, s.tokens, None
    if arm.startswith("fixed"):
      stop, at = runs["adaptive"]["tokens"], runs["adaptive"]["updates"]
    if arm == "fixed_mean":
      budget = round(runs["adaptive"]["tokens"] / runs["adaptive"]["updates"])
    runs[arm] = run_arm(s, arm, budget, stop, at)
    r = runs[arm]
    print(
      f"{arm}: {r['updates']} updates, {r['tokens']:,} tokens, held-out loss "
      f"{r['eval_loss']:.4f}, {r['train_seconds']:.0f} s",
      flush=True,
    )
  setting = dataclasses.asdict(s)
  report = {
    "benchmark": "adaptive_windows",
    "machine": machine(),
    "args": vars(args),
    "setting": setting,
    "runs": runs,
    "summary": summarize(runs),
  }
  write_report(report, args.out)
  path = args.plot or (str(pathlib.Path(args.out).with_suffix(".png")) if args.out else None)
  if path:
    plot(report, path)
  return report


if __name__ == "__main__":
  main()
