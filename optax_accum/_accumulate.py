"""``accumulate``: weighted gradient accumulation as an Optax transformation.

The life of a window (see DESIGN.md): each call adds ``weight * grads`` to a
float32 (or wider) accumulator and ``weight`` to the weight sum. Between
boundaries the emitted updates are exact zeros and the inner optimizer is not
run. At the boundary the window mean ``sum_i w_i g_i / (sum_i w_i * scale)`` is
computed once, checked for finiteness once, optionally clipped, and handed to
the inner optimizer once; then the accumulator is reset with zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import _checks, _numerics, _window, pitfalls
from optax_accum._loss_scale import LossScale

PyTree = Any

# Extra arg set only by `flush`: this call closes the window but carries no microbatch.
_NO_MICROBATCH = "_optax_accum_no_microbatch"
# Extra arg set only by `optax_accum.update_and_apply`: return the new params
# (params + updates) instead of the updates, so that no update buffer is written.
_APPLY_TO_PARAMS = "_optax_accum_apply_to_params"


class AccumulationState(NamedTuple):
  """State of :func:`accumulate`. Every field is an array; scalars are 0-d.

  The structure is the same in every configuration (with or without a loss
  scale, clipping or a schedule), so checkpoints stay compatible.

  Attributes:
    mini_step: int32, microbatches accumulated in the current window (the
      window position; 0 right after a boundary).
    acc: the weighted gradient sum ``sum_i w_i * g_i`` of the current window,
      a tree like the params in the accumulator dtype (float32 by default).
      With a loss scale the ``g_i`` are gradients of the *scaled* loss.
    weight_sum: float32 (float64 under x64), ``sum_i w_i`` of the window.
    value_sum: weighted sum ``sum_i w_i * value_i`` of the ``value`` extra
      args (the microbatch losses) passed in this window.
    value_weight: the weight sum of the microbatches that passed ``value``.
    num_microbatches: int32, microbatches consumed since ``init`` (flushes are
      not counted): the data position to resume from.
    num_updates: int32, windows applied (the inner optimizer ran).
    num_skipped: int32, windows skipped because their mean was not finite.
    updated: bool, whether the last call applied an update.
    window_loss: the weighted mean ``value`` of the last closed window (NaN
      until a window with ``value`` closes).
    grad_norm: global L2 norm of the last closed window's unscaled mean
      gradient, before clipping (NaN until a window closes; inf or NaN for a
      skipped window).
    loss_scale: float32, the scale to multiply the loss by in the current
      window (1.0 without a loss scale).
    growth_streak: int32, consecutive applied windows since the scale last
      changed (dynamic loss scale only; 0 otherwise).
    every_k: int32 fingerprint of the configuration: the window length, or -1
      when ``every_k`` is a schedule. Checked on every concrete call.
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
  grad_norm: jax.Array
  loss_scale: jax.Array
  growth_streak: jax.Array
  every_k: jax.Array
  inner_state: PyTree


# The fields that hold the open window (one device's share of it under shard_map):
# reset at every boundary, emptied by `discard`, stacked per device by `stack_windows`.
WINDOW_FIELDS = ("acc", "weight_sum", "value_sum", "value_weight")


def accumulate(
  inner: optax.GradientTransformation,
  every_k: int | Callable[[jax.Array], Any],
  *,
  accumulator_dtype: Any = None,
  loss_scale: LossScale | None = None,
  clip_norm: float | None = None,
  skip_nonfinite: bool = True,
  axis_name: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates weighted microbatch gradients and runs ``inner`` once per window.

  ``update(grads, state, params=None, *, weight=1, flush=False, **extra_args)``:

  ============================  ================================================
  every call (microstep)        ``acc += weight * grads`` (in ``acc``'s dtype);
                                ``weight_sum += weight``; emit exact zeros
  boundary (``every_k`` calls   ``mean = acc / (weight_sum * loss_scale)``, one
  or ``flush=True``)            finite check, global norm, clip to
                                ``clip_norm``, ``inner.update(mean, ...)`` once,
                                reset ``acc`` and ``weight_sum`` with zeros
  non-finite window             zeros emitted, inner state untouched,
                                ``num_skipped += 1``, loss scale backs off
  empty window (weight sum 0)   zeros emitted, nothing counted
  ============================  ================================================

  Args:
    inner: the inner optimizer (any ``optax.GradientTransformation``). Its
      updates, schedules, weight decay and step counts advance only on applied
      windows. Extra args reach it on the boundary call.
    every_k: microbatches per window, an int >= 1, or a callable of
      ``num_updates`` (applied windows; int32 array) returning an integer
      scalar, like ``optax.MultiSteps(every_k_schedule=...)``; a value below 1
      acts as 1 (every call closes a window).
    accumulator_dtype: dtype of the accumulator. ``None`` (default) uses
      ``jnp.promote_types(grad.dtype, jnp.float32)`` per leaf: float32 for
      bf16/fp16/float32 gradients, float64 under ``jax_enable_x64``, complex
      kept complex.
    loss_scale: ``None`` (no scaling), :func:`optax_accum.static_loss_scale` or
      :func:`optax_accum.dynamic_loss_scale`. The grads passed in are then
      gradients of ``loss * get_loss_scale(state)``.
    clip_norm: if set, the window's unscaled mean gradient is clipped to this
      global L2 norm (``optax.clip_by_global_norm``) before ``inner``.
    skip_nonfinite: skip windows whose mean has a NaN or Inf (default True).
    axis_name: a ``shard_map``/``pmap`` axis name. Each device accumulates its
      own sums with no communication; at the boundary one ``psum`` of the sums
      precedes the single division, so windows are weighted by the global token
      count and every replica applies the same update.

  Update args:
    grads: gradient of this microbatch's *mean* loss, a tree like the params.
    weight: number of examples or unmasked tokens that mean is over; a
      non-negative scalar (Python number or array, may be traced). A traced
      negative weight is not checked: it subtracts that microbatch.
    flush: bool (may be traced); close the window after this microbatch even if
      it holds fewer than ``every_k`` microbatches.
    value: optional microbatch loss; the inner optimizer receives the window's
      weighted mean as ``value`` (for ``optax.contrib.reduce_on_plateau``).
    **extra_args: forwarded to ``inner.update`` on the boundary call.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`AccumulationState`. Updates have the params' dtypes (the grads'
    dtypes when ``params`` is None), and so does the window mean handed to
    ``inner``: float32 master params with bf16/fp16 gradients get the float32
    mean, not a mean rounded back to 16 bits (which would undo the loss
    scale's protection against underflow). A mean that is finite in the
    accumulator but overflows in that dtype counts as non-finite.

  Raises:
    TypeError, ValueError: at construction for a bad ``every_k`` or
      ``clip_norm``; at trace time for a non-scalar, boolean or concrete
      negative weight, and for grads whose tree, shapes or dtypes do not match
      the state or params.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> u, state = tx.update({'w': jnp.array([1., 1.])}, state, params, weight=3)
    >>> u['w']  # between boundaries: exact zeros
    Array([0., 0.], dtype=float32)
    >>> u, state = tx.update({'w': jnp.array([5., 5.])}, state, params, weight=1)
    >>> u['w']  # -(3 * 1 + 1 * 5) / 4
    Array([-2., -2.], dtype=float32)

  References:
    Hugging Face, `Fixing gradient accumulation
    <https://huggingface.co/blog/gradient_accumulation>`_ (2024), on weighting by
    token counts; ``optax.MultiSteps`` for the transformation's shape.
  """
  every_k = _checks.options(inner, every_k, clip_norm, skip_nonfinite, loss_scale)
  every_k_fp = -1 if callable(every_k) else every_k
  if accumulator_dtype is not None:
    accumulator_dtype = jnp.dtype(accumulator_dtype)
  inner = optax.with_extra_args_support(inner)
  initial_scale = 1.0 if loss_scale is None else loss_scale.initial_scale()

  def window_length(num_updates: jax.Array) -> jax.Array:
    if callable(every_k):
      k = jnp.asarray(every_k(num_updates))
      if k.ndim != 0 or not jnp.issubdtype(k.dtype, jnp.integer):
        raise TypeError(
          f"every_k schedule must return an integer scalar, got {k.dtype}{list(k.shape)}."
        )
      return k.astype(jnp.int32)
    return jnp.asarray(every_k, jnp.int32)

  def init_fn(params: PyTree) -> AccumulationState:
    fdt = _numerics.scalar_dtype()
    acc = jax.tree.map(
      lambda p: _numerics.zeros_like_placed(
        p, _numerics.accumulator_dtype(p.dtype, accumulator_dtype)
      ),
      params,
    )

    # A fresh buffer per field: donating a state whose leaves share a buffer
    # fails ("Attempt to donate the same buffer twice").
    def zero_i():
      return jnp.zeros((), jnp.int32)

    return AccumulationState(
      mini_step=zero_i(),
      acc=acc,
      weight_sum=jnp.zeros((), fdt),
      value_sum=jnp.zeros((), fdt),
      value_weight=jnp.zeros((), fdt),
      num_microbatches=zero_i(),
      num_updates=zero_i(),
      num_skipped=zero_i(),
      updated=jnp.zeros((), jnp.bool_),
      window_loss=jnp.full((), jnp.nan, fdt),
      grad_norm=jnp.full((), jnp.nan, fdt),
      loss_scale=jnp.asarray(initial_scale, jnp.float32),
      growth_streak=zero_i(),
      every_k=jnp.asarray(every_k_fp, jnp.int32),
      inner_state=pitfalls.check_inner_state(inner.init(params)),
    )

  def update_fn(grads, state, params=None, *, weight=1, flush=False, **extra_args):
    if not isinstance(state, AccumulationState):
      raise TypeError(
        f"accumulate's update needs its AccumulationState, got {type(state).__name__}. "
        "Pass the state returned by tx.init / tx.update."
      )
    _checks.fingerprint(state.every_k, every_k_fp)
    _checks.trees(grads, state.acc, params, accumulator_dtype)
    no_microbatch = bool(extra_args.pop(_NO_MICROBATCH, False))
    apply_to_params = bool(extra_args.pop(_APPLY_TO_PARAMS, False))
    if apply_to_params and params is None:
      raise ValueError("update_and_apply needs the params.")
    value = extra_args.pop("value", None)
    w = _numerics.check_weight(weight)
    flush = jnp.asarray(flush)
    if flush.ndim != 0 or flush.dtype != jnp.bool_:
      raise TypeError(f"flush must be a boolean scalar, got {flush.dtype}{list(flush.shape)}.")

    acc = _numerics.weighted_add(state.acc, grads, w)
    weight_sum = state.weight_sum + w
    value_sum, value_weight = state.value_sum, state.value_weight
    if value is not None:
      v = jnp.asarray(value)
      if v.ndim != 0:
        raise ValueError(f"value must be the scalar loss of the microbatch, got shape {v.shape}.")
      value_sum = _numerics.weighted_add(value_sum, v, w)
      value_weight = value_weight + w
    step = jnp.zeros((), jnp.int32) if no_microbatch else jnp.ones((), jnp.int32)
    mini_step = state.mini_step + step
    num_microbatches = _numerics.saturating_increment(state.num_microbatches, not no_microbatch)
    boundary = (mini_step >= window_length(state.num_updates)) | flush

    out_like = grads if params is None else params

    # Control flow, chosen by reading the compiled HLO (docs/performance.md):
    # `acc` is summed outside the cond (one fused, in-place pass over the
    # donated buffer); `between` passes it and the inner state through
    # untouched, so XLA keeps them in their buffers and writes only the zero
    # updates; `close` reads the sums, runs the inner optimizer once, and only
    # then writes zeros into the accumulator (`ordered_zeros`), so it reuses the
    # same buffer instead of copying it.
    def between(operands):
      acc, inner_state = operands
      new_state = state._replace(
        mini_step=mini_step,
        acc=acc,
        weight_sum=weight_sum,
        value_sum=value_sum,
        value_weight=value_weight,
        num_microbatches=num_microbatches,
        # Constants are built from the state's own fields: zeros_like keeps their
        # device variance, so both cond branches agree under shard_map(check_vma=True).
        updated=jnp.zeros_like(state.updated),
        inner_state=inner_state,
      )
      if apply_to_params:  # passed through: stays in its (donated) buffer
        return params, new_state
      return _numerics.ordered_zeros(out_like, boundary), new_state

    def close(operands):
      acc, inner_state = operands
      sums = (acc, weight_sum, value_sum, value_weight)
      if axis_name is not None:
        sums = jax.lax.psum(sums, axis_name)
      g_sum, w_sum, v_sum, v_weight = sums
      denom = w_sum * state.loss_scale.astype(w_sum.dtype)
      norm, finite = _window.norm_and_finite(g_sum, denom)
      # The mean goes to the inner optimizer in the params' dtypes: it must fit there too.
      finite = finite & _window.fits(g_sum, denom, norm, clip_norm, out_like)
      empty = w_sum == 0
      apply = ~empty & (finite | (not skip_nonfinite))
      skipped = ~empty & ~finite & skip_nonfinite
      window_value = _numerics.guarded_divide(v_sum, v_weight)
      window_value = jnp.where(v_weight > 0, window_value, jnp.nan)
      inner_args = dict(extra_args)
      if value is not None or no_microbatch:
        # A flush carries no microbatch loss: the inner still gets the window's mean.
        inner_args["value"] = window_value

      def run_inner(ops):
        g_sum, inner_state = ops
        # Divided here, inside the branch, so XLA fuses the division into the
        # inner optimizer's first pass instead of materializing the mean. Cast
        # like the params (the grads without params): float32 master params keep
        # the float32 window mean of bf16/fp16 gradients.
        mean = _window.mean(g_sum, denom, norm, clip_norm, out_like)
        updates, inner_state = inner.update(mean, inner_state, params, **inner_args)
        updates = optax.tree.cast_like(updates, out_like)
        if apply_to_params:  # fused into the inner optimizer's last pass
          return optax.apply_updates(params, updates), inner_state
        return updates, inner_state

      def keep_inner(ops):
        _, inner_state = ops
        if apply_to_params:
          return params, inner_state
        return _numerics.ordered_zeros(out_like, apply), inner_state

      updates, inner_state = jax.lax.cond(apply, run_inner, keep_inner, (g_sum, inner_state))
      new_scale, new_streak = state.loss_scale, state.growth_streak
      if loss_scale is not None:
        adj_scale, adj_streak = loss_scale.adjust(state.loss_scale, state.growth_streak, finite)
        new_scale = jnp.where(empty, new_scale, adj_scale)
        new_streak = jnp.where(empty, new_streak, adj_streak)
      # zeros_like keeps weight_sum's device variance (shard_map with check_vma=True),
      # so both cond branches return the same type.
      zero_f = jnp.zeros_like(weight_sum)
      new_state = AccumulationState(
        mini_step=jnp.zeros_like(state.mini_step),
        # Zeros written after the inner update has read the sums: same buffer.
        # (The token reads one element of the smallest output, e.g. Adam's count.)
        acc=_numerics.ordered_zeros(acc, _numerics.read_token((inner_state, updates))),
        weight_sum=zero_f,
        value_sum=zero_f,
        value_weight=zero_f,
        num_microbatches=num_microbatches,
        num_updates=_numerics.saturating_increment(state.num_updates, apply),
        num_skipped=_numerics.saturating_increment(state.num_skipped, skipped),
        updated=apply,
        window_loss=jnp.where(v_weight > 0, window_value, state.window_loss),
        grad_norm=jnp.where(empty, state.grad_norm, norm.astype(state.grad_norm.dtype)),
        loss_scale=new_scale,
        growth_streak=new_streak,
        every_k=state.every_k,
        inner_state=inner_state,
      )
      return updates, new_state

    return jax.lax.cond(boundary, close, between, (acc, state.inner_state))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def flush(
  tx: optax.GradientTransformation, state: PyTree, params: PyTree, **extra_args: Any
) -> tuple[PyTree, PyTree]:
  """Closes the current (possibly incomplete) window without a new gradient.

  The window mean divides by the weight accumulated so far (e.g. by 2 for the
  last two examples of an epoch, not by ``every_k``). The flush is not counted
  as a microbatch. Flushing an empty window is a no-op: zero updates, inner
  state unchanged, nothing counted.

  Args:
    tx: :func:`accumulate`'s transformation, or any transformation containing
      it (an ``optax.chain``, say); other members see an all-zero gradient.
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
      plain optimizer would run a real step on zero gradients).

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
  is_state = lambda x: isinstance(x, AccumulationState)
  if not any(is_state(x) for x in jax.tree.leaves(state, is_leaf=is_state)):
    raise ValueError(
      f"flush needs the state of optax_accum.accumulate (or of a chain containing it), got "
      f"a {type(state).__name__} without one: flushing a plain optimizer would run a real "
      "step on zero gradients."
    )
  grads = optax.tree.zeros_like(params)
  return tx.update(
    grads, state, params, weight=0, flush=True, **{_NO_MICROBATCH: True}, **extra_args
  )
