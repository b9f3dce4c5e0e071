"""The accumulation state and every operation on it: find, map, metrics, discard, flush.

:class:`AccumulationState` is what :func:`optax_accum.accumulate` keeps between
calls. It is found inside nested optimizer states by its class, never by a
field name (``count``, ``inner_state`` and ``mini_step`` occur in other optax
states too), through ``optax.chain``, ``optax.masked``,
``optax.multi_transform``, ``optax.inject_hyperparams`` and Flax's
``nnx.Optimizer.opt_state`` (whose leaves are ``OptArray`` variables; they are
unwrapped here without importing flax). See docs/design.md for the module map.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import _buffers, _noise_scale, _numerics

PyTree = Any


class AccumulationState(NamedTuple):
  """State of :func:`accumulate`. Every field is an array; scalars are 0-d.

  The structure is the same in every configuration (with or without a loss
  scale, clipping or a schedule), so checkpoints stay compatible. Every float
  leaf is finite at all times (``jax_debug_nans`` / ``jax_debug_infs`` safe) as
  long as the gradients fed in are finite; "no value yet" is a boolean flag
  (``has_window_loss``, ``has_grad_norm``), never NaN.

  Attributes:
    mini_step: int32, microbatches accumulated in the current window (the
      window position; 0 right after a boundary).
    acc: the accumulator, a tree like the params in the accumulator dtype
      (float32 by default). While a window is open (``mini_step > 0``) it
      holds the weighted gradient sum ``sum_i w_i * g_i`` (with a loss scale
      the ``g_i`` are gradients of the *scaled* loss). After a boundary of
      ``tx.update`` it holds that boundary's updates (scratch, finite: the
      buffer returned them, so no separate zero-update buffer is written per
      microstep), and the next microbatch reads it as zeros. Read the open
      window's sum with :attr:`window_sum`.
    weight_sum: float32 (float64 under x64), ``sum_i w_i`` of the window.
    value_sum: weighted sum ``sum_i w_i * value_i`` of the ``value`` extra
      args (the microbatch losses) passed in this window.
    value_weight: the weight sum of the microbatches that passed ``value``.
    num_microbatches: int32, microbatches consumed since ``init`` (flushes are
      not counted): the data position to resume from.
    num_updates: int32, windows applied (the inner optimizer ran).
    num_skipped: int32, windows skipped because their mean was not finite.
    updated: bool, whether the last call applied an update.
    window_loss: the weighted mean ``value`` of the last closed window whose
      mean ``value`` was finite (0.0 until then; see ``has_window_loss``).
    has_window_loss: bool, whether ``window_loss`` holds a value: False until a
      window with a finite mean ``value`` closes, and after a window whose
      mean ``value`` was NaN or Inf (``window_loss`` then keeps the last finite
      one).
    grad_norm: global L2 norm of the last closed window's unscaled mean
      gradient, before clipping, if that norm was finite; else the last finite
      one (0.0 until a window closes; see ``has_grad_norm``).
    has_grad_norm: bool, whether ``grad_norm`` is the norm of the last closed
      (non-empty) window: False before the first window closes and after a
      window whose mean was not finite (a skipped window).
    loss_scale: float32, the scale to multiply the loss by in the current
      window (1.0 without a loss scale).
    growth_streak: int32, consecutive applied windows since the scale last
      changed (dynamic loss scale only; 0 otherwise).
    every_k: int32 fingerprint of the configuration: the window length, -1
      when ``every_k`` is a schedule, 0 when it is None (windows closed by
      ``window_weight`` alone). Checked on every concrete call.
    loss_scale_kind: int32 fingerprint of the loss-scale configuration: 0 for
      none, 1 for :func:`optax_accum.static_loss_scale` (whose value must then
      equal ``loss_scale``), 2 for :func:`optax_accum.dynamic_loss_scale`.
      Checked on every concrete call and by ``check_compatible``.
    noise_sq_sum: float (the weight-sum dtype), ``sum_i w_i |g_i|^2`` of the
      window's microbatches (scaled gradients with a loss scale): the gradient
      noise scale's one per-microbatch sum. 0 when ``noise_scale_decay`` is None.
    noise_samples: float (the weight-sum dtype, to share the boundary's one
      all-reduce), the window's microbatches with a nonzero weight (the noise
      scale's samples ``K``; 0 when ``noise_scale_decay`` is None).
    noise_trace_ema: float, the EMA numerator of ``S_est`` (the estimate of
      ``tr(Sigma)``, McCandlish et al. 2018); 0 until a window with ``K >= 2``
      closes, and always 0 when ``noise_scale_decay`` is None.
    noise_signal_ema: float, the EMA numerator of ``G2_est`` (the estimate of
      ``|G|^2``); as ``noise_trace_ema``.
    noise_ema_weight: float, the EMAs' bias-correction weight ``1 - decay**t``
      after ``t`` windows that counted: 0 means "no estimate yet".
    weight_seen: a ``WeightCount`` (uint32 ``high`` and ``low`` words and a
      float ``frac``: ``high * 2**32 + low + frac``), the exact total weight of
      every window closed since ``init`` (applied, skipped or flushed; global
      under ``axis_name``). Fixed while a window is open: the data position at
      the last boundary (add ``weight_sum`` for the open window's). A
      discarded window is not counted. Exact for whole weights in windows of
      any size (docs/window_weight.md).
    window_weight: a ``WeightCount``, the weight of the last closed non-empty
      window (0 until one closes).
    window_weight_parts: float32 (float64 under x64) ``[7]``, the open
      window's weight, exact: its fraction and six 12-bit parts of its whole
      part (this device's share under ``axis_name``, all-reduced with the other
      sums at the boundary, exactly for up to 4096 devices), from which the
      boundary adds the window's weight to ``weight_seen``.
    inner_state: the inner optimizer's state; changes only on applied windows.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), every_k=4)
    >>> params = {'w': jnp.zeros(3)}
    >>> state = tx.init(params)
    >>> state.acc['w'].dtype, int(state.every_k), float(state.loss_scale)
    (dtype('float32'), 4, 1.0)
    >>> _, state = tx.update({'w': jnp.ones(3)}, state, params, weight=2)
    >>> int(state.mini_step), float(state.weight_sum), state.acc['w']  # acc = 2 * g
    (1, 2.0, Array([2., 2., 2.], dtype=float32))
  """

  mini_step: jax.Array
  acc: PyTree
  weight_sum: jax.Array
  value_sum: jax.Array
  value_weight: jax.Array
  num_microbatches: jax.Array
  num_updates: jax.Array
  num_skipped: jax.Array
  updated: jax.Array
  window_loss: jax.Array
  has_window_loss: jax.Array
  grad_norm: jax.Array
  has_grad_norm: jax.Array
  loss_scale: jax.Array
  growth_streak: jax.Array
  every_k: jax.Array
  loss_scale_kind: jax.Array
  noise_sq_sum: jax.Array
  noise_samples: jax.Array
  noise_trace_ema: jax.Array
  noise_signal_ema: jax.Array
  noise_ema_weight: jax.Array
  weight_seen: Any  # a _window_weight.WeightCount (a NamedTuple of three 0-d arrays)
  window_weight: Any  # a _window_weight.WeightCount
  window_weight_parts: jax.Array
  inner_state: PyTree

  @property
  def window_sum(self) -> PyTree:
    """The open window's weighted gradient sum: ``acc``, or zeros if ``mini_step == 0``.

    A tree like ``acc`` (same dtypes); works under ``jit``.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=1)
      >>> params = {'w': jnp.zeros(2)}
      >>> _, state = tx.update({'w': jnp.ones(2)}, tx.init(params), params)
      >>> state.window_sum['w']  # the window closed: nothing is pending
      Array([0., 0.], dtype=float32)
    """
    return _buffers.open_window(self.acc, self.mini_step)


# The fields that hold the open window (one device's share of it under shard_map):
# reset at every boundary, emptied by `discard`, stacked per device by `stack_windows`.
WINDOW_FIELDS = (
  "acc",
  "weight_sum",
  "value_sum",
  "value_weight",
  "window_weight_parts",
  *_noise_scale.WINDOW,
)


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


def flush(
  tx: optax.GradientTransformation, state: PyTree, params: PyTree, **extra_args: Any
) -> tuple[PyTree, PyTree]:
  """Closes the current (possibly incomplete) window without a new gradient.

  The window mean divides by the weight accumulated so far (e.g. by 2 for the
  last two examples of an epoch, not by ``every_k``). The flush is not counted
  as a microbatch. Flushing an empty window is a no-op: zero updates, inner
  state unchanged, nothing counted.

  Args:
    tx: :func:`optax_accum.accumulate`'s transformation, or any transformation
      containing it (an ``optax.chain``, say); other members see an all-zero
      gradient.
    state: the optimizer state of ``tx``.
    params: the current params (a tree of arrays); zero gradients of their
      shapes and dtypes are fed through ``tx``.
    **extra_args: forwarded to ``tx.update`` (and so to the inner optimizer).
      The inner optimizer's ``value`` is the weighted mean of the ``value`` args
      passed with the window's microbatches; a ``value`` passed here is
      ignored (the flush carries no microbatch).

  Returns:
    ``(updates, new_state)``, exactly like ``tx.update``: apply the updates
    with ``optax.apply_updates``.

  Raises:
    ValueError: if ``state`` holds no :class:`AccumulationState` (flushing a
      plain optimizer would run a real step on zero gradients), or several,
      or if ``state`` is not a state of ``tx`` for these ``params`` (its tree,
      shapes or dtypes differ from ``tx.init(params)``'s).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=4)
    >>> params = {'w': jnp.zeros(())}
    >>> state = tx.init(params)
    >>> for y in (9.0, 10.0):  # two microbatches of a 4-window, gradients -y
    ...   _, state = tx.update({'w': jnp.asarray(-y)}, state, params)
    >>> updates, state = optax_accum.flush(tx, state, params)
    >>> updates['w']  # the mean of the two, not divided by 4
    Array(9.5, dtype=float32)
  """
  _belongs(tx, state, params)
  return flush_with(tx.update, state, params, extra_args)


def _belongs(tx: optax.GradientTransformation, state: PyTree, params: PyTree) -> None:
  """Raises unless ``state`` has the tree, shapes and dtypes of ``tx.init(params)``.

  The check of :func:`flush`'s arguments. It lives here, not in ``_checks``,
  because ``_checks`` imports this module (docs/design.md: imports point down).
  """
  if not find_states(state):
    return  # flush_with says what is missing
  expected = jax.eval_shape(tx.init, params)
  leaves = lambda t: [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(t)]
  same = jax.tree.structure(expected) == jax.tree.structure(state)
  if not same or leaves(expected) != leaves(state):
    raise ValueError(
      "flush(tx, state, params): state is not a state of tx for these params (its tree, "
      "shapes or dtypes differ from tx.init(params)). Pass the transformation that "
      "produced state (the same optax.chain and inner optimizer) and the params it was "
      "initialized with."
    )


def flush_with(
  update: Any, state: PyTree, params: PyTree, extra_args: dict[str, Any]
) -> tuple[PyTree, PyTree]:
  """:func:`flush` through ``update(grads, state, params, **kwargs) -> (out, state)``.

  ``update`` is ``tx.update``, or the fused entry point (``out`` then is the new
  params). The flush is a zero-weight microbatch that closes the window
  (``weight=0, flush=True``), passes the window's mean loss as ``value`` (a
  zero-weight value adds nothing to the window's loss), and afterwards puts
  ``num_microbatches`` back: it consumed no data.
  """
  s = find_state(state) if find_states(state) else None
  if s is None:
    raise ValueError(
      f"flush needs the state of optax_accum.accumulate (or of a chain containing it), got "
      f"a {type(state).__name__} without one: flushing a plain optimizer would run a real "
      "step on zero gradients."
    )
  extra_args = {k: v for k, v in extra_args.items() if k != "value"}
  value = _numerics.guarded_divide(s.value_sum, s.value_weight)
  grads = optax.tree.zeros_like(params)
  out, new_state = update(grads, state, params, weight=0, flush=True, value=value, **extra_args)
  position = s.num_microbatches
  return out, map_states(lambda n: n._replace(num_microbatches=position), new_state)
