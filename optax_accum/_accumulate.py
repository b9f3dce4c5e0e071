"""``accumulate``: weighted gradient accumulation as an Optax transformation.

The life of a window, as :func:`_step` below runs it (docs/design.md has the
module map and the invariants): each call adds ``weight * grads`` to a float32
(or wider) accumulator and ``weight`` to the weight sum. Between boundaries the
emitted updates are exact zeros and the inner optimizer is not run. At the
boundary (``_boundary.close``) the window mean ``sum_i w_i g_i / (sum_i w_i * scale)``
is computed once, checked for finiteness once, optionally clipped, and handed
to the inner optimizer once; then the window's scalars are reset to zero. The
accumulator is reset lazily: ``tx.update`` writes the boundary's updates into
its buffer and returns them from there, and the next microbatch reads it as
zeros (``mini_step == 0``), so no microstep writes a buffer of zero updates
(``_buffers.stash``; the fused path resets it with zeros).

Besides optax's ``update``, each transformation has one explicit second entry
point, the fused step that returns the new params instead of the updates.
:func:`fused_update` finds it from the transformation's ``update`` function (a
module-level registry keyed by that function); :func:`optax_accum.update_and_apply`
calls it when its ``tx`` is ``accumulate``'s own transformation. Nothing
travels through ``extra_args``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import (
  _boundary,
  _buffers,
  _checks,
  _noise_scale,
  _numerics,
  _vma,
  _window_weight,
  pitfalls,
)
from optax_accum._loss_scale import LossScale, StaticLossScale
from optax_accum._state import AccumulationState

PyTree = Any


def accumulate(
  inner: optax.GradientTransformation,
  every_k: int | Callable[[jax.Array], Any] | None = None,
  *,
  window_weight: float | Callable[[jax.Array], Any] | None = None,
  window_weight_of: str | None = None,
  accumulator_dtype: Any = None,
  loss_scale: LossScale | None = None,
  clip_norm: float | None = None,
  skip_nonfinite: bool = True,
  axis_name: str | tuple[str, ...] | None = None,
  noise_scale_decay: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates weighted microbatch gradients and runs ``inner`` once per window.

  ``update(grads, state, params=None, *, weight=1, flush=False, **extra_args)``:

  ============================  ================================================
  every call (microstep)        ``acc += weight * grads`` (in ``acc``'s dtype);
                                ``weight_sum += weight``; emit exact zeros
  boundary (``every_k`` calls,  ``mean = acc / (weight_sum * loss_scale)``, one
  ``weight_sum`` reaching       finite check, global norm, clip to
  ``window_weight``, or         ``clip_norm``, ``inner.update(mean, ...)`` once;
  ``flush=True``)               the window is empty again (``mini_step == 0``)
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
      acts as 1 (every call closes a window). None: no count limit (then
      ``window_weight`` is required). With ``window_weight`` too, it caps the
      microbatches per window: whichever comes first closes it.
    window_weight: the window's budget of weight (tokens, examples): the window
      closes at the first microbatch whose cumulative weight reaches it, and
      the mean divides by the weight actually accumulated (the overshoot is
      kept, not split). A number (finite, > 0, exact in the weight-sum dtype),
      or a ramp: a callable returning the budget (a real scalar; 0, a negative
      value or NaN closes at the first microbatch), called with what
      ``window_weight_of`` names. Under ``axis_name`` the budget is global:
      the window's weight sum is all-reduced every microstep (one scalar
      ``psum``, the only communication between boundaries). See
      docs/window_weight.md.
    window_weight_of: for a callable ``window_weight`` (required then, refused
      otherwise): ``'num_updates'`` (applied windows, int32) or
      ``'weight_seen'`` (the weight of every window closed so far, a float
      array; ``metrics(state).weight_seen``). Both stay fixed while a window is
      open. :func:`optax_accum.sqrt_scaled_schedule` scales the learning rate
      with a ramp of ``'num_updates'``.
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
    noise_scale_decay: ``None`` (default: off, nothing computed) or the decay in
      [0, 1) of an EMA over windows of the gradient noise scale ``B_simple``
      (McCandlish et al. 2018, appendix A), estimated from the window's own
      microbatches: one scalar ``weight * |g|^2`` per microbatch, the rest at the
      boundary. Read it with :func:`optax_accum.metrics` (``noise_scale``,
      ``noise_trace``, ``noise_signal``), in the units of ``weight``. Windows
      with fewer than 2 nonzero-weight microbatches, skipped and empty windows
      leave it unchanged; under ``axis_name`` each device's microbatches are
      samples. docs/noise_scale.md.

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
    :class:`AccumulationState`. Apply its updates with ``optax.apply_updates``,
    or call :func:`optax_accum.update_and_apply` with it, which writes no update
    buffer at all (the fastest train step). The window mean is handed to
    ``inner`` in the wider of the gradients' and the params' dtypes (float32
    master params with bf16/fp16 gradients get the float32 mean; fp16 params
    with float32 gradients do not run Adam in fp16), and the updates have the
    dtypes plain ``inner`` returns for the same gradients (optax's
    ``test_multi_steps_mixed_precision`` rule). A mean that is finite in the
    accumulator but overflows in that dtype counts as non-finite, and so,
    where a 16-bit dtype is involved, do non-finite inner updates. Every float
    leaf of the state stays finite while the gradients are.

  Raises:
    TypeError, ValueError: at construction for a bad ``every_k`` (or one above
      2**31 - 1), neither ``every_k`` nor ``window_weight``, a bad
      ``window_weight`` or ``window_weight_of``, ``clip_norm``, ``axis_name``,
      ``noise_scale_decay`` (not in [0, 1)) or ``accumulator_dtype`` (a 64-bit
      one without x64); at trace time for a non-scalar, boolean, concrete
      negative or unrepresentable weight, for grads whose tree, shapes or
      dtypes do not match the state or params, for device-varying params under
      ``axis_name``, and for a concrete state made with another ``every_k`` or
      loss-scale configuration.

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

    A token budget: the window closes at the first microbatch reaching 8 tokens.

    >>> tx = optax_accum.accumulate(optax.sgd(1.0), window_weight=8)
    >>> state = tx.init(params)
    >>> for n in (3, 4, 2):  # 3, 7, then 9 >= 8: closes with 9 tokens
    ...   u, state = tx.update({'w': jnp.full(2, float(n))}, state, params, weight=n)
    >>> u['w'], int(optax_accum.metrics(state).window_weight)  # -(9 + 16 + 4) / 9
    (Array([-3.2222223, -3.2222223], dtype=float32), 9)

  References:
    Hugging Face, `Fixing gradient accumulation
    <https://huggingface.co/blog/gradient_accumulation>`_ (2024), on weighting by
    token counts; ``optax.MultiSteps`` for the transformation's shape.
  """
  every_k = _checks.options(
    inner, every_k, clip_norm, skip_nonfinite, loss_scale, accumulator_dtype, axis_name
  )
  noise_decay = _checks.noise_scale_decay(noise_scale_decay)
  budget = _checks.window_weight(every_k, window_weight, window_weight_of)
  scale_kind = 0 if loss_scale is None else 1 if isinstance(loss_scale, StaticLossScale) else 2
  config = _Config(
    inner=optax.with_extra_args_support(inner),
    every_k=every_k,
    every_k_fp=-1 if callable(every_k) else 0 if every_k is None else every_k,
    budget=None if budget is None else _window_weight.Budget(*budget),
    scale_kind=scale_kind,
    static_scale=1.0 if scale_kind == 0 else loss_scale.value if scale_kind == 1 else None,
    accumulator_dtype=None if accumulator_dtype is None else jnp.dtype(accumulator_dtype),
    loss_scale=loss_scale,
    clip_norm=clip_norm,
    skip_nonfinite=skip_nonfinite,
    axis_name=axis_name,
    noise_decay=noise_decay,
  )

  def init_fn(params):
    return _init(config, params)

  def update_fn(grads, state, params=None, **extra_args):
    return _step(config, grads, state, params, fused=False, **extra_args)

  def fused_fn(grads, state, params, **extra_args):
    if params is None:
      raise ValueError("update_and_apply needs the params: they are what it updates.")
    return _step(config, grads, state, params, fused=True, **extra_args)

  _FUSED[update_fn] = fused_fn
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# accumulate's update functions -> their fused entry points (see fused_update).
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Config(NamedTuple):
  """``accumulate``'s configuration, validated; it lives in the closure, never in the state."""

  inner: optax.GradientTransformationExtraArgs
  every_k: int | Callable[[jax.Array], Any] | None
  every_k_fp: int  # the state's every_k fingerprint: k, -1 a schedule, 0 none (a budget alone)
  budget: _window_weight.Budget | None  # window_weight (issue 15)
  scale_kind: int  # the loss_scale_kind fingerprint: 0 none, 1 static, 2 dynamic
  static_scale: float | None  # the loss scale a state must hold (None: dynamic)
  accumulator_dtype: Any
  loss_scale: LossScale | None
  clip_norm: float | None
  skip_nonfinite: bool
  axis_name: str | tuple[str, ...] | None
  noise_decay: float | None = None  # the noise scale's EMA decay (None: off)

  def window_length(self, num_updates: jax.Array) -> jax.Array:
    """``every_k`` for the window after ``num_updates`` applied windows, int32."""
    if self.every_k is None:  # windows close on their weight (or a flush) alone
      return jnp.asarray(_checks.INT32_MAX, jnp.int32)
    if not callable(self.every_k):
      return jnp.asarray(self.every_k, jnp.int32)
    return _checks.window_length(self.every_k(num_updates))


def fused_update(tx: Any) -> Callable[..., tuple[PyTree, PyTree]] | None:
  """``tx``'s fused entry point if ``tx`` is ``accumulate``'s own transformation, else None.

  Decided by what ``tx`` is: a chain or wrapper around ``accumulate`` has its
  own ``update`` and gets None (its members may change the updates).
  """
  try:
    return _FUSED.get(tx.update)
  except TypeError:  # an update that cannot be weakly referenced is not ours
    return None


def _init(config: _Config, params: PyTree) -> AccumulationState:
  fdt = _numerics.scalar_dtype()

  def acc_zeros(p):
    return _buffers.zeros_like_placed(
      p, _numerics.accumulator_dtype(p.dtype, config.accumulator_dtype)
    )

  # A fresh buffer per field: donating a state whose leaves share a buffer
  # fails ("Attempt to donate the same buffer twice").
  def zero_i():
    return jnp.zeros((), jnp.int32)

  initial_scale = 1.0 if config.loss_scale is None else config.loss_scale.initial_scale()
  state = AccumulationState(
    mini_step=zero_i(),
    acc=jax.tree.map(acc_zeros, params),
    weight_sum=jnp.zeros((), fdt),
    value_sum=jnp.zeros((), fdt),
    value_weight=jnp.zeros((), fdt),
    num_microbatches=zero_i(),
    num_updates=zero_i(),
    num_skipped=zero_i(),
    updated=jnp.zeros((), jnp.bool_),
    window_loss=jnp.zeros((), fdt),
    has_window_loss=jnp.zeros((), jnp.bool_),
    grad_norm=jnp.zeros((), fdt),
    has_grad_norm=jnp.zeros((), jnp.bool_),
    loss_scale=jnp.asarray(initial_scale, jnp.float32),
    growth_streak=zero_i(),
    every_k=jnp.asarray(config.every_k_fp, jnp.int32),
    loss_scale_kind=jnp.asarray(config.scale_kind, jnp.int32),
    **dict(zip(_noise_scale.WINDOW, _noise_scale.zeros(), strict=True)),
    **{name: jnp.zeros((), fdt) for name in _noise_scale.EMA},
    weight_seen=_window_weight.zeros(),
    window_weight=_window_weight.zeros(),
    window_weight_parts=_window_weight.zero_parts(),
    inner_state=pitfalls.check_inner_state(config.inner.init(params), AccumulationState),
  )
  return _vma.per_device_window(state, config.axis_name)


class _Window(NamedTuple):
  """The open window's sums after this call's microbatch is added (``acc`` aside)."""

  weight_sum: jax.Array
  value_sum: jax.Array
  value_weight: jax.Array
  weight_parts: jax.Array  # the window's weight, exact (_window_weight.add_parts)
  noise: tuple = ()  # (noise_sq_sum, noise_samples) with a noise_scale_decay (_noise_scale)


def _step(config, grads, state, params, *, fused, weight=1, flush=False, value=None, **extra_args):
  """One microbatch: add it to the window; at a boundary, close the window."""
  _checks.state(state)
  _checks.fingerprint(state, config.every_k_fp, config.scale_kind, config.static_scale)
  _checks.trees(grads, state.acc, params, config.accumulator_dtype)
  _checks.replicated_params(params, config.axis_name)
  w = _checks.weight(weight)
  flush = _checks.flush_flag(flush)
  window = _Window(
    state.weight_sum + w,
    state.value_sum,
    state.value_weight,
    _window_weight.add_parts(state.window_weight_parts, w),
  )
  if config.noise_decay is not None:  # one scalar per microbatch, from the same cast gradient
    noise = (state.noise_sq_sum, state.noise_samples)
    window = window._replace(noise=_noise_scale.add(noise, state.acc, grads, w))
  if value is not None:
    window = window._replace(
      value_sum=_numerics.weighted_add(state.value_sum, _checks.value(value), w),
      value_weight=state.value_weight + w,
    )
  mini_step = state.mini_step + 1
  by_weight = _window_weight.reached(
    config.budget, window.weight_sum, state.num_updates, state.weight_seen, config.axis_name
  )
  boundary = (mini_step >= config.window_length(state.num_updates)) | by_weight | flush
  like = _boundary.likes(config, grads, state, params, fused, value, extra_args)
  # The sum is added outside the cond: one fused, in-place pass over the donated
  # accumulator, which reads it as zeros if the window was empty (the lazy reset,
  # _buffers.open_window), and which `between` passes through untouched.
  acc = _numerics.weighted_add(state.window_sum, grads, w)
  fits = None if fused else _boundary.stash_fits(like.out, acc)

  def between(operands):
    acc, inner_state = operands
    # Params pass through untouched (the fused path); the zero updates are
    # selected after the cond (below), except where acc cannot hold them.
    out = params if fused else _boundary.own_zeros(like.out, fits, boundary)
    # Built from the state's own fields: zeros_like keeps their device variance,
    # so both cond branches agree under shard_map(check_vma=True).
    unchanged = {f: getattr(state, f) for f in _boundary.Closed._fields[1:]}
    return (
      out,
      acc,
      inner_state,
      _boundary.Closed(updated=jnp.zeros_like(state.updated), **unchanged),
    )

  def close(operands):
    acc, inner_state = operands
    return _boundary.close(
      config, state, acc, window, inner_state, params, like, fits, value, extra_args
    )

  operands = (acc, state.inner_state)
  inputs = (grads, state, params, w, flush, value, extra_args)
  branches = _vma.agree((close, between), operands, inputs)
  out, acc, inner_state, closed = jax.lax.cond(boundary, *branches, operands)
  if not fused:  # the updates, read from where the boundary stashed them (or zeros)
    out = _boundary.unstash(out, acc, fits, like.out, closed.updated)

  def reset(x):  # the window's scalars, zero again after a boundary
    return jnp.where(boundary, jnp.zeros_like(x), x)

  new_state = AccumulationState(
    mini_step=reset(mini_step),
    acc=acc,
    weight_sum=reset(window.weight_sum),
    value_sum=reset(window.value_sum),
    value_weight=reset(window.value_weight),
    **_noise_window(state, window.noise, reset),
    window_weight_parts=reset(window.weight_parts),
    num_microbatches=optax.safe_increment(state.num_microbatches),
    every_k=state.every_k,
    loss_scale_kind=state.loss_scale_kind,
    inner_state=inner_state,
    **closed._asdict(),
  )
  return out, new_state


def _noise_window(state, noise, reset) -> dict[str, jax.Array]:
  """The noise scale's window sums after this call (the state's own zeros when it is off)."""
  if not noise:
    return {f: getattr(state, f) for f in _noise_scale.WINDOW}
  return dict(zip(_noise_scale.WINDOW, map(reset, noise), strict=True))
