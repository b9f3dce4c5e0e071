"""``optax-accum demo --record PATH``: what a run printed, and its numbers, as JSON.

The README's and docs/demo.md's demo samples are rendered from such records by
``benchmarks/render_tables.py`` (never edited by hand); ``tests/test_benchmarks.py`` keeps them
in agreement. Imports neither flax nor tqdm (the command line imports it before them).
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import platform
import sys
import time
from typing import Any, TextIO

import optax_accum


class _Tee(io.TextIOBase):
  """Writes to ``stream`` and to the record's buffer; a terminal when ``stream`` is one."""

  def __init__(self, stream: TextIO, buffer: io.StringIO):
    super().__init__()
    self.stream, self.buffer = stream, buffer

  def write(self, text: str) -> int:
    self.buffer.write(text)
    return self.stream.write(text)

  def flush(self) -> None:
    self.stream.flush()

  def isatty(self) -> bool:
    return bool(getattr(self.stream, "isatty", lambda: False)())


def installed(name: str) -> str | None:
  """The installed version of the distribution ``name``, or None."""
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def machine() -> dict[str, Any]:
  """Where the run ran: platform, cores, load, and the versions of Python and the stack."""
  return {
    "platform": platform.platform(),
    "processor": platform.processor() or platform.machine(),
    "cpu_count": os.cpu_count(),
    "python": sys.version.split()[0],
    "optax_accum": optax_accum.__version__,
    **{name: installed(name) for name in ("jax", "jaxlib", "optax", "flax")},
    "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
  }


class Recorder:
  """Collects a demo run's output (:meth:`tee`) and writes it with its numbers (:meth:`save`).

  Args:
    path: the JSON file to write.
    argv: the command line after ``optax-accum`` (``--record`` and its path are dropped from
      the command shown).

  Examples:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / 'demo.json'
    >>> rec = Recorder(str(path), ['demo', '--quick', '--record', str(path)])
    >>> print('hello', file=rec.tee(io.StringIO()))
    >>> rec.save(0)
    >>> saved = json.loads(path.read_text())
    >>> saved['command'], saved['output'], saved['exit_code']
    ('optax-accum demo --quick', 'hello\\n', 0)
  """

  def __init__(self, path: str, argv: list[str] | None):
    args = list(sys.argv[1:] if argv is None else argv)
    if "--record" in args:
      i = args.index("--record")
      del args[i : i + 2]
    args = [a for a in args if not a.startswith("--record=")]
    self.path, self.command = path, " ".join(["optax-accum", *args])
    self.buffer, self.result, self.t0 = io.StringIO(), None, time.perf_counter()

  def tee(self, stream: TextIO) -> io.TextIOBase:
    """``stream``, also written to the record."""
    return _Tee(stream, self.buffer)

  def save(self, exit_code: int) -> None:
    """Writes ``{benchmark, command, exit_code, wall_seconds, machine, output, summary}``."""
    report = {
      "benchmark": "demo",
      "command": self.command,
      "exit_code": exit_code,
      "wall_seconds": time.perf_counter() - self.t0,
      "machine": machine(),
      "output": self.buffer.getvalue(),
      "summary": summary(self.result) if self.result is not None else None,
    }
    with open(self.path, "w") as f:
      f.write(json.dumps(report, indent=1) + "\n")


def summary(result: Any) -> dict[str, Any]:
  """The numbers of a :class:`optax_accum.demo.train.TrainResult`, as JSON values."""
  report = result.preflight
  preflight = None
  if report is not None:
    preflight = {
      "verdict": report.verdict(),
      "passed": report.passed(),
      "weights": list(report.weights),
      "loss_weights": None if report.loss_weights is None else list(report.loss_weights),
      "loss_weights_residual": report.loss_weights_residual,
      "grad_max_rel": max(report.grad_in_step.max_rel, report.sgd_across_step.max_rel),
      "mean_of_means_max_rel": report.mean_of_means.max_rel,
    }
  tail = min(20, len(result.losses))
  return {
    "preflight": preflight,
    "first_loss": float(result.losses[0]),
    "last_losses_mean": float(result.losses[-tail:].mean()),
    "eval_before": result.eval_before,
    "eval_after": result.eval_after,
    "metrics": result.metrics,
    "tokens": result.tokens,
    "flushed_windows": result.flushed_windows,
    "window_tokens_std": float(result.window_tokens.std()),
    "train_seconds": result.train_seconds,
    "tokens_per_second": result.tokens_per_second,
  }
