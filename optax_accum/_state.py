"""The accumulation state: a core window state and one sub-state per feature object.

:class:`AccumulationState` is what :func:`optax_accum.accumulate` keeps between
calls: the open :class:`Window` (reset at every boundary) and one sub-state per feature (the
window policy, the observers, the guards, the loss scale, the aggregation), ``optax.EmptyState()``
when it keeps none. It is found inside nested optimizer states
(``optax.chain``, ``optax.masked``, ``inject_hyperparams``, ``nnx.Optimizer.opt_state``)
by its class, never by a field name (``count`` or ``mini_step`` occur in other states).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any


class Window(NamedTuple):
  """The open window's sums: what a boundary reduces (one ``psum``) and resets; per device.

  Attributes:
    grad_sum: the accumulator, a tree like the params in the accumulator dtype (float32 by
      default): ``sum_i w_i * g_i`` (of the scaled loss under a loss scale) while
      ``mini_step > 0``; scratch read as zeros while the window is empty (no zero buffer
      is written per microstep). Read it with :attr:`AccumulationState.window_sum`.
      ``EmptyState()`` with ``every_k=1``: no window outlives its call, so none is kept.
    weight_sum: float32 (float64 under x64), ``sum_i w_i``.
    value_sum: ``sum_i w_i * value_i`` of the ``value`` extra args passed.
    value_weight: the weight sum of the microbatches that passed ``value``.
    policy: the window policy's per-window sums (a token budget: the weight in exact 12-bit
      parts, float ``[7]``), ``EmptyState()`` for ``every_k``.
    observers: one tuple entry per observer (the noise scale: ``(sum_i w_i |g_i|^2,
      samples)``).
  """

  grad_sum: PyTree
  weight_sum: jax.Array
  value_sum: jax.Array
  value_weight: jax.Array
  policy: Any
  observers: tuple[Any, ...]


class AccumulationState(NamedTuple):
  """State of :func:`optax_accum.accumulate`. Every leaf is an array; scalars are 0-d.

  Every float leaf is finite at all times (``jax_debug_nans`` safe) while the
  gradients fed in are finite; "no value yet" is a boolean flag, never NaN.

  Attributes:
    mini_step: int32, microbatches in the open window (0 right after a boundary).
    window: the open window's sums, a ``Window``: ``grad_sum`` (the accumulator; read it with
      :attr:`window_sum`), ``weight_sum``, ``value_sum``, ``value_weight``, and the window
      policy's and observers' per-window sums (``policy``, ``observers``).
    num_microbatches: int32, microbatches consumed since ``init`` (not flushes).
    num_updates: int32, windows applied (the inner optimizer ran).
    num_skipped: int32, windows skipped because their mean was not finite.
    updated: bool, whether the last call applied an update.
    window_loss: the last finite weighted mean ``value`` of a closed window (0.0 until then).
    has_window_loss: bool, whether ``window_loss`` is the last closed window's.
    grad_norm: the global L2 norm of the last finite unscaled window mean, before clipping.
    has_grad_norm: bool, whether ``grad_norm`` is the last closed (non-empty) window's.
    flush_pending: bool, set by :func:`optax_accum.flush` for the one call that closes the
      window (it reaches ``accumulate`` through any wrapper); False in every returned state.
    loss_scale: ``LossScaleState`` with ``loss_scale=``, else ``EmptyState()``.
    policy: the window policy's sub-state (``TokenBudgetState`` for a token budget;
      ``EmptyState()`` for ``every_k``).
    observers: one sub-state per observer of ``observe=`` (``NoiseScaleState``), a tuple.
    guard: ``GuardState`` with ``skip_if=``, else ``EmptyState()``.
    inner_state: the inner optimizer's state; changes only on applied windows.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), every_k=4)
    >>> params = {'w': jnp.zeros(3)}
    >>> state = tx.init(params)
    >>> state.window.grad_sum['w'].dtype, int(state.mini_step), state.loss_scale
    (dtype('float32'), 0, EmptyState())
    >>> _, state = tx.update({'w': jnp.ones(3)}, state, params, weight=2)
    >>> int(state.mini_step), float(state.window.weight_sum), state.window_sum['w']
    (1, 2.0, Array([2., 2., 2.], dtype=float32))
  """

  mini_step: jax.Array
  window: Window
  num_microbatches: jax.Array
  num_updates: jax.Array
  num_skipped: jax.Array
  updated: jax.Array
  window_loss: jax.Array
  has_window_loss: jax.Array
  grad_norm: jax.Array
  has_grad_norm: jax.Array
  flush_pending: jax.Array
  loss_scale: Any
  policy: Any
  observers: tuple[Any, ...]
  guard: Any
  inner_state: PyTree

  @property
  def window_sum(self) -> PyTree:
    """The open window's weighted gradient sum (``grad_sum``, or zeros if the window is empty).

    A tree like ``window.grad_sum`` (same dtypes); works under ``jit``. ``EmptyState()`` with
    ``every_k=1``, which keeps no window between calls.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
      >>> params = {'w': jnp.zeros(2)}
      >>> _, state = tx.update({'w': jnp.ones(2)}, tx.init(params), params, weight=3)
      >>> state.window_sum['w']  # 3 * (1, 1) pending
      Array([3., 3.], dtype=float32)
      >>> _, state = tx.update({'w': jnp.ones(2)}, state, params)
      >>> state.window_sum['w']  # the window closed: nothing is pending
      Array([0., 0.], dtype=float32)
    """
    empty = self.mini_step == 0
    zero = lambda a: jnp.where(empty, jnp.zeros((), a.dtype), a)
    return jax.tree.map(zero, self.window.grad_sum)

  @property
  def sub_states(self) -> dict[str, Any]:
    """The feature sub-states by field name (what :func:`optax_accum.metrics` reads)."""
    return {f: getattr(self, f) for f in FEATURE_FIELDS}


# The feature sub-states' fields, each with the accumulate argument that configures it.
ARGUMENTS = {"loss_scale": "loss_scale=", "policy": "every_k=", "observers": "observe=",
             "guard": "skip_if="}  # fmt: skip
FEATURE_FIELDS = tuple(ARGUMENTS)


def shown_by_argument(sub_states: dict[str, Any]) -> dict[str, Any]:
  """The sub-states whose ``metrics()`` :func:`optax_accum.metrics` shows as flat fields, by
  the argument that configured each (``'every_k='``, ``'skip_if='``, ``'observe[0]'``, ...)."""
  shown = {ARGUMENTS[f]: sub_states[f] for f in ("policy", "guard")}
  shown.update({f"observe[{i}]": o for i, o in enumerate(sub_states["observers"])})
  return shown


def _is_state(x: Any) -> bool:
  return isinstance(x, AccumulationState)


def is_variable(x: Any) -> bool:
  """Whether ``x`` is a Flax ``nnx.Variable`` (e.g. ``OptArray``), by its public methods."""
  # `get_value` exists since Flax 0.12.1; `raw_value` before it.
  readable = hasattr(x, "get_value") or hasattr(x, "raw_value")
  return not isinstance(x, jax.Array) and readable and hasattr(x, "replace")


def unwrap(x: Any) -> Any:
  """The array inside a Flax ``nnx.Variable``, else ``x``."""
  if not is_variable(x):
    return x
  return x.get_value() if hasattr(x, "get_value") else x.value


def find_states(tree: PyTree) -> list[AccumulationState]:
  """Every :class:`AccumulationState` inside ``tree``, in tree order, unwrapped."""
  found = [x for x in jax.tree.leaves(tree, is_leaf=_is_state) if _is_state(x)]
  return [jax.tree.map(unwrap, s, is_leaf=is_variable) for s in found]


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


def map_states(fn, opt_state: PyTree) -> PyTree:
  """Applies ``fn(state)`` to every :class:`AccumulationState` in ``opt_state``."""
  return jax.tree.map(lambda x: fn(x) if _is_state(x) else x, opt_state, is_leaf=_is_state)


def map_per_device(fn, state: AccumulationState) -> AccumulationState:
  """Applies ``fn`` to every per-device leaf: the open window's sums (``state.window``) and,
  under ``shard_optimizer=True``, the inner state's shards (``Shards``)."""
  state = state._replace(window=jax.tree.map(fn, state.window))
  if isinstance(state.inner_state, Shards):
    state = state._replace(inner_state=jax.tree.map(fn, state.inner_state))
  return state


class Shards(NamedTuple):
  """The inner optimizer's state under ``accumulate(..., shard_optimizer=True)`` (ZeRO-1).

  Per device, like the window: each non-scalar leaf of the inner state is this device's ``1/n``
  (the leaf flattened and zero-padded to a multiple of ``n``, shape ``[ceil(size / n)]``), each
  scalar leaf (a step count) whole. ``sharding.stack_windows`` and ``window_specs`` lay it out
  on a leading device axis like the window.

  Attributes:
    inner: the inner optimizer's state, its leaves as shards.
  """

  inner: PyTree


def raise_on_problems(problems: list[str], what: str) -> None:
  """Raises one ``ValueError`` listing ``problems`` (if any) and what to do."""
  if problems:
    raise ValueError(
      f"{what} was made by another accumulate configuration: "
      + "; ".join(problems)
      + ". Restore into an accumulate() with the same configuration, or, to continue with "
      "this one (another window policy, guards or observers), close the window with the old "
      "one (optax_accum.flush) and move the state: optax_accum.sharding.migrate_state(tx, "
      "params, state) keeps the inner optimizer's state and the counters."
    )
