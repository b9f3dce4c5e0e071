"""What the demo prints: the header, the run-time estimate, progress and the summary."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import numpy as np
from tqdm.auto import tqdm

from optax_accum.demo.setup import DemoConfig

# A run estimated to take longer than this gets a warning line.
LONG_RUN_SECONDS = 30 * 60

# Without a terminal, progress is a plain line about this often (in updates: a tenth of the run).
PROGRESS_LINES = 10


def write(out: TextIO | None, text: str = "") -> None:
  if out is not None:
    print(text, file=out, flush=True)


def is_tty(stream: Any) -> bool:
  return bool(getattr(stream, "isatty", lambda: False)())


def duration(seconds: float) -> str:
  if seconds < 120:
    return f"{seconds:.0f} s"
  return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def since(mark: tuple[float, int]) -> float:
  return time.perf_counter() - mark[0]


def estimate(
  say: Callable[[str], None], elapsed: float, mark: tuple[float, int], done: int, planned: int
) -> None:
  """Says the estimated training time from ``done - mark[1]`` microbatches timed since mark.

  ``say`` prints a line (:meth:`Progress.write`: above the progress bar, never into it).
  """
  per_microbatch = since(mark) / (done - mark[1])
  estimate = elapsed + per_microbatch * (planned - done)
  say(
    f"timing: {done - mark[1]} microbatches in {since(mark):.1f} s; estimated training time "
    f"{duration(estimate)} for {planned:,} microbatches"
  )
  if estimate > LONG_RUN_SECONDS:
    say(
      f"warning: a long run (about {duration(estimate)}); Ctrl-C stops it, --quick or "
      "smaller --updates make it shorter"
    )


def header(out: TextIO | None, config: DemoConfig, num_params: int, num_lines: int) -> None:
  write(
    out,
    f"optax_accum demo: a byte-level transformer ({num_params:,} params: dim {config.dim}, "
    f"depth {config.depth}, {config.heads} heads) on {num_lines:,} "
    f"lines of Python's standard library ({config.max_files} files), jax {jax.__version__} "
    f"on {jax.default_backend()}",
  )
  budget = config.tokens_per_update
  window = f"every_k={config.every_k} microbatches"
  if budget is not None:
    window = f"the first microbatch reaching --tokens-per-update {budget} real bytes closes it"
  write(
    out,
    f"window: {window}, {config.microbatch_size} lines of <= {config.seq_len} bytes per "
    f"microbatch, weight = real bytes per microbatch; inner: adamw("
    f"{config.learning_rate:g}, weight_decay={config.weight_decay:g}), warmup-cosine over "
    f"{config.updates} updates",
  )


class Progress:
  """The tqdm bar (when stdout and stderr are terminals), else a plain line per tenth of the run."""

  def __init__(self, out: TextIO | None, config: DemoConfig, progress: bool):
    self.out, self.config = out, config
    use_bar = progress and is_tty(sys.stderr) and is_tty(sys.stdout)
    self.lines_every = max(1, config.updates // PROGRESS_LINES) if progress and not use_bar else 0
    self.bar = tqdm(total=config.updates, unit="update", disable=not use_bar, file=sys.stderr)
    self.t0 = self.last_postfix = time.perf_counter()

  def write(self, text: str) -> None:
    """Prints a line to ``out``; with the bar on, above it (``tqdm.write`` clears the bar,
    prints, and redraws it), never into the middle of it."""
    if self.out is None:
      return
    if self.bar.disable:
      write(self.out, text)
    else:
      tqdm.write(text, file=self.out)
      self.out.flush()

  def closed(self, m: Any, before: int, after: int, tokens: int, window_tokens: int) -> None:
    """A window closed: ``num_updates`` went from ``before`` to ``after``."""
    self.bar.update(after - before)
    if self.lines_every and after // self.lines_every > before // self.lines_every:
      elapsed = time.perf_counter() - self.t0
      self.write(
        f"update {after}/{self.config.updates}: loss {float(m.window_loss):.3f}, "
        f"{window_tokens} tokens in this update, {tokens / elapsed:,.0f} tokens/s, "
        f"{duration(elapsed)} elapsed, B_simple {float(m.noise_scale):,.0f} tokens",
      )
    if time.perf_counter() - self.last_postfix > 0.5:
      self.last_postfix = time.perf_counter()
      rate = tokens / (self.last_postfix - self.t0)
      self.bar.set_postfix(
        loss=f"{float(m.window_loss):.3f}",
        tok_s=f"{rate:,.0f}",
        b_noise=f"{float(m.noise_scale):,.0f}",
        refresh=False,
      )

  def close(self, m: Any, tokens: int, seconds: float) -> None:
    if m is not None:  # None: no microstep ran
      self.bar.set_postfix(loss=f"{float(m.window_loss):.3f}", tok_s=f"{tokens / seconds:,.0f}")
    self.bar.close()


def summary(
  out: TextIO | None, r: Any, config: DemoConfig, full_windows: list[bool], t_start: float
) -> None:
  losses, window_tokens, final, flushed = r.losses, r.window_tokens, r.metrics, r.flushed_windows
  budget, tokens = config.tokens_per_update, r.tokens
  tail = min(20, len(losses))
  write(
    out,
    f"training loss: {losses[0]:.4f} (update 1) -> {losses[-tail:].mean():.4f} "
    f"(mean of the last {tail} updates)",
  )
  write(out, f"held-out loss: {r.eval_before:.4f} -> {r.eval_after:.4f} nats/byte")
  full = window_tokens[np.asarray(full_windows[: len(window_tokens)], bool)]
  write(
    out,
    f"tokens per update: min {window_tokens.min()}, mean {window_tokens.mean():.0f}, max "
    f"{window_tokens.max()}, std {window_tokens.std():.0f} ("
    + ("every_k windows" if budget is None else f"budget {budget}")
    + (f"; without the {flushed} flushed: std {full.std():.0f})" if flushed and full.size else ")"),
  )
  write(
    out,
    f"metrics: num_updates={final['num_updates']} num_skipped={final['num_skipped']} "
    f"num_microbatches={final['num_microbatches']} flushed_windows={flushed} "
    f"tokens={tokens:,} ({tokens / r.train_seconds:,.0f} tokens/s); "
    f"total {time.perf_counter() - t_start:.1f} s",
  )
  write(
    out,
    f"critical batch (gradient noise scale B_simple, EMA over windows): "
    f"{final['noise_scale']:,.0f} tokens; effective batch: "
    f"{tokens / max(final['num_updates'], 1):,.0f} tokens per update (docs/noise_scale.md)",
  )
