"""Windows of a number of microbatches: ``every_k`` as an int or a schedule of ``num_updates``.

The simplest window policy (``_protocols.WindowPolicy``): no sub-state, no window sums; the
window closes at its ``k``-th microbatch, ``k`` fixed or ``every_k(num_updates)`` like
``optax.MultiSteps(every_k_schedule=...)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _checks
from optax_accum._protocols import Outcome, Position

PyTree = Any


@dataclasses.dataclass(frozen=True)
class CountWindow:
  """Windows of ``k`` microbatches; ``k`` an int or a callable of ``num_updates``.

  Attributes:
    k: an int >= 1, or a callable of ``num_updates`` (int32) returning an integer scalar
      (below 1 acts as 1).
  """

  k: int | Callable[[jax.Array], Any]

  @property
  def always_closes(self) -> bool:
    """Every microbatch closes its window (``every_k=1``): no window is ever kept open."""
    return self.k == 1

  def length(self, num_updates: jax.Array) -> jax.Array:
    """``k`` for the window after ``num_updates`` applied windows, int32."""
    if not callable(self.k):
      return jnp.asarray(self.k, jnp.int32)
    return schedule_value(self.k(num_updates))

  def init(self) -> PyTree:
    return optax.EmptyState()

  def init_window(self) -> PyTree:
    return optax.EmptyState()

  def add(self, window: PyTree, weight: jax.Array, grads: PyTree) -> PyTree:
    del weight, grads
    return window

  def closes(self, state: PyTree, window: PyTree, position: Position) -> jax.Array:
    del state, window
    return position.mini_step >= self.length(position.num_updates)

  def close(self, state: PyTree, window: PyTree, outcome: Outcome) -> PyTree:
    del window, outcome
    return state


def count_window(every_k: Any) -> CountWindow:
  """``every_k`` (an int or a schedule) as a :class:`CountWindow`, checked."""
  if callable(every_k):
    return CountWindow(every_k)
  return CountWindow(_checks.positive_int(every_k, "every_k", "microbatches per window"))


def schedule_value(k: Any) -> jax.Array:
  """An ``every_k`` schedule's value as int32, never wrapped.

  A concrete value above 2**31 - 1 raises; a traced one of a wider integer dtype saturates at
  2**31 - 1 (a window that does not close by count).
  """
  if not isinstance(k, jax.core.Tracer):
    arr = np.asarray(k)
    if arr.ndim == 0 and np.issubdtype(arr.dtype, np.integer) and int(arr) > _checks.INT32_MAX:
      raise ValueError(
        f"every_k schedule returned {int(arr)}, above the int32 limit 2**31 - 1 = "
        f"{_checks.INT32_MAX} of the window position. Return a smaller window length."
      )
  k = jnp.asarray(k)
  if k.ndim != 0 or not jnp.issubdtype(k.dtype, jnp.integer):
    raise TypeError(
      f"every_k schedule must return an integer scalar, got {k.dtype}{list(k.shape)}."
    )
  if jnp.iinfo(k.dtype).max > _checks.INT32_MAX:
    k = jnp.minimum(k, jnp.asarray(_checks.INT32_MAX, k.dtype))
  return k.astype(jnp.int32)
