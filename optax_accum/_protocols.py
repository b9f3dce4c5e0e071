"""The small protocols through which the microstep reaches every feature.

``accumulate``'s core step (``_step``) imports no feature module: each feature is an object
built by its own factory (``token_budget``, ``spike_rule``, ``noise_scale``, ``aggregate``, the
loss scales), owns its sub-state (``optax.EmptyState()`` when it has none) and is reached
through one of these protocols. A user writes their own window policy, guard or observer by
implementing the methods below; docs/protocols.md walks through one of each.

The boundary tells every feature what happened through one :class:`Outcome`; a guard and a
predicate judge a closing window from its :class:`WindowStats`. A sub-state that defines a
``metrics()`` method (returning a dict of 0-d arrays) is read by :func:`optax_accum.metrics`:
its keys fill the fields of that name, and an observer's dict is in ``metrics(...).observers``.
A window policy or observer that defines ``check_aggregation(weighted_mean: bool)`` is asked
when ``accumulate`` is made (and by ``init``, for per-leaf rules of the params) and raises
where what it measures needs the window to be the weighted mean (the noise scale's estimators).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax

PyTree = Any


class WindowStats(NamedTuple):
  """What a guard sees of a closing window (0-d arrays, global under ``axis_name``).

  Attributes:
    grad_norm: float32, the global L2 norm of the unscaled window mean, before the inner
      optimizer (and any clip inside it).
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


class Outcome(NamedTuple):
  """What the boundary tells each feature's ``close`` about the window that just closed.

  Attributes:
    stats: the window's :class:`WindowStats`.
    applied: bool, the inner optimizer ran and its update was applied.
    finite: bool, the window (and, with a 16-bit dtype, the inner update) was finite.
    empty: bool, the window's weight sum was 0 (nothing is counted for it).
    spike: bool, a guard skipped this finite window.
    loss_scale: float32, the loss scale the window's gradients were taken at (1.0 without).
  """

  stats: WindowStats
  applied: jax.Array
  finite: jax.Array
  empty: jax.Array
  spike: jax.Array
  loss_scale: jax.Array


class Position(NamedTuple):
  """Where the open window stands after this microbatch was added (what a policy decides on).

  Attributes:
    mini_step: int32, the microbatches in the window, this one included.
    weight_sum: float32, this device's window weight, this microbatch included (a policy
      that needs the global weight all-reduces it over ``axis_name`` itself).
    num_updates: int32, windows applied before this one.
    axis_name: the ``shard_map`` axis name(s) of ``accumulate``, or None.
  """

  mini_step: jax.Array
  weight_sum: jax.Array
  num_updates: jax.Array
  axis_name: Any


@runtime_checkable
class WindowPolicy(Protocol):
  """Decides where windows close (``accumulate(inner, every_k=policy)``).

  An ``int`` ``every_k`` and a schedule of ``num_updates`` are policies too; so is
  :func:`optax_accum.token_budget`. Every method is called at trace time; arrays are 0-d.

  """

  def init(self) -> PyTree:
    """The policy's sub-state (``optax.EmptyState()`` if it keeps none)."""

  def init_window(self) -> PyTree:
    """Per-window sums it adds each microbatch (``EmptyState()`` if none); floating arrays,
    summed over the devices (``psum``) with the window at the boundary."""

  def add(self, window: PyTree, weight: jax.Array, grads: PyTree) -> PyTree:
    """The window sums with a microbatch of ``weight`` added; ``grads`` is its gradient as
    ``tx.update`` got it (loss-scaled), as an observer's ``add`` sees it.
    """

  def closes(self, state: PyTree, window: PyTree, position: Position) -> jax.Array:
    """Whether this microbatch closes the window (a boolean scalar, equal on every device)."""

  def close(self, state: PyTree, window: PyTree, outcome: Outcome) -> PyTree:
    """The sub-state after the window closed (``window``: its sums over the devices)."""


@runtime_checkable
class Guard(Protocol):
  """A stateful judge of closing windows (``accumulate(..., skip_if=guard)``).

  A plain callable of :class:`WindowStats` (a predicate) and an ``optax.MultiSteps``
  ``should_skip_update_fn`` are accepted too; :func:`optax_accum.spike_rule` is a guard.
  """

  def init(self) -> PyTree:
    """The guard's sub-state."""

  def judge(self, state: PyTree, stats: WindowStats) -> jax.Array:
    """True to skip this finite window (a boolean scalar)."""

  def close(self, state: PyTree, outcome: Outcome) -> PyTree:
    """The sub-state after the window."""


@runtime_checkable
class Observer(Protocol):
  """Measures something of each window without changing it (``accumulate(..., observe=...)``).

  :func:`optax_accum.noise_scale` is an observer.
  """

  def init(self) -> PyTree:
    """The observer's sub-state (``metrics`` reads it)."""

  def init_window(self, params: PyTree) -> PyTree:
    """Per-window sums (floating arrays, summed over the devices at the boundary)."""

  def add(self, window: PyTree, weight: jax.Array, grads: PyTree) -> PyTree:
    """The window sums with one microbatch's (loss-scaled) gradient of ``weight`` added (the
    window policy's argument order)."""

  def close(self, state: PyTree, window: PyTree, outcome: Outcome) -> PyTree:
    """The sub-state after the window closed (``window``: its sums over the devices)."""
