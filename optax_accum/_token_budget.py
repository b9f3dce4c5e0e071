"""Token-budget windows: a window policy that closes each window when its weight reaches a budget.

``optax_accum.token_budget(N)`` (a number or a ramp) closes each window at the first microbatch
whose cumulative weight reaches ``N``; the weight is counted exactly (``_weight_count``). The
square-root learning-rate rule for ramps is its ``sqrt_scaled_schedule``. docs/token_budget.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _checks, _numerics
from optax_accum import _weight_count as wc
from optax_accum._protocols import Outcome, Position
from optax_accum._weight_count import WeightCount

PyTree = Any


_OF = ("num_updates", "weight_seen")


class TokenBudgetState(NamedTuple):
  """The token budget's sub-state of :class:`optax_accum.AccumulationState`.

  Attributes:
    weight_seen: exact ``WeightCount`` of every closed (not discarded) window since ``init``.
    window_weight: that of the last closed non-empty window (0 until one closes).
  """

  weight_seen: WeightCount
  window_weight: WeightCount

  def metrics(self) -> dict[str, Any]:
    """What :func:`optax_accum.metrics` shows: ``weight_seen`` and ``window_weight``."""
    return {"weight_seen": self.weight_seen, "window_weight": self.window_weight}


@dataclasses.dataclass(frozen=True)
class TokenBudget:
  """A window policy that closes each window when its weight reaches a budget.

  Made by :func:`optax_accum.token_budget` (its Args); the window's weight is kept in exact
  parts (``_weight_count``) that ride in the boundary's all-reduce.
  """

  weight: float | Callable[[jax.Array], Any]
  of: str | None
  max_microbatches: int | None

  def init(self) -> TokenBudgetState:
    """A fresh sub-state: both counts zero (fresh buffers each, for donation)."""
    return TokenBudgetState(wc.zeros(), wc.zeros())

  def init_window(self) -> jax.Array:
    """The open window's weight in exact 12-bit parts (float ``[7]``)."""
    return wc.zero_parts()

  def add(self, window: jax.Array, weight: jax.Array, grads: PyTree) -> jax.Array:
    del grads
    return wc.add_parts(window, weight)

  def budget(self, num_updates: jax.Array, weight_seen: WeightCount) -> jax.Array:
    """The open window's budget, a scalar of ``_numerics.scalar_dtype()``.

    A ramp gets int32 ``num_updates`` or float ``weight_seen.approx()``, fixed while a window
    is open.
    """
    if not callable(self.weight):
      return jnp.asarray(self.weight, _numerics.scalar_dtype())
    arg = num_updates if self.of == "num_updates" else weight_seen.approx()
    return _ramp_value(self.weight(arg))

  def closes(self, state: TokenBudgetState, window: jax.Array, position: Position) -> jax.Array:
    """The window reaches its budget with this microbatch: ``~(weight_sum < budget)``.

    Under ``axis_name`` the weight sum is psum'd (one scalar all-reduce per microstep), so every
    device decides alike; a budget <= 0 or NaN closes every window at its first microbatch.
    """
    del window
    budget = self.budget(position.num_updates, state.weight_seen)
    return reaches(position, budget, self.max_microbatches)

  def close(self, state: TokenBudgetState, window: jax.Array, outcome: Outcome) -> TokenBudgetState:
    """The (all-reduced) ``window``'s parts counted exactly; an empty window keeps the last one."""
    closed = wc.count_parts(wc.zeros(), window)
    keep = lambda new, old: jnp.where(outcome.empty, old, new)
    return TokenBudgetState(
      weight_seen=wc.count_parts(state.weight_seen, window),
      window_weight=jax.tree.map(keep, closed, state.window_weight),
    )

  def sqrt_scaled_schedule(
    self, schedule: float | Callable[[jax.Array], Any], reference_weight: float
  ) -> Callable[[jax.Array], jax.Array]:
    """A learning rate scaled with the square root of this budget (Adam's rule).

    ``lr(count) = schedule(count) * sqrt(budget(count) / reference_weight)``; inside
    ``accumulate`` the inner optimizer's ``count`` is ``num_updates``, so the budget must be a
    number or a ramp of ``'num_updates'`` (rewrite a ``'weight_seen'`` ramp in ``num_updates``).

    Args:
      schedule: the learning rate at ``reference_weight`` tokens per update, a number or
        schedule.
      reference_weight: the window weight at which ``schedule`` applies unscaled (finite, > 0).

    Returns:
      A schedule (a callable of the step count) for any optax optimizer.

    Raises:
      ValueError: for a ``'weight_seen'`` ramp, or a ``reference_weight`` not finite and > 0.
      TypeError: for a ``schedule`` neither a number nor a callable.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> ramp = lambda n: jnp.where(n < 100, 1024, 4096)  # 4x the tokens after 100 updates
      >>> budget = optax_accum.token_budget(ramp, of='num_updates')
      >>> lr = budget.sqrt_scaled_schedule(optax.constant_schedule(1e-3), 1024)
      >>> float(lr(0)), round(float(lr(100)), 6)  # sqrt(4) = 2
      (0.001, 0.002)
      >>> tx = optax_accum.accumulate(optax.adam(lr), every_k=budget)

    References:
      allenai/OLMo-core, ``BatchSizeSchedulerCallback`` in
      ``src/olmo_core/train/callbacks/batch_size_scheduler.py``; Malladi et al. 2022, `On the
      SDEs and Scaling Rules for Adaptive Gradient Algorithms
      <https://arxiv.org/abs/2205.10287>`_, the square-root scaling rule for Adam.
    """
    if self.of == "weight_seen":
      raise ValueError(
        "sqrt_scaled_schedule needs the budget as a function of the optimizer's step count "
        "(num_updates), but this ramp is of 'weight_seen'. Rewrite the ramp in num_updates: "
        "token_budget(ramp, of='num_updates')."
      )
    return sqrt_scaled_schedule(schedule, self.weight, reference_weight)


def reaches(position: Position, budget: jax.Array, max_microbatches: int | None) -> jax.Array:
  """Whether the open window's weight reaches ``budget`` with this microbatch (or it holds
  ``max_microbatches``): ``~(weight_sum < budget)``, a boolean scalar.

  Under ``axis_name`` the weight sum is psum'd first (one scalar all-reduce per microstep), so
  every device decides alike. Window policies that close on a budget (``token_budget``,
  ``adaptive_window``) decide here.
  """
  total = position.weight_sum
  if position.axis_name is not None:
    total = jax.lax.psum(total, position.axis_name)
  reached = ~(total < jnp.asarray(budget).astype(total.dtype))
  if max_microbatches is None:
    return reached
  return reached | (position.mini_step >= max_microbatches)


def token_budget(
  weight: float | Callable[[jax.Array], Any],
  *,
  of: str | None = None,
  max_microbatches: int | None = None,
) -> TokenBudget:
  """Windows counted in tokens: each closes at the first microbatch whose weight reaches ``weight``.

  A window policy for ``accumulate(inner, every_k=token_budget(...))``: the window mean divides
  by the weight actually accumulated (the last microbatch's overshoot is kept). Under
  ``axis_name`` the budget is global (one scalar ``psum`` per microstep). ``metrics(state)``
  counts ``weight_seen`` (every closed window's weight, exact past 2**31 without x64) and
  ``window_weight`` (the last update's). docs/token_budget.md.

  Args:
    weight: the window's budget of weight (tokens, examples): a number (finite, > 0, exact in
      the float32 weight sum: integers up to 2**24 always are) or a ramp, a callable of what
      ``of`` names returning the budget (0, a negative value or NaN closes the window at its
      first microbatch).
    of: for a ramp (required then, refused otherwise): ``'num_updates'`` (applied windows,
      int32) or ``'weight_seen'`` (the weight of the windows closed so far, a float).
    max_microbatches: also close a window at this many microbatches (an int >= 1); None: no cap.

  Returns:
    A ``TokenBudget``; its ``sqrt_scaled_schedule`` scales a learning rate with it.

  Raises:
    TypeError, ValueError: naming the bad argument and what to pass.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=optax_accum.token_budget(8))
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for n in (3, 3, 3):  # tokens per microbatch: the third reaches 8
    ...   u, state = tx.update({'w': jnp.ones(2)}, state, params, weight=n)
    >>> int(optax_accum.metrics(state).num_updates), int(optax_accum.metrics(state).window_weight)
    (1, 9)

  References:
    torchtitan's ``num_tokens_per_train_step``; Composer's ``accumulate_train_batch_on_tokens``.
  """
  if max_microbatches is not None:
    max_microbatches = _checks.positive_int(
      max_microbatches, "token_budget: max_microbatches", "microbatches per window"
    )
  if callable(weight):
    if of not in _OF:
      raise ValueError(
        f"token_budget: weight is a callable (a ramp), so of= must say what it is called "
        f"with: 'num_updates' (applied windows, int32) or 'weight_seen' (the weight of the "
        f"windows closed so far, a float); got of={of!r}."
      )
    return TokenBudget(weight, of, max_microbatches)
  if of is not None:
    raise ValueError(
      f"token_budget: of={of!r} is only meaningful with a callable weight (a ramp); got the "
      f"number {weight!r}. Drop of=, or pass a callable."
    )
  return TokenBudget(budget_number(weight), None, max_microbatches)


def budget_number(budget: Any, name: str = "token_budget: weight") -> float:
  """A fixed budget: finite, > 0 and exactly representable in the weight-sum dtype; errors
  name ``name`` (``'owner: argument'``)."""
  _checks.real_number(budget, name, "the weight, e.g. tokens, per window")
  dtype = _numerics.scalar_dtype()
  value = float(budget)
  if not (np.isfinite(value) and value > 0):
    raise ValueError(
      f"{name} must be finite and > 0 (the weight, e.g. tokens, at which a window closes), "
      f"got {budget}. Use every_k=k for windows of k microbatches."
    )
  with np.errstate(over="ignore"):
    rounded = np.asarray(value, dtype)
  exact = bool(np.isfinite(rounded)) and (
    not isinstance(budget, (int, np.integer)) or int(rounded) == int(budget)
  )
  if not exact:
    limit = 2 ** (np.finfo(dtype).nmant + 1)
    raise ValueError(
      f"{name}={budget} is not exactly representable in {dtype}, the dtype of "
      f"the window's weight sum (integers up to {limit} always are), so windows would close "
      f"at {float(rounded):.17g}. Pass a representable budget (e.g. a multiple of a power of "
      "two), or enable jax_enable_x64 for float64 sums."
    )
  return float(rounded)


def _ramp_value(value: Any) -> jax.Array:
  """A ramp's returned budget as a real scalar of the weight-sum dtype (may be traced)."""
  arr = jnp.asarray(value)
  if arr.ndim != 0 or not (
    jnp.issubdtype(arr.dtype, jnp.integer) or jnp.issubdtype(arr.dtype, jnp.floating)
  ):
    raise TypeError(
      f"the token_budget ramp must return a real scalar (the weight per window), got "
      f"{arr.dtype}{list(arr.shape)}."
    )
  return arr.astype(_numerics.scalar_dtype())


def sqrt_scaled_schedule(
  schedule: float | Callable[[jax.Array], Any],
  window_weight: float | Callable[[jax.Array], Any],
  reference_weight: float,
) -> Callable[[jax.Array], jax.Array]:
  """``lr(count) = schedule(count) * sqrt(window_weight(count) / reference_weight)``.

  The rule of :meth:`TokenBudget.sqrt_scaled_schedule` (its Args, Raises and example), for a
  budget given as a number or a callable of the count.
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
