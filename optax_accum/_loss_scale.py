"""Loss scales for fp16 training: their configuration, their pure update rule and their sub-state.

A policy (``static_loss_scale``, ``dynamic_loss_scale``) lives in ``accumulate``'s closure; the
scale and streak in :class:`LossScaleState`. The microstep reaches it through ``init``,
``scale`` and ``close`` (:class:`_Policy`); without a loss scale it meets :data:`NO_LOSS_SCALE`,
which keeps no state and whose scale is 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _checks, _numerics
from optax_accum._protocols import Outcome

# The scale lives in a float32 state: anything above this would be inf there.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class LossScaleState(NamedTuple):
  """The loss scale's sub-state of :class:`optax_accum.AccumulationState`.

  ``scale`` (float32) multiplies the open window's loss (the open window's sums depend on it:
  it is data, the policy is configuration); ``growth_streak`` (int32) counts applied windows
  since it changed.
  """

  scale: jax.Array
  growth_streak: jax.Array


class _Policy:
  """What the microstep calls on a loss-scale policy: its sub-state, the scale in force, and the
  sub-state after a window (``adjust`` unless the window was empty or a guard skipped it)."""

  def initial_scale(self) -> float:
    """The scale of the first window (a Python float); each policy's own."""
    raise NotImplementedError

  def adjust(
    self, scale: jax.Array, streak: jax.Array, finite: jax.Array
  ) -> tuple[jax.Array, jax.Array]:
    """``(new_scale, new_streak)`` at a non-empty window boundary; each policy's own."""
    raise NotImplementedError

  def init(self) -> LossScaleState:
    """The sub-state of a fresh window under this policy."""
    return LossScaleState(
      scale=jnp.asarray(self.initial_scale(), jnp.float32),
      growth_streak=jnp.zeros((), jnp.int32),
    )

  def scale(self, state: LossScaleState) -> jax.Array:
    """The scale of the open window (float32 0-d)."""
    return state.scale

  def close(self, state: LossScaleState, outcome: Outcome) -> LossScaleState:
    """The sub-state after a boundary: ``adjust`` unless the window was empty or a spike."""
    keep = outcome.empty | outcome.spike
    scale, streak = self.adjust(state.scale, state.growth_streak, outcome.finite)
    return state._replace(
      scale=jnp.where(keep, state.scale, scale),
      growth_streak=jnp.where(keep, state.growth_streak, streak),
    )


@dataclasses.dataclass(frozen=True)
class StaticLossScale(_Policy):
  """A constant loss scale; make one with :func:`static_loss_scale` (its Args and Raises).

  Examples:
    >>> import optax_accum
    >>> s = optax_accum.static_loss_scale(128.0)
    >>> s.initial_scale()
    128.0
    >>> scale, streak = s.adjust(jnp.float32(128.0), jnp.int32(0), jnp.bool_(False))
    >>> float(scale), int(streak)  # even after an overflow
    (128.0, 0)
  """

  value: float

  def __post_init__(self):
    value = _checks.real_number(self.value, "static_loss_scale: value", "the loss scale")
    _checks.require(
      "static_loss_scale",
      [(0 < value <= _FLOAT32_MAX, f"value must be > 0 and finite in float32, got {value}")],
    )
    object.__setattr__(self, "value", value)

  def initial_scale(self) -> float:
    """Returns ``value``, the scale of every window (a Python float)."""
    return float(self.value)

  def adjust(
    self, scale: jax.Array, streak: jax.Array, finite: jax.Array
  ) -> tuple[jax.Array, jax.Array]:
    """:meth:`DynamicLossScale.adjust` for a static scale: ``(scale, streak)`` unchanged."""
    del finite
    return scale, streak


@dataclasses.dataclass(frozen=True)
class DynamicLossScale(_Policy):
  """A dynamic loss scale; make one with :func:`dynamic_loss_scale` (its fields, ranges, Raises).

  Examples:
    >>> import optax_accum
    >>> s = optax_accum.dynamic_loss_scale(init_scale=8.0, growth_interval=2, min_scale=4.0)
    >>> s.initial_scale()
    8.0
    >>> scale, streak = jnp.float32(8.0), jnp.int32(0)
    >>> for finite in (True, True, False, False):  # grow after 2 applied windows, back off twice
    ...   scale, streak = s.adjust(scale, streak, jnp.bool_(finite))
    ...   print(float(scale), int(streak))
    8.0 1
    16.0 0
    8.0 0
    4.0 0
    >>> float(s.adjust(scale, streak, jnp.bool_(False))[0])  # floored at min_scale
    4.0
  """

  init_scale: float = 2.0**16
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2000
  min_scale: float = 1.0
  max_scale: float = 2.0**24

  def __post_init__(self):
    owner = "dynamic_loss_scale"
    names = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
    names += ("min_scale", "max_scale")
    v = {n: _checks.real_number(getattr(self, n), f"{owner}: {n}", "a setting") for n in names}
    finite = _FLOAT32_MAX  # the scale is stored in float32
    _checks.require(
      owner,
      [
        (0 < v["init_scale"] <= finite, "init_scale must be > 0 and finite in float32"),
        (1 < v["growth_factor"] < float("inf"), "growth_factor must be > 1 and finite"),
        (0 < v["backoff_factor"] < 1, "backoff_factor must be in (0, 1)"),
        (
          np.isfinite(v["growth_interval"])
          and int(v["growth_interval"]) == v["growth_interval"] >= 1,
          "growth_interval must be an integer >= 1",
        ),
        (
          v["growth_interval"] <= _checks.INT32_MAX,
          f"growth_interval must be <= 2**31 - 1 = {_checks.INT32_MAX} (the streak of applied "
          f"windows is an int32 counter), got {self.growth_interval}; use a smaller interval",
        ),
        (
          0 < v["min_scale"] <= v["max_scale"] <= finite,
          "need 0 < min_scale <= max_scale <= 3.4e38",
        ),
        (
          v["min_scale"] <= v["init_scale"] <= v["max_scale"],
          "init_scale must lie in [min_scale, max_scale]",
        ),
      ],
    )
    v["growth_interval"] = int(v["growth_interval"])
    for n, x in v.items():
      object.__setattr__(self, n, x)

  def initial_scale(self) -> float:
    """Returns ``init_scale``, the scale of the first window (a Python float)."""
    return float(self.init_scale)

  def adjust(
    self, scale: jax.Array, streak: jax.Array, finite: jax.Array
  ) -> tuple[jax.Array, jax.Array]:
    """``(new_scale, new_streak)`` at a non-empty window boundary (0-d float32, int32, bool in).

    Finite: the streak grows; at ``growth_interval`` the scale grows by ``growth_factor`` (capped
    at ``max_scale``). Not finite: it backs off by ``backoff_factor`` (floored at ``min_scale``).
    A change of scale restarts the streak.
    """
    dtype = scale.dtype
    grown_streak = streak + jnp.ones_like(streak)
    grow = grown_streak >= self.growth_interval
    grown = jnp.minimum(
      scale * jnp.asarray(self.growth_factor, dtype), jnp.asarray(self.max_scale, dtype)
    )
    backed = jnp.maximum(
      scale * jnp.asarray(self.backoff_factor, dtype), jnp.asarray(self.min_scale, dtype)
    )
    new_scale = jnp.where(finite, jnp.where(grow, grown, scale), backed)
    new_streak = jnp.where(finite & ~grow, grown_streak, jnp.zeros_like(streak))
    return new_scale, new_streak


LossScale = StaticLossScale | DynamicLossScale


class _NoLossScale:
  """No loss scale: no sub-state, a scale of 1, nothing to adjust."""

  def init(self) -> optax.EmptyState:
    return optax.EmptyState()

  def scale(self, state: Any) -> jax.Array:
    del state
    return jnp.ones((), jnp.float32)

  def close(self, state: Any, outcome: Outcome) -> Any:
    del outcome
    return state


NO_LOSS_SCALE = _NoLossScale()


def policy(loss_scale: object) -> LossScale | _NoLossScale:
  """``accumulate``'s ``loss_scale`` argument: one of the two policies, or None (no scale)."""
  if loss_scale is None:
    return NO_LOSS_SCALE
  if isinstance(loss_scale, (StaticLossScale, DynamicLossScale)):
    return loss_scale
  raise TypeError(
    "loss_scale must be None, optax_accum.static_loss_scale(...) or "
    f"optax_accum.dynamic_loss_scale(...), got {loss_scale!r}."
  )


def static_loss_scale(value: float) -> StaticLossScale:
  """A constant loss scale for :func:`optax_accum.accumulate`.

  Args:
    value: the factor (> 0, finite) the loss is multiplied by; the accumulated gradient is
      divided by it once, at the window boundary.

  Returns:
    A ``StaticLossScale`` to pass as ``accumulate(..., loss_scale=...)``.

  Raises:
    ValueError: if ``value`` is not a positive number finite in float32.
    TypeError: if ``value`` is not a number.

  Examples:
    >>> import optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), every_k=4,
    ...                             loss_scale=optax_accum.static_loss_scale(1024.0))
    >>> state = tx.init({'w': jax.numpy.zeros(3)})
    >>> float(optax_accum.metrics(state).loss_scale)
    1024.0
  """
  return StaticLossScale(value)


def dynamic_loss_scale(
  init_scale: float = 2.0**16,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 2000,
  min_scale: float = 1.0,
  max_scale: float = 2.0**24,
) -> DynamicLossScale:
  """A dynamic loss scale for :func:`optax_accum.accumulate` (fp16 training).

  PyTorch ``GradScaler``'s names and defaults, but the scale changes only at window boundaries:
  ``backoff_factor`` per skipped window, ``growth_factor`` after ``growth_interval`` applied
  *windows*, within ``[min_scale, max_scale]``. Empty windows change nothing.

  Args:
    init_scale: scale of the first window (float32 > 0; a power of two keeps
      scaling exact).
    growth_factor: > 1.
    backoff_factor: in (0, 1).
    growth_interval: applied windows between growths, an integer >= 1.
    min_scale: floor (> 0).
    max_scale: ceiling (>= min_scale, finite).

  Returns:
    A ``DynamicLossScale`` to pass as ``accumulate(..., loss_scale=...)``.

  Raises:
    ValueError: for a parameter outside the ranges above.
    TypeError: for a parameter that is not a number (a bool or string, say).

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, 2018; PyTorch, `gradient scaling
    <https://pytorch.org/docs/stable/amp.html#gradient-scaling>`_.

  Examples:
    >>> import optax, optax_accum
    >>> scale = optax_accum.dynamic_loss_scale(init_scale=2.0**10, growth_interval=100)
    >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4, loss_scale=scale)
    >>> state = tx.init({'w': jax.numpy.zeros(3)})
    >>> float(optax_accum.metrics(state).loss_scale)
    1024.0
  """
  return DynamicLossScale(
    init_scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale
  )


def in_force(loss_scale: Any) -> jax.Array | None:
  """The loss scale in force as a float32 scalar; a concrete one must be finite and > 0."""
  if loss_scale is None:
    return None
  if isinstance(loss_scale, (StaticLossScale, DynamicLossScale)):
    raise TypeError(
      "microbatched_value_and_grad takes the loss scale in force (a number), not a loss-scale "
      "policy: pass loss_scale=optax_accum.metrics(opt_state).loss_scale and give the policy "
      f"({type(loss_scale).__name__}) to accumulate(..., loss_scale=...)."
    )
  if not isinstance(loss_scale, jax.core.Tracer):
    if not 0 < float(np.asarray(loss_scale)) < float("inf"):
      raise ValueError(
        f"loss_scale must be a finite number > 0, got {loss_scale}. Pass None for no "
        "scaling, or optax_accum.metrics(opt_state).loss_scale."
      )
  return jnp.asarray(loss_scale, _numerics.scalar_dtype())
