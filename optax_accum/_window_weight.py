"""Token-budget windows: the budget, the boundary decision and the exact weight counters.

A window may close at the first microbatch whose cumulative weight reaches
``window_weight``, a number or a ramp; docs/window_weight.md says how, and
docs/design.md lists this module's parts.
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
  """Validates ``accumulate``'s ``window_weight`` and ``window_weight_of``.

  Returns:
    A :class:`Budget`: a float budget with ``of=None``, or a callable ramp with
    ``of`` in ``('num_updates', 'weight_seen')``; None without a budget.

  Raises:
    TypeError, ValueError: naming the argument, the limit and what to do.
  """
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
  """A validated ``window_weight`` configuration (it lives in ``accumulate``'s closure).

  Attributes:
    value: the budget, a float (a fixed budget) or a callable (a ramp).
    of: for a ramp, ``'num_updates'`` or ``'weight_seen'``: what it is called with.
  """

  value: float | Callable[[jax.Array], Any]
  of: str | None


def budget(config: Budget, num_updates: jax.Array, weight_seen: WeightCount) -> jax.Array:
  """The open window's budget, a scalar of ``_numerics.scalar_dtype()``.

  A ramp of ``'num_updates'`` is called with the int32 applied-window count; a
  ramp of ``'weight_seen'`` with the weight of every window closed so far, as a
  float array (:meth:`WeightCount.approx`: rounded above 2**24 in float32, a
  relative 6e-8, which a schedule does not notice). Both stay fixed while the
  window is open.
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
  """Whether the open window, with this call's microbatch added, reaches its budget.

  ``~(window_sum < budget)``: the first microbatch whose cumulative weight
  reaches the budget closes the window, keeping its overshoot; a budget of 0,
  a negative one or NaN closes every window at its first microbatch.

  Args:
    config: the budget, or None (never: ``False``, nothing computed).
    window_sum: the window's weight sum including this microbatch (this
      device's under ``axis_name``).
    num_updates: the state's applied-window count.
    weight_seen: the state's weight of the closed windows.
    axis_name: ``accumulate``'s ``axis_name``: the window's weight is global,
      so it is summed over the devices here, the one scalar all-reduce per
      microstep that a budget costs (every device then decides alike).

  Returns:
    A boolean scalar, or ``False`` without a budget.
  """
  if config is None:
    return False
  if axis_name is not None:
    window_sum = jax.lax.psum(window_sum, axis_name)
  return ~(window_sum < budget(config, num_updates, weight_seen).astype(window_sum.dtype))


class TokenBudgetState(NamedTuple):
  """The token budget's sub-state of :class:`optax_accum.AccumulationState`.

  Attributes:
    weight_seen: a ``WeightCount`` (uint32 ``high`` and ``low`` words and a
      float ``frac``), the exact weight of every window closed since ``init``
      (applied, skipped or flushed; global under ``axis_name``). Fixed while
      a window is open; a discarded window is not counted.
    window_weight: a ``WeightCount``, the weight of the last closed non-empty
      window (0 until one closes).
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

  ``lr(count) = schedule(count) * sqrt(window_weight(count) / reference_weight)``:
  when a ramp doubles the tokens per update, Adam's learning rate grows by
  ``sqrt(2)``, as OLMo's batch-size scheduler does. Inside
  :func:`optax_accum.accumulate` the inner optimizer's ``count`` is
  ``num_updates`` (applied windows), so pass the same ramp that was given to
  ``accumulate(..., window_weight=ramp, window_weight_of='num_updates')``. For a
  ramp of ``'weight_seen'``, express it as a function of ``num_updates`` here
  (the tokens per update are the budget it returns), or set the learning rate
  with ``optax.inject_hyperparams`` from ``metrics(state).window_weight``.

  Args:
    schedule: the base learning rate, a number or any optax schedule (a
      callable of the step count): the rate at ``reference_weight`` tokens per
      update.
    window_weight: the window's budget, a number or a callable of the step
      count returning a positive number.
    reference_weight: the window weight at which ``schedule`` applies unscaled;
      a finite number > 0.

  Returns:
    A schedule (a callable of the step count) for any optax optimizer.

  Raises:
    TypeError, ValueError: for a ``reference_weight`` that is not a finite
      number > 0, or a ``schedule`` or ``window_weight`` that is neither a
      number nor a callable.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> ramp = lambda n: jnp.where(n < 100, 1024, 4096)  # 4x the tokens after 100 updates
    >>> lr = optax_accum.sqrt_scaled_schedule(optax.constant_schedule(1e-3), ramp, 1024)
    >>> float(lr(0)), round(float(lr(100)), 6)  # sqrt(4) = 2
    (0.001, 0.002)
    >>> tx = optax_accum.accumulate(
    ...   optax.adam(lr), window_weight=ramp, window_weight_of='num_updates')

  References:
    allenai/OLMo-core, ``src/olmo_core/train/callbacks/batch_size_scheduler.py``
    (``BatchSizeSchedulerCallback``: Adam's base learning rate times
    ``sqrt(new batch size / old batch size)``); Malladi et al., `On the SDEs and
    Scaling Rules for Adaptive Gradient Algorithms <https://arxiv.org/abs/2205.10287>`_
    (2022), the square-root scaling rule for Adam.
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
