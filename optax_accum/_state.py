"""Finding :class:`AccumulationState` inside nested optimizer states.

The state is found by its class, never by a field name (``count``,
``inner_state`` and ``mini_step`` occur in other optax states too), through
``optax.chain``, ``optax.masked``, ``optax.multi_transform``,
``optax.inject_hyperparams`` and Flax's ``nnx.Optimizer.opt_state`` (whose
leaves are ``OptArray`` variables; they are unwrapped here without importing
flax).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_accum import pitfalls
from optax_accum._accumulate import WINDOW_FIELDS, AccumulationState

PyTree = Any


def _is_state(x: Any) -> bool:
  return isinstance(x, AccumulationState)


def _is_variable(x: Any) -> bool:
  """Whether ``x`` is a Flax ``nnx.Variable`` (e.g. ``OptArray``), by duck typing."""
  return not isinstance(x, jax.Array) and hasattr(x, "get_value") and hasattr(x, "replace")


def _unwrap(x: Any) -> Any:
  """The array inside a Flax ``nnx.Variable``, else ``x``."""
  return x.get_value() if _is_variable(x) else x


def find_states(tree: PyTree) -> list[AccumulationState]:
  """Every :class:`AccumulationState` inside ``tree``, in tree order, unwrapped."""
  found = [
    leaf for leaf in jax.tree.leaves(tree, is_leaf=_is_state) if isinstance(leaf, AccumulationState)
  ]
  return [jax.tree.map(_unwrap, s, is_leaf=_is_variable) for s in found]


def find_state(tree: PyTree) -> AccumulationState:
  """The one :class:`AccumulationState` inside a (nested) optimizer state.

  Raises:
    ValueError: if there is none, or more than one (pass the sub-state you mean).
  """
  found = find_states(tree)
  if len(found) != 1:
    what = "no" if not found else f"{len(found)}"
    raise ValueError(
      f"Found {what} optax_accum AccumulationState in the given optimizer state "
      f"({type(tree).__name__}); expected exactly one. Pass the state of a transformation "
      "that contains a single optax_accum.accumulate (or the sub-state you mean)."
    )
  return found[0]


def map_states(fn, opt_state: PyTree, other=None) -> PyTree:
  """Applies ``fn(state)`` to every AccumulationState; ``other(leaf)`` to other leaves."""

  def visit(x):
    if _is_state(x):
      return fn(x)
    return x if other is None else other(x)

  return jax.tree.map(visit, opt_state, is_leaf=_is_state)


def map_window(fn, state: AccumulationState, rest=None) -> AccumulationState:
  """Applies ``fn`` to the leaves of the open window's fields; ``rest`` to the others."""
  fields = {}
  for name, value in state._asdict().items():
    if name in WINDOW_FIELDS:
      fields[name] = jax.tree.map(fn, value)
    elif rest is not None:
      fields[name] = jax.tree.map(rest, value)
    else:
      fields[name] = value
  return AccumulationState(**fields)


class Metrics(NamedTuple):
  """What to log about accumulation; all fields are 0-d arrays.

  Attributes:
    mini_step: int32, microbatches in the current, open window.
    num_microbatches: int32, microbatches consumed since init (resume position).
    num_updates: int32, windows applied: the counter to drive anything done
      once per update (EMA, evaluation, checkpoints, logging).
    num_skipped: int32, windows skipped for a NaN or Inf.
    pending_weight: float, the weight (examples or tokens) in the open window.
    updated: bool, whether the last call applied an update.
    window_loss: float, weighted mean ``value`` of the last closed window (NaN
      when ``value`` was never passed).
    loss_scale: float32, the loss scale for the current window (1.0 unscaled).
    grad_norm: float, pre-clip global norm of the last closed window's mean
      gradient (NaN before the first window closes).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), every_k=2)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for loss, n in ((1.0, 3), (3.0, 1)):  # one window: losses 1 and 3, weights 3 and 1
    ...   _, state = tx.update({'w': jnp.ones(2)}, state, params, weight=n, value=loss)
    >>> m = optax_accum.metrics(state)
    >>> bool(m.updated), int(m.num_updates), int(m.mini_step), int(m.num_microbatches)
    (True, 1, 0, 2)
    >>> float(m.window_loss), round(float(m.grad_norm), 4)  # (3*1 + 1*3) / 4; |(1, 1)|
    (1.5, 1.4142)
  """

  mini_step: jax.Array
  num_microbatches: jax.Array
  num_updates: jax.Array
  num_skipped: jax.Array
  pending_weight: jax.Array
  updated: jax.Array
  window_loss: jax.Array
  loss_scale: jax.Array
  grad_norm: jax.Array


def metrics(opt_state: PyTree) -> Metrics:
  """Accumulation metrics from any optimizer state that contains one ``accumulate``.

  Args:
    opt_state: the state of :func:`optax_accum.accumulate`, of a chain or other
      wrapper containing it, or Flax's ``nnx.Optimizer.opt_state``.

  Returns:
    A :class:`Metrics` of 0-d arrays (works under ``jit``).

  Raises:
    ValueError: if ``opt_state`` holds no or several accumulation states.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax.chain(optax.clip(1.0), optax_accum.accumulate(optax.adam(1e-3), every_k=4))
    >>> params = {'w': jnp.zeros(3)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({'w': jnp.ones(3)}, state, params, weight=7)
    >>> m = optax_accum.metrics(state)
    >>> int(m.mini_step), int(m.num_updates), float(m.pending_weight)
    (1, 0, 7.0)
  """
  pitfalls.check_state(opt_state)
  s = find_state(opt_state)
  return Metrics(
    mini_step=s.mini_step,
    num_microbatches=s.num_microbatches,
    num_updates=s.num_updates,
    num_skipped=s.num_skipped,
    pending_weight=s.weight_sum,
    updated=s.updated,
    window_loss=s.window_loss,
    loss_scale=s.loss_scale,
    grad_norm=s.grad_norm,
  )


def get_loss_scale(opt_state: PyTree) -> jax.Array:
  """The factor to multiply the loss by for the current window.

  Args:
    opt_state: any optimizer state containing one :func:`optax_accum.accumulate`.

  Returns:
    A float32 0-d array: 1.0 without a loss scale. It changes only at window
    boundaries, so every microbatch of a window uses the same scale.

  Raises:
    ValueError: if ``opt_state`` holds no or several accumulation states.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1e-2), every_k=2)
    >>> float(optax_accum.get_loss_scale(tx.init({'w': jnp.zeros(2)})))
    1.0
  """
  return find_state(opt_state).loss_scale


def _zeros_like(tree: PyTree) -> PyTree:
  """Zeros like ``tree``; Flax variables stay variables (holding zeros)."""

  def zero(x):
    return x.replace(jnp.zeros_like(x.get_value())) if _is_variable(x) else jnp.zeros_like(x)

  return jax.tree.map(zero, tree, is_leaf=_is_variable)


def _reset_window(s: AccumulationState) -> AccumulationState:
  zeros = {name: _zeros_like(getattr(s, name)) for name in WINDOW_FIELDS}
  return s._replace(mini_step=_zeros_like(s.mini_step), **zeros)


def discard(opt_state: PyTree) -> PyTree:
  """Drops the open (partial) window: its gradients, weights and losses.

  Use it at the end of an epoch whose last window should not be applied (a
  changed data order, a bad shard). Nothing else changes: the inner state,
  counters and loss scale stay as they are; ``num_microbatches`` keeps counting
  what was consumed.

  Args:
    opt_state: any optimizer state containing :func:`optax_accum.accumulate`
      states (every one found is reset): a tree of arrays, or Flax's
      ``nnx.Optimizer.opt_state`` (assign the result back to it).

  Returns:
    A state of the same structure with the open window(s) emptied. It raises
    nothing: a state without an ``accumulate`` state is returned unchanged.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=4)
    >>> params = {'w': jnp.zeros(2)}
    >>> _, state = tx.update({'w': jnp.ones(2)}, tx.init(params), params)
    >>> state = optax_accum.discard(state)
    >>> int(optax_accum.metrics(state).mini_step), float(optax_accum.metrics(state).pending_weight)
    (0, 0.0)
  """
  return map_states(_reset_window, opt_state)
