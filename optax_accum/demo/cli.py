"""The demo's command line: ``optax-accum demo`` (or ``python -m optax_accum demo``).

Trains a small Flax NNX byte-level transformer on Python's standard-library
sources with token-weighted gradient accumulation, after a pre-flight check
that one accumulated window equals one physical batch. Needs the ``flax``
extra: ``pip install "optax_accum[flax]"`` (from a clone: ``pip install -e ".[flax]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import sys

import optax_accum

DESCRIPTION = (
  "optax_accum: correct, fast gradient accumulation for Optax. "
  "'optax-accum demo' trains a small transformer on Python's own sources with token-weighted "
  "accumulation, after a pre-flight check against one physical batch."
)
INSTALL_FLAX = 'pip install "optax_accum[flax]" (from a clone: pip install -e ".[flax]")'
# Demo options: (flag, type, help). Their defaults come from DemoConfig and QUICK.
OPTIONS = (
  ("--microbatch-size", int, "lines per microbatch"),
  ("--every-k", int, "microbatches per optimizer update (the window)"),
  (
    "--tokens-per-update",
    int,
    "real bytes per update: a window closes at the first microbatch "
    "reaching it; 0: windows of --every-k microbatches",
  ),
  ("--updates", int, "optimizer updates to train for"),
  ("--seed", int, "model init and data shuffling seed"),
  ("--seq-len", int, "context length in bytes"),
)


def _versions() -> str:
  def version(name: str) -> str:
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return "not installed"

  deps = ", ".join(f"{name} {version(name)}" for name in ("jax", "optax", "flax"))
  return f"optax-accum {optax_accum.__version__} ({deps}; Python {sys.version.split()[0]})"


def main(argv: list[str] | None = None) -> int:
  """Parses ``argv`` (default ``sys.argv[1:]``) and runs the subcommand; returns the exit code."""
  parser = argparse.ArgumentParser(prog="optax-accum", description=DESCRIPTION)
  parser.add_argument("--version", action="version", version=_versions())
  sub = parser.add_subparsers(dest="command", required=True, metavar="{demo}")
  demo = sub.add_parser(
    "demo",
    help="train a small transformer on Python's own sources",
    description="Train a small byte-level transformer on Python's standard-library sources "
    "with optax_accum.accumulate (weight = real bytes per microbatch).",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  demo.add_argument("--quick", action="store_true", help="a small run (well under a minute)")
  try:
    from optax_accum.demo.setup import QUICK, DemoConfig
  except ImportError:  # flax missing: the defaults are unknown, `demo` says what to install
    QUICK = DemoConfig = None
  for flag, kind, text in OPTIONS:
    field = flag[2:].replace("-", "_")
    if DemoConfig is not None:
      full, quick = getattr(DemoConfig(), field), getattr(QUICK, field)
      text += f" (default: {full}" + (f"; {quick} with --quick)" if quick != full else ")")
    # SUPPRESS: an option not given stays out of the namespace (and out of the formatter's
    # "(default: ...)"), so the defaults of the chosen configuration apply.
    demo.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text)
  demo.add_argument(
    "--adaptive",
    action="store_true",
    default=argparse.SUPPRESS,  # a DemoConfig field: given, it overrides the default
    help="windows that follow the measured critical batch (optax_accum.adaptive_window), from "
    "--tokens-per-update up to 16 times it, the learning rate scaled by sqrt(window tokens)",
  )
  demo.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
  demo.add_argument(
    "--memory-budget",
    help="plan the largest microbatch of the same window whose compiled step fits, e.g. 200MB",
  )
  args = parser.parse_args(argv)

  try:
    from optax_accum.demo import plan, train
  except ImportError as e:  # flax or tqdm missing
    demo.exit(1, f"optax-accum demo needs flax and tqdm: {INSTALL_FLAX} ({e})\n")
  config = train.QUICK if args.quick else train.DemoConfig()
  fields = {f.name for f in dataclasses.fields(config)}
  overrides = {k: v for k, v in vars(args).items() if k in fields}
  if overrides.get("tokens_per_update") == 0:  # 0: off, windows of every_k microbatches
    overrides["tokens_per_update"] = None
  for name, value in overrides.items():
    if name != "seed" and value is not None and value < 1:
      demo.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
  config = dataclasses.replace(config, **overrides)
  if config.adaptive and config.tokens_per_update is None:
    demo.error("--adaptive sizes windows in tokens: give --tokens-per-update (the smallest), not 0")
  if args.memory_budget is not None:  # compiles the step for a few sizes; allocates nothing
    try:
      config, line = plan.plan_config(config, args.memory_budget)
    except ValueError as e:
      demo.error(f"--memory-budget {args.memory_budget}: {e}")
    print(line, flush=True)
  elif (refusal := plan.check_fits(config)) is not None:  # before anything is allocated
    print(f"optax-accum demo: {refusal}", file=sys.stderr)
    return 2
  train.train(config, progress=not args.no_progress)
  return 0


if __name__ == "__main__":
  sys.exit(main())
