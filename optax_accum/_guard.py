"""Guards (``skip_if=``): skip a window that spikes, or drop a microbatch as optax.MultiSteps does.

Non-finite windows are always skipped (the state stays finite); a guard adds a judgement:

* a window guard judges the whole window once, at the boundary, from statistics the boundary
  computes anyway (:class:`_protocols.WindowStats`): :func:`spike_rule`, a predicate of the
  statistics, or any object of the :class:`_protocols.Guard` protocol. A skipped window changes
  nothing but ``num_spikes``;
* an ``optax.MultiSteps`` ``should_skip_update_fn`` (``optax.skip_not_finite``,
  ``optax.skip_large_updates``, a user's) judges each microbatch with MultiSteps' meaning: the
  microbatch is dropped and does not count toward ``every_k`` (``num_dropped``).

The microstep reaches them all through one :class:`Guards` (``admit``, ``judge``, ``close``).
docs/guards.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import _checks, _numerics
from optax_accum._protocols import Outcome, WindowStats

PyTree = Any

_STATS = ("loss", "grad_norm")


class SpikeState(NamedTuple):
  """A spike rule's history: ``values`` float32 ``[len(watch), history]`` (a ring), ``count``."""

  values: jax.Array
  count: jax.Array


@dataclasses.dataclass(frozen=True)
class SpikeRule:
  """A window guard: a statistic ``threshold`` std above its recent history; see :func:`spike_rule`.

  Attributes:
    watch: the statistics judged, ``'loss'`` and/or ``'grad_norm'``.
    history: applied windows remembered.
    threshold: standard deviations above the mean.
    warmup: applied windows before the rule judges.
  """

  watch: tuple[str, ...]
  history: int
  threshold: float
  warmup: int

  def init(self) -> SpikeState:
    fdt = _numerics.scalar_dtype()
    return SpikeState(jnp.zeros((len(self.watch), self.history), fdt), jnp.zeros((), jnp.int32))

  def judge(self, state: SpikeState, stats: WindowStats) -> jax.Array:
    x = self._watched(stats)
    n = jnp.minimum(state.count, self.history).astype(state.values.dtype)
    seen = jnp.arange(self.history) < state.count
    mean = jnp.where(seen, state.values, 0).sum(axis=1) / jnp.maximum(n, 1)
    dev = jnp.where(seen, (state.values - mean[:, None]) ** 2, 0)
    var = dev.sum(axis=1) / jnp.maximum(n - 1, 1)
    high = x > mean + self.threshold * jnp.sqrt(var)
    # A non-finite statistic is a spike even in the warm-up: it never enters the history.
    return ((state.count >= self.warmup) & jnp.any(high)) | ~jnp.all(jnp.isfinite(x))

  def close(self, state: SpikeState, outcome: Outcome) -> SpikeState:
    """An applied window enters the history (a ring)."""
    x = self._watched(outcome.stats).astype(state.values.dtype)
    slot = state.count % self.history
    values = jnp.where(outcome.applied, state.values.at[:, slot].set(x), state.values)
    count = jnp.where(outcome.applied, optax.safe_increment(state.count), state.count)
    return SpikeState(values, count)

  def _watched(self, stats: WindowStats) -> jax.Array:
    return jnp.stack([getattr(stats, n).astype(_numerics.scalar_dtype()) for n in self.watch])


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
    A ``SpikeRule``, a guard for ``accumulate(..., skip_if=...)``.

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


@dataclasses.dataclass(frozen=True)
class _Predicate:
  """A window guard from a callable of :class:`WindowStats` returning a boolean scalar."""

  fn: Callable[[WindowStats], Any]

  def init(self) -> optax.EmptyState:
    return optax.EmptyState()

  def judge(self, state: Any, stats: WindowStats) -> jax.Array:
    del state
    return _boolean(self.fn(stats), "skip_if's window predicate", "lambda s: s.grad_norm > 10.0")

  def close(self, state: Any, outcome: Outcome) -> Any:
    del outcome
    return state


@dataclasses.dataclass(frozen=True)
class _MultiStepsSkip:
  """An ``optax.MultiSteps`` ``should_skip_update_fn``: ``fn(grads, num_updates, params)`` ->
  ``(should_skip, metrics)``; a skipped microbatch is dropped (MultiSteps' meaning)."""

  fn: Callable[..., Any]

  def drops(self, grads: PyTree, num_updates: jax.Array, params: PyTree) -> jax.Array:
    out = self.fn(grads, num_updates, params)
    skip = out[0] if isinstance(out, tuple) else out
    return _boolean(skip, "skip_if's should_skip_update_fn", "optax.skip_not_finite")


def _boolean(out: Any, what: str, example: str) -> jax.Array:
  out = jnp.asarray(out)
  if out.ndim != 0 or out.dtype != jnp.bool_:
    raise TypeError(
      f"{what} must return a boolean scalar (True: skip), got {out.dtype}{list(out.shape)}. "
      f"For example: {example}."
    )
  return out


class GuardState(NamedTuple):
  """``accumulate(skip_if=...)``'s sub-state.

  Attributes:
    num_spikes: int32, finite windows a window guard skipped.
    num_dropped: int32, microbatches an ``optax.MultiSteps`` ``should_skip_update_fn`` dropped.
    rules: one sub-state per window guard, in ``skip_if``'s order.
  """

  num_spikes: jax.Array
  num_dropped: jax.Array
  rules: tuple[Any, ...]

  def metrics(self) -> dict[str, Any]:
    """What :func:`optax_accum.metrics` shows: ``num_spikes`` and ``num_dropped``."""
    return {"num_spikes": self.num_spikes, "num_dropped": self.num_dropped}


@dataclasses.dataclass(frozen=True)
class Guards:
  """``skip_if``'s guards, as the microstep reaches them (empty: nothing computed, no state)."""

  window: tuple[Any, ...] = ()
  microbatch: tuple[_MultiStepsSkip, ...] = ()

  def __bool__(self) -> bool:
    return bool(self.window or self.microbatch)

  def init(self) -> GuardState | optax.EmptyState:
    if not self:
      return optax.EmptyState()
    zero = lambda: jnp.zeros((), jnp.int32)
    return GuardState(zero(), zero(), tuple(g.init() for g in self.window))

  def check_call(self, value: Any) -> None:
    """Raises at trace time if a rule watches the loss and no ``value`` was passed."""
    watches_loss = any(isinstance(g, SpikeRule) and "loss" in g.watch for g in self.window)
    if value is None and watches_loss:
      raise ValueError(
        "skip_if=spike_rule(watch=('loss', ...)) needs the microbatch loss: pass value=loss "
        "to every tx.update, or watch only 'grad_norm': spike_rule('grad_norm')."
      )

  def admit(self, state: Any, grads: PyTree, num_updates: jax.Array, params: PyTree):
    """``(admitted, state)``: whether the microbatch enters the window (no microbatch guard
    drops it), and the sub-state with a drop counted. ``admitted`` is a constant True when no
    microbatch guard is given (XLA folds it)."""
    if not self.microbatch:
      return jnp.ones((), jnp.bool_), state
    dropped = jnp.zeros((), jnp.bool_)
    for g in self.microbatch:
      dropped = dropped | g.drops(grads, num_updates, params)
    count = jnp.where(dropped, optax.safe_increment(state.num_dropped), state.num_dropped)
    return ~dropped, state._replace(num_dropped=count)

  def judge(self, state: Any, stats: WindowStats) -> jax.Array:
    """Whether a window guard calls this window a spike (a boolean scalar)."""
    spike = jnp.zeros((), jnp.bool_)
    for g, s in zip(self.window, state.rules if self.window else (), strict=True):
      spike = spike | g.judge(s, stats)
    return spike

  def close(self, state: Any, outcome: Outcome) -> Any:
    """The sub-state after the window: each guard's, and a spike counted."""
    if not self:
      return state
    rules = tuple(g.close(s, outcome) for g, s in zip(self.window, state.rules, strict=True))
    num = jnp.where(outcome.spike, optax.safe_increment(state.num_spikes), state.num_spikes)
    return state._replace(num_spikes=num, rules=rules)


def guards(skip_if: Any) -> Guards:
  """``skip_if`` (None, a guard, a predicate, a ``should_skip_update_fn`` or a tuple) as
  :class:`Guards`; a callable is told apart by the arguments it takes (one: a window
  predicate; three: ``(updates, gradient_step, params)``, MultiSteps' protocol)."""
  if skip_if is None:
    return Guards()
  items = tuple(skip_if) if isinstance(skip_if, (tuple, list)) else (skip_if,)
  window, microbatch = [], []
  for g in items:
    if all(callable(getattr(g, m, None)) for m in ("init", "judge", "close")):
      window.append(g)
    elif callable(g):
      kind = _callable_kind(g)
      (window if kind == "predicate" else microbatch).append(
        _Predicate(g) if kind == "predicate" else _MultiStepsSkip(g)
      )
    else:
      raise TypeError(
        f"skip_if takes optax_accum.spike_rule(...), a predicate of the window's statistics "
        f"(lambda s: s.grad_norm > 10.0), an optax.MultiSteps should_skip_update_fn "
        f"(optax.skip_not_finite), an object with init/judge/close methods, or a tuple of "
        f"them; got {g!r}."
      )
  return Guards(tuple(window), tuple(microbatch))


def _callable_kind(fn: Callable[..., Any]) -> str:
  """``'predicate'`` (takes one argument) or ``'multisteps'`` (takes three)."""
  one, three = _checks.takes(fn, 1), _checks.takes(fn, 3)
  if one is not None and one != three:
    return "predicate" if one else "multisteps"
  raise TypeError(
    f"skip_if cannot tell what {fn!r} judges from its signature: a window predicate takes one "
    "argument (the window's statistics: skip_if=lambda s: ...), an optax.MultiSteps "
    "should_skip_update_fn three (updates, gradient_step, params). Wrap it in a lambda of the "
    "one you mean."
  )
