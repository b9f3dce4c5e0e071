"""The demo's training loop: a byte-level transformer on Python's sources, token-weighted.

One microbatch is ``microbatch_size`` padded lines; its loss is the mean over
its real (unmasked) bytes, and it is passed to the optimizer with
``weight = mask.sum()``. ``every_k`` microbatches make one window, and
``optax_accum.accumulate(optax.adamw(...), every_k)`` applies one AdamW step per
window with the gradient of the mean over *all* the window's real bytes, the
gradient one physical batch of ``every_k * microbatch_size`` lines would give.

Before training, :func:`preflight` checks exactly that on the first window of
real text with :func:`optax_accum.testing.check_equivalence`, and shows how far
the mean of the microbatch means would have been.

The step is one ``jax.jit`` function of the split ``(model, optimizer)`` state
(``nnx.split`` / ``nnx.merge`` inside, the state donated). At the default size
on 2 CPU cores it took 29 ms of CPU per microbatch, against 40 ms for the same
step as an ``nnx.jit`` function of the module objects (whose graph traversal
runs on every call) and about 30 ms with ``nnx.cached_partial``.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any, NamedTuple, TextIO

import jax
import numpy as np
import optax
from flax import nnx

import optax_accum
import optax_accum.flax
from optax_accum.demo import console
from optax_accum.demo.model import CharTransformer, token_loss
from optax_accum.demo.setup import (  # noqa: F401 - re-exported for `train.QUICK` etc.
  QUICK,
  Batch,
  DemoConfig,
  make_inner,
  make_model,
  microbatches,
  planned_by_tokens,
  planned_microbatches,
  split_lines,
)
from optax_accum.testing import EquivalenceReport, check_equivalence


class TrainResult(NamedTuple):
  """What :func:`train` measured.

  Attributes:
    preflight: the :class:`optax_accum.testing.EquivalenceReport` of the first
      window (``None`` when the pre-flight was not run).
    losses: float64 ``[num_updates]``, each applied window's token-weighted
      mean training loss (nats per byte), from ``metrics(...).window_loss``.
    eval_before: held-out loss of the initial model, nats per byte.
    eval_after: held-out loss after training, nats per byte.
    metrics: :func:`optax_accum.metrics` of the final state, as Python numbers.
    tokens: real (unmasked) target bytes trained on.
    flushed_windows: incomplete windows closed at an epoch's end or the run's.
    window_tokens: int64 ``[num_updates]``, the real bytes (tokens) of each
      applied window (the host's count of its microbatches' weights).
    train_seconds: wall time of the training loop (compilation excluded).
    tokens_per_second: ``tokens / train_seconds``.
    model: the trained model.
  """

  preflight: EquivalenceReport | None
  losses: np.ndarray
  eval_before: float
  eval_after: float
  metrics: dict[str, Any]
  tokens: int
  flushed_windows: int
  window_tokens: np.ndarray
  train_seconds: float
  tokens_per_second: float
  model: CharTransformer


def preflight(
  model: CharTransformer, window: list[Batch], inner: optax.GradientTransformation
) -> EquivalenceReport:
  """Checks one window of real text against the same lines as one physical batch.

  Calls :func:`optax_accum.testing.check_equivalence` with the demo's loss,
  ``weight_fn = mask.sum()`` and the window's own microbatches (contiguous
  rows, as in training).

  Args:
    model: the model at its initial params (not modified).
    window: ``config.every_k`` microbatches, as from :func:`microbatches`.
    inner: the run's inner optimizer (its update is one row of the table).

  Returns:
    The :class:`~optax_accum.testing.EquivalenceReport`.

  Examples:
    >>> cfg = DemoConfig(microbatch_size=2, every_k=2, seq_len=8, dim=8, depth=1, heads=2)
    >>> mbs = microbatches([b'import os', b'x = 1', b'def f(a, b):', b'pass'], 8, 2)
    >>> [int(mb['mask'].sum()) for mb in mbs]  # real bytes: 8 + 4, and 8 (cut) + 3
    [12, 11]
    >>> report = preflight(make_model(cfg), mbs, make_inner(cfg))  # doctest: +SKIP
    >>> report.weights, report.sgd_across_step.max_rel < 1e-5  # doctest: +SKIP
    ((12.0, 11.0), True)
  """
  batch = {k: np.concatenate([mb[k] for mb in window]) for k in window[0]}
  return check_equivalence(
    token_loss,
    model,
    batch,
    inner,
    num_microbatches=len(window),
    weight_fn=lambda mb: mb["mask"].sum(),
    strided=False,
  )


def accumulated_difference(report: EquivalenceReport) -> float:
  """The largest relative difference of the accumulated window from one physical batch.

  The maximum over the across-step ``sgd(1)`` step (minus the window-mean
  gradient) and the in-step gradient, each relative to the batch gradient's
  largest magnitude.
  """
  return max(report.sgd_across_step.max_rel, report.grad_in_step.max_rel)


def _make_step(graphdef: Any) -> Any:
  @functools.partial(jax.jit, donate_argnums=0)  # the old state's buffers are reused
  def step(state, batch, flush):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(token_loss)(model, batch)
    optimizer.update(model, grads, weight=batch["mask"].sum(), value=loss, flush=flush)
    return nnx.state((model, optimizer)), optax_accum.metrics(optimizer.opt_state)

  return step


def _make_eval(graphdef: Any) -> Any:
  @jax.jit
  def loss_sum_and_tokens(state, batch):
    model, _ = nnx.merge(graphdef, state)
    n = batch["mask"].sum()
    return token_loss(model, batch) * n, n

  return loss_sum_and_tokens


def _evaluate(loss_sum_and_tokens: Any, state: Any, batches: list[Batch]) -> float:
  sums = [loss_sum_and_tokens(state, b) for b in batches]
  return float(sum(s for s, _ in sums) / sum(n for _, n in sums))


# The run-time estimate times TIMING_SECONDS or a TIMING_FRACTION of the planned microbatches,
# whichever comes first (to a window's end), at most TIMING_MAX_SECONDS: a run shorter than a
# second still gets its estimate, early.
TIMING_SECONDS, TIMING_FRACTION, TIMING_MAX_SECONDS = 1.0, 0.1, 10.0
# The EMA decay of the gradient noise scale (per window; about the last 20 windows count).
NOISE_SCALE_DECAY = 0.95
# --adaptive: windows from tokens_per_update up to this many times it (docs/noise_scale.md).
ADAPTIVE_RANGE = 16


def train(
  config: DemoConfig,
  *,
  out: TextIO | None = sys.stdout,
  progress: bool = True,
  check: bool = True,
  inner: optax.GradientTransformation | None = None,
) -> TrainResult:
  """Runs the demo: pre-flight check, training with token weights, summary.

  Data: shuffled standard-library lines, ``eval_lines`` held out; each epoch
  reshuffles the rest. Each microbatch is one call of a jitted step that
  computes the masked-mean loss's gradient and calls
  ``optimizer.update(model, grads, weight=mask.sum(), value=loss, flush=last)``
  on an ``optax_accum.flax.Optimizer(model, accumulate(adamw, every_k), wrt=nnx.Param)``;
  ``flush`` is True on an epoch's last microbatch, so windows never straddle
  epochs, and a window still open when the run stops is closed with
  :func:`optax_accum.flush`.

  Args:
    config: sizes and hyperparameters.
    out: where to print the report (``None``: silent).
    progress: show progress over updates with loss and tokens/s: a tqdm bar
      (on stderr) when stdout and stderr are terminals, else a plain line to
      ``out`` every tenth of the run.
    check: run :func:`preflight` first.
    inner: the optimizer to wrap; default :func:`make_inner` (AdamW).

  Returns:
    A :class:`TrainResult`.

  Examples:
    >>> cfg = DemoConfig(microbatch_size=4, every_k=2, updates=3, seq_len=8, dim=8, depth=1,
    ...                  heads=2, max_files=1, eval_lines=8)
    >>> r = train(cfg, out=None, progress=False, check=False)  # doctest: +SKIP
    >>> r.metrics['num_updates'], len(r.losses), r.metrics['num_microbatches']  # doctest: +SKIP
    (3, 3, 6)
  """
  t_start = time.perf_counter()
  train_lines, eval_lines = split_lines(config)
  eval_batches = microbatches(eval_lines, config.seq_len, max(config.microbatch_size, 64))
  model = make_model(config)
  inner = make_inner(config) if inner is None else inner
  budget = config.tokens_per_update
  # Each window closes at its every_k-th microbatch, or (a token budget) at the first one
  # reaching `budget` real bytes; the gradient noise scale (docs/noise_scale.md) is B_simple in
  # tokens, from each window's microbatches.
  every_k = config.every_k if budget is None else optax_accum.token_budget(budget)
  noise = optax_accum.noise_scale(NOISE_SCALE_DECAY)
  adaptive = None
  if config.adaptive:  # the budget follows B_simple, measured by the policy itself
    if budget is None:  # the command line refuses --adaptive without a token budget
      raise ValueError("DemoConfig(adaptive=True) needs tokens_per_update (the smallest budget)")
    high = ADAPTIVE_RANGE * budget
    adaptive = optax_accum.adaptive_window(budget, high, decay=NOISE_SCALE_DECAY)
    tx = adaptive.scale_learning_rate(optax_accum.accumulate(inner, adaptive))
  else:
    tx = optax_accum.accumulate(inner, every_k, observe=(noise,))
  optimizer = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)  # the fused path
  num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  epoch = microbatches(train_lines, config.seq_len, config.microbatch_size)
  console.header(out, config, num_params, len(train_lines) + len(eval_lines))
  if adaptive is not None:
    console.write(
      out,
      f"adaptive: each window's budget moves toward B_simple, from {adaptive.min_weight:g} to"
      f" {adaptive.max_weight:g} real bytes, by at most x{adaptive.max_factor} per update"
      f" after {adaptive.warmup} windows; the learning rate x sqrt(window bytes /"
      f" {adaptive.min_weight:g})",
    )
  report = _report_preflight(out, model, epoch[: config.every_k], inner) if check else None

  graphdef, state = nnx.split((model, optimizer))
  loss_sum_and_tokens = _make_eval(graphdef)
  step = _make_step(graphdef).lower(state, epoch[0], np.bool_(False)).compile()
  eval_before = _evaluate(loss_sum_and_tokens, state, eval_batches)
  if budget is None:
    planned = planned_microbatches(config, len(epoch))
  else:
    planned = planned_by_tokens(config, train_lines)
  console.write(
    out,
    f"\nTraining: {config.updates} updates = {'at least ' if config.adaptive else ''}"
    f"{planned:,} microbatches "
    f"({planned / len(epoch):.1f} epochs of {len(epoch):,}); held-out loss before: "
    f"{eval_before:.4f}",
  )
  run = _loop(config, step, state, train_lines, planned, out, progress)
  # The loop stops right after a window closed, so no window is left open here:
  # an open one would be closed with flush=True on its last microbatch.
  model, optimizer = nnx.merge(graphdef, run.state)
  final = optax_accum.metrics(optimizer.opt_state)
  losses = np.asarray([float(x) for x in run.window_losses], np.float64)
  result = TrainResult(
    preflight=report,
    losses=losses,
    eval_before=eval_before,
    eval_after=_evaluate(loss_sum_and_tokens, run.state, eval_batches),
    # Arrays and weight counts (not None, nor the observers' tuple of dicts).
    metrics={k: v.item() for k, v in final._asdict().items() if hasattr(v, "item")},
    tokens=run.tokens,
    flushed_windows=run.flushed,
    window_tokens=np.asarray(run.window_weights, np.int64),
    train_seconds=run.train_seconds,
    tokens_per_second=run.tokens / run.train_seconds,
    model=model,
  )
  console.summary(out, result, config, run.full_windows, t_start)
  return result


def _report_preflight(
  out: TextIO | None, model: CharTransformer, window: list[Batch], inner: Any
) -> EquivalenceReport:
  """Runs :func:`preflight` on the first window and prints its report."""
  report = preflight(model, window, inner)
  console.write(
    out, "\nPre-flight: the first window of real text, accumulated vs one physical batch"
  )
  console.write(out, str(report))
  acc_diff = accumulated_difference(report)
  mom = report.mean_of_means.max_rel
  ratio = f" ({mom / acc_diff:,.0f}x larger)" if acc_diff > 0 else ""
  console.write(out, f"pre-flight: accumulated vs physical batch max rel diff = {acc_diff:.2e}")
  if len(report.weights) > 1:  # one microbatch: its mean is the window's
    console.write(out, f"pre-flight: mean-of-means gradient max rel diff = {mom:.2e}{ratio}")
  return report


class _Run(NamedTuple):
  """What the training loop counted."""

  state: Any
  window_losses: list[Any]
  window_weights: list[int]
  full_windows: list[bool]
  tokens: int
  flushed: int
  train_seconds: float


def _loop(config, step, state, train_lines, planned, out, progress) -> _Run:
  """Trains until ``config.updates`` windows are applied, reshuffling the lines each epoch."""
  epoch_rng = np.random.default_rng(config.seed + 1)
  epoch = microbatches(train_lines, config.seq_len, config.microbatch_size)
  budget = config.tokens_per_update
  shown = console.Progress(out, config, progress)
  window_losses, window_weights, full_windows, tokens, flushed, num_updates = [], [], [], 0, 0, 0
  pending = pending_tokens = 0  # the open window's microbatches and tokens (a host mirror)
  done, mark = 0, None  # microbatches run; (time, done) when the timing started
  m = None  # the last microstep's metrics
  try:
    while num_updates < config.updates:
      for i, mb in enumerate(epoch):
        last = i == len(epoch) - 1
        state, m = step(state, mb, np.bool_(last))
        tokens += int(mb["mask"].sum())
        pending_tokens += int(mb["mask"].sum())
        pending += 1
        done += 1
        # Time from the end of the first microbatch (one-time costs) to the end of the first
        # window that ends TIMING_SECONDS or a TIMING_FRACTION of the run later, or for
        # TIMING_MAX_SECONDS; then estimate once.
        full = pending >= config.every_k if budget is None else pending_tokens >= budget
        closes = full or last
        if mark is None:
          jax.block_until_ready(m.num_updates)
          mark = (time.perf_counter(), done)
        elif mark and (
          closes
          and (console.since(mark) >= TIMING_SECONDS or done - mark[1] >= TIMING_FRACTION * planned)
          or console.since(mark) > TIMING_MAX_SECONDS
        ):
          jax.block_until_ready(m.num_updates)
          console.estimate(shown.write, time.perf_counter() - shown.t0, mark, done, planned)
          mark = False
        if not closes:
          continue
        # A window closed (full: every_k microbatches or the token budget; or flushed at the
        # epoch's end).
        flushed += not full
        full_windows.append(full)
        window_losses.append(m.window_loss)
        window_weights.append(pending_tokens)
        pending = pending_tokens = 0
        new_updates = int(m.num_updates)  # waits for this step: one sync per window
        budget = budget if m.window_budget is None else float(m.window_budget)  # --adaptive
        shown.closed(m, num_updates, new_updates, tokens, window_weights[-1])
        num_updates = new_updates
        if num_updates >= config.updates:
          break
      epoch_rng.shuffle(train_lines)
      epoch = microbatches(train_lines, config.seq_len, config.microbatch_size)
  except KeyboardInterrupt:  # Ctrl-C: close the bar; the command line says the rest
    shown.bar.close()
    raise
  train_seconds = time.perf_counter() - shown.t0
  shown.close(m, tokens, train_seconds)
  return _Run(state, window_losses, window_weights, full_windows, tokens, flushed, train_seconds)
