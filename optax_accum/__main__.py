"""Command line: ``optax-accum demo`` (or ``python -m optax_accum demo``).

Trains a small Flax NNX byte-level transformer on Python's standard-library
sources with token-weighted gradient accumulation, after a pre-flight check
that one accumulated window equals one physical batch. Needs the ``flax``
extra: ``pip install "optax_accum[flax]"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def main(argv: list[str] | None = None) -> int:
  """Parses ``argv`` (default ``sys.argv[1:]``) and runs the subcommand; returns the exit code."""
  parser = argparse.ArgumentParser(prog="optax-accum", description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="train a small transformer on Python's own sources")
  demo.add_argument("--quick", action="store_true", help="a small run (well under a minute)")
  demo.add_argument("--microbatch-size", type=int, help="lines per microbatch")
  demo.add_argument("--every-k", type=int, help="microbatches per optimizer update")
  demo.add_argument("--updates", type=int, help="optimizer updates to train for")
  demo.add_argument("--seed", type=int, help="model init and data shuffling seed")
  demo.add_argument("--seq-len", type=int, help="context length in bytes")
  demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  demo.add_argument(
    "--memory-budget",
    help="plan the largest microbatch of the same window whose compiled step fits, e.g. 200MB",
  )
  args = parser.parse_args(argv)

  try:
    from optax_accum.demo import plan, train
  except ImportError as e:  # flax or tqdm missing
    print(f'optax-accum demo needs flax and tqdm: pip install "optax_accum[flax]" ({e})')
    return 1
  config = train.QUICK if args.quick else train.DemoConfig()
  overrides = {
    k: v
    for k, v in vars(args).items()
    if v is not None and k in {f.name for f in dataclasses.fields(config)}
  }
  config = dataclasses.replace(config, **overrides)
  for name in ("microbatch_size", "every_k", "updates", "seq_len"):
    if getattr(config, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1")
  if args.memory_budget is not None:  # compiles the step for a few sizes; allocates nothing
    try:
      config, line = plan.plan_config(config, args.memory_budget)
    except ValueError as e:
      parser.error(f"--memory-budget {args.memory_budget}: {e}")
    print(line, flush=True)
  elif (refusal := plan.check_fits(config)) is not None:  # before anything is allocated
    print(f"optax-accum demo: {refusal}", file=sys.stderr)
    return 2
  train.train(config, progress=not args.no_progress)
  return 0


if __name__ == "__main__":
  sys.exit(main())
