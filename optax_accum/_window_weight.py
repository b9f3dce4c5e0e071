"""Token-budget windows: the budget, the boundary decision and the exact weight counters.

A window closes at the first microbatch whose cumulative weight reaches ``window_weight`` (a
number or a ramp); see docs/window_weight.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _checks, _numerics
from optax_accum import _weight_count as wc
from optax_accum._weight_count import WeightCount

PyTree = Any


_WEIGHT_OF = ("num_updates", "weight_seen")


def check_window_weight(every_k: Any, budget: Any, budget_of: Any) -> Budget | None:
  """Validates ``window_weight``/``window_weight_of``: a :class:`Budget`, or None without one."""
  if budget is None:
    if every_k is None:
      raise ValueError(
        "accumulate needs every_k (microbatches per window) or window_weight (the weight, "
        "e.g. tokens, per window), got neither. Pass e.g. every_k=4, or "
        "window_weight=2**20 to close each window at the first microbatch reaching 2**20 "
        "tokens."
      )
    if budget_of is not None:
      raise ValueError(
        f"window_weight_of={budget_of!r} is only meaningful with a callable window_weight "
        "(a ramp); got window_weight=None. Drop window_weight_of, or pass the ramp."
      )
    return None
  if callable(budget):
    if budget_of not in _WEIGHT_OF:
      raise ValueError(
        f"window_weight is a callable (a ramp), so window_weight_of must say what it is "
        f"called with: 'num_updates' (applied windows, int32) or 'weight_seen' (the weight "
        f"of the windows closed so far, a float); got {budget_of!r}."
      )
    return Budget(budget, budget_of)
  if budget_of is not None:
    raise ValueError(
      f"window_weight_of={budget_of!r} is only meaningful with a callable window_weight (a "
      f"ramp); got the number {budget!r}. Drop window_weight_of, or pass a callable."
    )
  return Budget(_budget_number(budget), None)


def _budget_number(budget: Any) -> float:
  """A fixed ``window_weight``: finite, > 0 and exactly representable in the weight-sum dtype."""
  _checks.real_number(budget, "window_weight", "the weight, e.g. tokens, per window")
  dtype = _numerics.scalar_dtype()
  value = float(budget)
  if not (np.isfinite(value) and value > 0):
    raise ValueError(
      f"window_weight must be finite and > 0 (the weight, e.g. tokens, at which a window "
      f"closes), got {budget}. Use every_k for windows of a fixed number of microbatches."
    )
  with np.errstate(over="ignore"):
    rounded = np.asarray(value, dtype)
  exact = bool(np.isfinite(rounded)) and (
    not isinstance(budget, (int, np.integer)) or int(rounded) == int(budget)
  )
  if not exact:
    limit = 2 ** (np.finfo(dtype).nmant + 1)
    raise ValueError(
      f"window_weight={budget} is not exactly representable in {dtype}, the dtype of the "
      f"window's weight sum (integers up to {limit} always are), so windows would close at "
      f"{float(rounded):.17g}. Pass a representable budget (e.g. a multiple of a power of "
      "two), or enable jax_enable_x64 for float64 sums."
    )
  return float(rounded)


def window_weight_value(value: Any) -> jax.Array:
  """A ramp's returned budget as a real scalar of the weight-sum dtype (may be traced)."""
  arr = jnp.asarray(value)
  if arr.ndim != 0 or not (
    jnp.issubdtype(arr.dtype, jnp.integer) or jnp.issubdtype(arr.dtype, jnp.floating)
  ):
    raise TypeError(
      f"the window_weight ramp must return a real scalar (the weight per window), got "
      f"{arr.dtype}{list(arr.shape)}."
    )
  return arr.astype(_numerics.scalar_dtype())


class Budget(NamedTuple):
  """A validated ``window_weight``: ``value`` (a float or a ramp) and ``of`` (a ramp's argument)."""

  value: float | Callable[[jax.Array], Any]
  of: str | None


def budget(config: Budget, num_updates: jax.Array, weight_seen: WeightCount) -> jax.Array:
  """The open window's budget, a scalar of ``_numerics.scalar_dtype()``.

  A ramp gets int32 ``num_updates`` or float ``weight_seen.approx()``, fixed while a window is open.
  """
  if not callable(config.value):
    return jnp.asarray(config.value, _numerics.scalar_dtype())
  arg = num_updates if config.of == "num_updates" else weight_seen.approx()
  return window_weight_value(config.value(arg))


def reached(
  config: Budget | None,
  window_sum: jax.Array,
  num_updates: jax.Array,
  weight_seen: WeightCount,
  axis_name: str | tuple[str, ...] | None,
) -> jax.Array | bool:
  """Whether the window, with this microbatch, reaches its budget: ``~(window_sum < budget)``.

  ``False`` without a budget. Under ``axis_name`` the sum is psum'd (one scalar all-reduce), so
  every device decides alike; a budget <= 0 or NaN closes every window at its first microbatch.
  """
  if config is None:
    return False
  if axis_name is not None:
    window_sum = jax.lax.psum(window_sum, axis_name)
  return ~(window_sum < budget(config, num_updates, weight_seen).astype(window_sum.dtype))


class TokenBudgetState(NamedTuple):
  """The token budget's sub-state of :class:`optax_accum.AccumulationState`.

  ``weight_seen``: exact ``WeightCount`` of every closed (not discarded) window since ``init``;
  ``window_weight``: that of the last closed non-empty window (0 until one closes).
  """

  weight_seen: WeightCount
  window_weight: WeightCount


def init_state() -> TokenBudgetState:
  """A fresh sub-state: both counts zero (fresh buffers each, for donation)."""
  return TokenBudgetState(wc.zeros(), wc.zeros())


def close(state: TokenBudgetState, parts: jax.Array, empty: jax.Array) -> TokenBudgetState:
  """The sub-state after a boundary: the (all-reduced) window ``parts`` counted exactly."""
  window = wc.count_parts(wc.zeros(), parts)
  keep = lambda new, old: jnp.where(empty, old, new)
  return TokenBudgetState(
    weight_seen=wc.count_parts(state.weight_seen, parts),
    window_weight=jax.tree.map(keep, window, state.window_weight),
  )


def sqrt_scaled_schedule(
  schedule: float | Callable[[jax.Array], Any],
  window_weight: float | Callable[[jax.Array], Any],
  reference_weight: float,
) -> Callable[[jax.Array], jax.Array]:
  """A learning rate scaled with the square root of the window's weight (Adam's rule).

  ``lr(count) = schedule(count) * sqrt(window_weight(count) / reference_weight)``. In
  :func:`optax_accum.accumulate` ``count`` is ``num_updates``: pass the ramp given with
  ``window_weight_of='num_updates'`` (rewrite a ``'weight_seen'`` ramp in ``num_updates``).

  Args:
    schedule: the learning rate at ``reference_weight`` tokens per update, a number or schedule.
    window_weight: the window's budget, a number or a callable of the count (positive).
    reference_weight: the window weight at which ``schedule`` applies unscaled (finite, > 0).

  Returns:
    A schedule (a callable of the step count) for any optax optimizer.

  Raises:
    TypeError, ValueError: for a ``reference_weight`` not finite and > 0, or a ``schedule`` or
      ``window_weight`` neither a number nor a callable.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> ramp = lambda n: jnp.where(n < 100, 1024, 4096)  # 4x the tokens after 100 updates
    >>> lr = optax_accum.sqrt_scaled_schedule(optax.constant_schedule(1e-3), ramp, 1024)
    >>> float(lr(0)), round(float(lr(100)), 6)  # sqrt(4) = 2
    (0.001, 0.002)
    >>> tx = optax_accum.accumulate(
    ...   optax.adam(lr), window_weight=ramp, window_weight_of='num_updates')

  References:
    allenai/OLMo-core, ``BatchSizeSchedulerCallback`` in
    ``src/olmo_core/train/callbacks/batch_size_scheduler.py``; Malladi et al. 2022, `On the SDEs
    and Scaling Rules for Adaptive Gradient Algorithms <https://arxiv.org/abs/2205.10287>`_, the
    square-root scaling rule for Adam.
  """
  for value, name in ((schedule, "schedule"), (window_weight, "window_weight")):
    if not callable(value):
      _checks.real_number(value, f"sqrt_scaled_schedule: {name}", "or a callable of the count")
  ref = _checks.real_number(reference_weight, "sqrt_scaled_schedule: reference_weight", "> 0")
  _checks.require(
    "sqrt_scaled_schedule",
    [(np.isfinite(ref) and ref > 0, f"reference_weight must be finite and > 0, got {ref}")],
  )

  def scaled(count: jax.Array) -> jax.Array:
    lr = schedule(count) if callable(schedule) else schedule
    weight = window_weight(count) if callable(window_weight) else window_weight
    lr, weight = jnp.asarray(lr), jnp.asarray(weight)
    dt = _numerics.promote_types(lr.dtype, jnp.float32)
    return lr.astype(dt) * jnp.sqrt(weight.astype(dt) / jnp.asarray(ref, dt))

  return scaled
