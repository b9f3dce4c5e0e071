"""Boundary guards: skip a window whose loss or gradient norm spikes (``skip_if=``).

A guard judges the whole window once, at the boundary, from statistics the boundary computes
anyway (a per-microbatch guard would judge a fraction of the batch). A skipped window changes
nothing but ``num_spikes``. docs/guards.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import _checks, _numerics

_STATS = ("loss", "grad_norm")


class WindowStats(NamedTuple):
  """What a ``skip_if`` callable sees of a closing window (0-d, global under ``axis_name``).

  Attributes:
    grad_norm: float32, the global L2 norm of the unscaled window mean, before clipping.
    loss: float32, the weighted mean ``value`` of the window (0.0 when none was passed).
    has_loss: bool, whether ``value`` was passed with the window's microbatches.
    weight: float32, the window's weight sum (examples or tokens).
    num_updates: int32, windows applied before this one.
  """

  grad_norm: jax.Array
  loss: jax.Array
  has_loss: jax.Array
  weight: jax.Array
  num_updates: jax.Array


@dataclasses.dataclass(frozen=True)
class SpikeRule:
  """A spike rule's settings; made by :func:`spike_rule`."""

  watch: tuple[str, ...]
  history: int
  threshold: float
  warmup: int


class SpikeState(NamedTuple):
  """A spike rule's history: ``values`` float32 ``[len(watch), history]`` (a ring), ``count``."""

  values: jax.Array
  count: jax.Array


class GuardState(NamedTuple):
  """``accumulate(skip_if=...)``'s sub-state: ``num_spikes`` (int32), one SpikeState per rule."""

  num_spikes: jax.Array
  rules: tuple[Any, ...]


def spike_rule(
  watch: str | tuple[str, ...] = ("loss", "grad_norm"),
  *,
  history: int = 128,
  threshold: float = 6.0,
  warmup: int | None = None,
) -> SpikeRule:
  """Skip a window whose loss or global norm is ``threshold`` std above its recent history.

  A window is a spike when, after ``warmup`` applied windows, a watched statistic exceeds
  ``mean + threshold * std`` (sample std) of the last ``history`` applied windows (a ring in
  the state: it resumes bitwise), or is not finite. OLMo-core's ``SkipStepOptimizer`` and
  MaxText's ``skip_step_on_spikes`` rule, judged once per window.

  Args:
    watch: ``'loss'`` (needs ``value=`` on every ``tx.update``), ``'grad_norm'``, or both.
    history: windows remembered, an int >= 2.
    threshold: standard deviations above the mean, a finite float > 0.
    warmup: applied windows before the rule judges, in [2, history]; default
      ``max(2, history // 2)``.

  Returns:
    A :class:`SpikeRule` for ``accumulate(..., skip_if=...)``.

  Raises:
    ValueError, TypeError: naming a bad argument.

  Examples:
    >>> import optax, optax_accum
    >>> rule = optax_accum.spike_rule("grad_norm", history=16, threshold=4.0)
    >>> rule.warmup
    8
    >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4, skip_if=rule)
  """
  watch = (watch,) if isinstance(watch, str) else tuple(watch)
  if not watch or len(set(watch)) != len(watch) or not set(watch) <= set(_STATS):
    raise ValueError(f"spike_rule: watch must name 'loss', 'grad_norm' or both, got {watch!r}.")
  history = _checks.positive_int(history, "history", "windows remembered")
  if history < 2:
    raise ValueError("spike_rule: history must be >= 2 (a std needs two windows), got 1.")
  threshold = _checks.real_number(threshold, "threshold", "standard deviations")
  if not 0 < threshold < float("inf"):
    raise ValueError(f"spike_rule: threshold must be finite and > 0, got {threshold}.")
  warmup = max(2, history // 2) if warmup is None else warmup
  warmup = _checks.positive_int(warmup, "warmup", "applied windows before judging")
  if not 2 <= warmup <= history:
    raise ValueError(f"spike_rule: warmup must be in [2, history={history}], got {warmup}.")
  return SpikeRule(watch, history, threshold, warmup)


def check_skip_if(skip_if: Any) -> tuple[Any, ...]:
  """``skip_if`` as a tuple of rules and predicates (empty: no guard)."""
  if skip_if is None:
    return ()
  rules = tuple(skip_if) if isinstance(skip_if, (tuple, list)) else (skip_if,)
  for r in rules:
    if not (isinstance(r, SpikeRule) or callable(r)):
      raise TypeError(
        f"skip_if must be None, optax_accum.spike_rule(...), a callable of a WindowStats "
        f"returning a boolean scalar, or a tuple of them; got {r!r}."
      )
  return rules


def init_state(rules: tuple[Any, ...]) -> GuardState:
  fdt = _numerics.scalar_dtype()
  spikes = tuple(
    SpikeState(jnp.zeros((len(r.watch), r.history), fdt), jnp.zeros((), jnp.int32))
    for r in rules
    if isinstance(r, SpikeRule)
  )
  return GuardState(jnp.zeros((), jnp.int32), spikes)


def check_call(rules: tuple[Any, ...], value: Any) -> None:
  """Raises at trace time if a rule watches the loss and no ``value`` was passed."""
  if value is None and any(isinstance(r, SpikeRule) and "loss" in r.watch for r in rules):
    raise ValueError(
      "skip_if=spike_rule(watch=('loss', ...)) needs the microbatch loss: pass value=loss "
      "to every tx.update, or watch only 'grad_norm': spike_rule('grad_norm')."
    )


def judge(rules: tuple[Any, ...], state: GuardState, stats: WindowStats) -> jax.Array:
  """Whether any rule calls this window a spike (a boolean scalar)."""
  spike = jnp.zeros((), jnp.bool_)
  spikes = iter(state.rules)
  for r in rules:
    if isinstance(r, SpikeRule):
      spike = spike | _is_spike(r, next(spikes), stats)
    else:
      spike = spike | _predicate(r, stats)
  return spike


def close(rules, state: GuardState, stats: WindowStats, applied, spike) -> GuardState:
  """The guard after the window: an applied window enters each history; a spike is counted."""
  new_rules = []
  spikes = iter(state.rules)
  for r in (r for r in rules if isinstance(r, SpikeRule)):
    s = next(spikes)
    x = _watched(r, stats).astype(s.values.dtype)
    slot = s.count % r.history
    values = jnp.where(applied, s.values.at[:, slot].set(x), s.values)
    new_rules.append(SpikeState(values, jnp.where(applied, optax.safe_increment(s.count), s.count)))
  num = jnp.where(spike, optax.safe_increment(state.num_spikes), state.num_spikes)
  return GuardState(num, tuple(new_rules))


def _watched(rule: SpikeRule, stats: WindowStats) -> jax.Array:
  return jnp.stack([getattr(stats, name).astype(_numerics.scalar_dtype()) for name in rule.watch])


def _is_spike(rule: SpikeRule, s: SpikeState, stats: WindowStats) -> jax.Array:
  x = _watched(rule, stats)
  n = jnp.minimum(s.count, rule.history).astype(s.values.dtype)
  seen = jnp.arange(rule.history) < s.count
  mean = jnp.where(seen, s.values, 0).sum(axis=1) / jnp.maximum(n, 1)
  var = jnp.where(seen, (s.values - mean[:, None]) ** 2, 0).sum(axis=1) / jnp.maximum(n - 1, 1)
  high = x > mean + rule.threshold * jnp.sqrt(var)
  # A non-finite statistic is a spike even in the warm-up: it never enters the history.
  return ((s.count >= rule.warmup) & jnp.any(high)) | ~jnp.all(jnp.isfinite(x))


def _predicate(fn: Callable[[WindowStats], Any], stats: WindowStats) -> jax.Array:
  out = jnp.asarray(fn(stats))
  if out.ndim != 0 or out.dtype != jnp.bool_:
    raise TypeError(
      f"skip_if's callable must return a boolean scalar (True: skip the window), got "
      f"{out.dtype}{list(out.shape)}. Compare, e.g. lambda s: s.grad_norm > 10.0."
    )
  return out
