"""The demo's command line: ``optax-accum demo`` (or ``python -m optax_accum demo``).

Trains a small Flax NNX byte-level transformer on Python's standard-library
sources with token-weighted gradient accumulation, after a pre-flight check
that one accumulated window equals one physical batch. Needs the ``flax``
extra: ``pip install "optax_accum[flax]"`` (from a clone: ``pip install -e ".[flax]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Any

import optax_accum
from optax_accum.demo import record as recording

DESCRIPTION = (
  "optax_accum: correct, fast gradient accumulation for Optax. "
  "'optax-accum demo' trains a small transformer on Python's own sources with token-weighted "
  "accumulation, after a pre-flight check against one physical batch."
)
INSTALL_FLAX = 'pip install "optax_accum[flax]" (from a clone: pip install -e ".[flax]")'
# flax 0.11.0-0.12.1 declare support for newer jax than they run with (pyproject.toml's comment,
# README "Supported versions"): with jax >= JAX_NEEDS_NEW_FLAX, flax >= NEW_FLAX.
JAX_NEEDS_NEW_FLAX, NEW_FLAX = (0, 8, 2), (0, 12, 2)
# Demo options: (flag, type, help). Their defaults come from DemoConfig and QUICK.
OPTIONS = (
  ("--microbatch-size", int, "lines per microbatch"),
  (
    "--every-k",
    int,
    "microbatches per optimizer update with --tokens-per-update 0; with a token budget it "
    "sets only the pre-flight's window",
  ),
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


_version = recording.installed  # one name: the tests replace it with the versions to simulate


def _versions() -> str:
  deps = ", ".join(f"{n} {_version(n) or 'not installed'}" for n in ("jax", "optax", "flax"))
  return f"optax-accum {optax_accum.__version__} ({deps}; Python {sys.version.split()[0]})"


def _release(version: str) -> tuple[int, ...]:
  """The numeric release of a version string: ``'0.12.2rc1'`` -> ``(0, 12, 2)``.

  Examples:
    >>> _release('0.12.2rc1') < (0, 12, 2) < _release('0.12.10'), _release('0.9.2')
    (False, (0, 9, 2))
  """
  match = re.match(r"\d+(\.\d+)*", version)
  return tuple(int(x) for x in match.group().split(".")) if match else ()


def install_hint(error: BaseException) -> str:
  """What to do when the demo's imports fail, naming the versions installed.

  Args:
    error: the exception the import raised (its message is appended).

  Returns:
    One line: what is missing and the command that installs it; or, when flax is installed
    but too old for the installed jax, both versions and the flax that runs with it.

  Examples:
    >>> install_hint(ImportError("No module named 'flax'")).startswith("optax-accum demo")
    True
  """
  jax_v, flax_v, tqdm_v = (_version(n) for n in ("jax", "flax", "tqdm"))
  missing = [name for name, v in (("flax", flax_v), ("tqdm", tqdm_v)) if v is None]
  if missing:
    return f"optax-accum demo needs {' and '.join(missing)}: {INSTALL_FLAX} ({error})"
  if jax_v and flax_v and _release(jax_v) >= JAX_NEEDS_NEW_FLAX and _release(flax_v) < NEW_FLAX:
    new_flax, new_jax = (".".join(map(str, v)) for v in (NEW_FLAX, JAX_NEEDS_NEW_FLAX))
    return (
      f"optax-accum demo: flax {flax_v} is installed but does not run with jax {jax_v}: "
      f'with jax >= {new_jax} use flax >= {new_flax}: pip install -U "flax>={new_flax}" '
      f'(or keep flax {flax_v} with pip install "jax<{new_jax}") ({error})'
    )
  return (
    f"optax-accum demo: flax {flax_v}, tqdm {tqdm_v} and jax {jax_v} are installed, but the "
    f"demo's imports failed: {error}"
  )


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
    "--record",
    metavar="PATH",
    help="also write what the demo prints and a summary to PATH as JSON (README.md's and "
    "docs/demo.md's samples are rendered from such records by benchmarks/render_tables.py)",
  )
  demo.add_argument(
    "--memory-budget",
    help="plan the largest microbatch of the same window whose compiled step fits, e.g. 200MB",
  )
  args = parser.parse_args(argv)
  record = recording.Recorder(args.record, argv) if args.record else None
  try:
    code = _run_demo(demo, args, record)
  except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback
    print("\noptax-accum demo: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    return 130
  if record is not None:
    record.save(code)
  return code


def _run_demo(demo: argparse.ArgumentParser, args: argparse.Namespace, record: Any) -> int:
  """Plans or checks the microbatch, then trains; returns the exit code."""
  out = record.tee(sys.stdout) if record else sys.stdout
  err = record.tee(sys.stderr) if record else sys.stderr
  try:
    from optax_accum.demo import plan, train
  except (ImportError, AttributeError) as e:  # flax or tqdm missing, or flax too old for jax
    demo.exit(1, install_hint(e) + "\n")
  config = train.QUICK if args.quick else train.DemoConfig()
  fields = {f.name for f in dataclasses.fields(config)}
  overrides = {k: v for k, v in vars(args).items() if k in fields}
  if overrides.get("tokens_per_update") == 0:  # 0: off, windows of every_k microbatches
    overrides["tokens_per_update"] = None
  for name, value in overrides.items():
    if name != "seed" and value is not None and value < 1:
      demo.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
  config = dataclasses.replace(config, **overrides)
  if "every_k" in overrides and config.tokens_per_update is not None:
    print(
      f"note: --every-k {config.every_k} sets only the pre-flight's window: windows close at "
      f"--tokens-per-update {config.tokens_per_update} real bytes (add --tokens-per-update 0 "
      f"for windows of {config.every_k} microbatches)",
      file=out,
      flush=True,
    )
  if config.adaptive and config.tokens_per_update is None:
    demo.error("--adaptive sizes windows in tokens: give --tokens-per-update (the smallest), not 0")
  if args.memory_budget is not None:  # compiles the step for a few sizes; allocates nothing
    try:
      config, line = plan.plan_config(config, args.memory_budget)
    except ValueError as e:
      demo.error(f"--memory-budget {args.memory_budget}: {e}")
    print(line, file=out, flush=True)
  elif (refusal := plan.check_fits(config)) is not None:  # before anything is allocated
    print(f"optax-accum demo: {refusal}", file=err, flush=True)
    return 2
  result = train.train(config, out=out, progress=not args.no_progress)
  if record is not None:
    record.result = result
  return 0


if __name__ == "__main__":
  sys.exit(main())
