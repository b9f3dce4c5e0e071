"""``accumulate``: weighted gradient accumulation as an Optax transformation.

The factory: the validated :class:`Config` (kept in the closure, never in the state),
``init`` and :class:`Accumulation`, whose second entry point ``update_and_apply`` (the
fused step) :func:`optax_accum.update_and_apply` takes. A microstep and a boundary read
top to bottom in ``_step``; docs/design.md maps the modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import (
  _aggregation,
  _buffers,
  _checks,
  _equinox,
  _guard,
  _loss_scale,
  _noise_scale,
  _numerics,
  _step,
  _vma,
  pitfalls,
)
from optax_accum import _weight_count as wc
from optax_accum import _window_weight as ww
from optax_accum._state import AccumulationState, Fingerprint, Window

PyTree = Any


class Accumulation(optax.GradientTransformationExtraArgs):
  """The transformation :func:`accumulate` returns: optax's ``(init, update)``, and the fused step.

  An ``optax.GradientTransformationExtraArgs`` (``optax.chain``, ``masked`` and Flax take it
  as any other); :func:`optax_accum.update_and_apply` runs its fused ``update_and_apply``.

  ``update(grads, state, params=None, *, weight=1, flush=False, value=None, **extra_args)``:

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

  ``update``'s arguments:
    grads: gradient of this microbatch's *mean* loss, a tree like the params.
    weight: number of examples or unmasked tokens that mean is over; a
      non-negative scalar (Python number or array, may be traced). A traced
      negative weight is not checked: it subtracts that microbatch.
    flush: bool (may be traced); close the window after this microbatch even if
      it holds fewer than ``every_k`` microbatches.
    value: optional microbatch loss; the inner optimizer receives the window's
      weighted mean as ``value`` (for ``optax.contrib.reduce_on_plateau``).
    **extra_args: forwarded to ``inner.update`` on the boundary call.

  Attributes:
    init: ``init(params) -> AccumulationState``.
    update: ``update(grads, state, params=None, **extra_args) -> (updates, state)``.
    update_and_apply: ``(grads, state, params, **extra_args) -> (new_params, state)``.
  """

  @property
  def update_and_apply(self) -> Callable[..., tuple[PyTree, PyTree]]:
    """The fused step: ``(grads, state, params, **extra_args) -> (new_params, new_state)``."""
    return self.update.__self__.update_and_apply

  def _replace(self, **fields):
    """A plain ``GradientTransformationExtraArgs``: the fused step would not match a new field."""
    return optax.GradientTransformationExtraArgs(**{**self._asdict(), **fields})


class _Steps:
  """``accumulate``'s two steps; ``Accumulation.update`` is the bound method ``update``.

  A bound method, so that an ``Accumulation`` rebuilt from its two fields (``jax.tree``
  and Flax treat it as a NamedTuple) still reaches the fused step, and ``update`` is
  still a method for ``inspect`` and ``chex.assert_max_traces``.
  """

  def __init__(self, config: Config):
    self.config = config
    # Eager calls run these, compiled once per tree structure (``_step.run``).
    self.compiled = {
      out: jax.jit(functools.partial(_step.step, config, out)) for out in _buffers.Output
    }

  def update(self, grads, state, params=None, **extra_args):
    return _step.run(self.config, _buffers.Output.UPDATES, self.compiled, grads, state, params,
                     extra_args)  # fmt: skip

  def update_and_apply(self, grads, state, params, **extra_args):
    if params is None:
      raise ValueError("update_and_apply needs the params: they are what it updates.")
    return _step.run(self.config, _buffers.Output.PARAMS, self.compiled, grads, state, params,
                     extra_args)  # fmt: skip


def accumulate(
  inner: optax.GradientTransformation,
  every_k: int | Callable[[jax.Array], Any] | None = None,
  *,
  window_weight: float | Callable[[jax.Array], Any] | None = None,
  window_weight_of: str | None = None,
  accumulator_dtype: Any = None,
  loss_scale: _loss_scale.LossScale | None = None,
  clip_norm: float | None = None,
  skip_nonfinite: bool = True,
  axis_name: str | tuple[str, ...] | None = None,
  noise_scale_decay: float | None = None,
  skip_if: Any = None,
  denominator: float | Callable[[jax.Array], Any] | None = None,
  apply_empty: bool = False,
  reduce: Any = None,
  overwrite: bool = True,
) -> Accumulation:
  """Accumulates weighted microbatch gradients and runs ``inner`` once per window.

  Each call adds ``weight * grads`` to the window and emits exact zeros; at the
  window's boundary (``every_k`` calls, ``window_weight`` reached, or
  ``flush=True``) the window mean ``sum_i w_i g_i / (sum_i w_i * loss_scale)``
  is checked for finiteness once, clipped to ``clip_norm`` and handed to
  ``inner.update`` once; a non-finite window is skipped whole, an empty one
  changes nothing (:class:`Accumulation` lists ``update``'s arguments).

  Args:
    inner: the inner optimizer (any ``optax.GradientTransformation``); its
      schedules, weight decay and step counts advance only on applied windows.
    every_k: microbatches per window: an int >= 1, or a callable of
      ``num_updates`` (int32) returning an integer scalar (below 1 acts as 1),
      like ``optax.MultiSteps(every_k_schedule=...)``. None: no count limit
      (``window_weight`` required); with ``window_weight`` too, a cap.
    window_weight: the window's budget of weight (tokens, examples): it closes at the first
      microbatch whose cumulative weight reaches it. A number (finite, > 0, exact in the
      weight-sum dtype) or a ramp, a callable of what ``window_weight_of`` names; global
      under ``axis_name`` (one scalar ``psum`` per microstep). docs/window_weight.md.
    window_weight_of: for a ramp (required then, refused otherwise):
      ``'num_updates'`` or ``'weight_seen'`` (``metrics(state).weight_seen``).
    accumulator_dtype: None (default): ``promote_types(grad.dtype, float32)``
      per leaf (float32 for bf16/fp16/float32, float64 under x64); or a dtype.
    loss_scale: None, :func:`optax_accum.static_loss_scale` or
      :func:`optax_accum.dynamic_loss_scale`; the grads are then gradients of
      ``loss * get_loss_scale(state)``, unscaled once at the boundary.
    clip_norm: clip the unscaled window mean to this global L2 norm (optax's
      ``clip_by_global_norm`` rule) before ``inner``; None: no clip.
    skip_nonfinite: skip windows whose mean has a NaN or Inf (default True).
    axis_name: a ``shard_map`` axis name (or tuple): each device sums its own
      microbatches; one ``psum`` at the boundary precedes the single division.
    noise_scale_decay: None (off) or the EMA decay in [0, 1) of the gradient noise scale
      ``B_simple`` (McCandlish et al. 2018, app. A) from the window's own microbatches, in
      the units of ``weight`` (:func:`optax_accum.metrics`). docs/noise_scale.md.
    skip_if: None, :func:`optax_accum.spike_rule`, a callable of the window's statistics
      (``grad_norm``, ``loss``, ``has_loss``, ``weight``, ``num_updates``, 0-d) returning
      True to skip a finite window (counted in ``num_spikes``), or a tuple. docs/guards.md.
    denominator: None (default): divide the window's weighted sum by its weight sum. A
      number > 0, or a callable of ``num_updates`` (int32) returning one: divide by it
      whatever the realized weight (DP-SGD's expected batch size, a token count known in
      advance; global under ``axis_name``); ``1``: the plain sum ``sum_i w_i g_i``. The
      window's ``value`` (loss) is divided the same way. A schedule's value that is not
      finite and > 0 raises where it is concrete; traced, it skips the window (counted in
      ``num_skipped``). docs/aggregation.md.
    apply_empty: with a fixed ``denominator``, run the inner optimizer on the zero mean of
      an empty window (weight 0: DP-SGD's noise is still added) instead of skipping it.
      A flush of a window that holds no microbatch stays a no-op.
    reduce: per-leaf rules, a rule or a tree prefix of the params with one per subtree (or
      a callable of the params tree returning one): ``'mean'`` (by the denominator),
      ``'sum'`` (``sum_i w_i g_i``), ``'max'`` (elementwise, over the microbatches with
      weight > 0), ``'last'``, ``'grad_amax_history'`` (an FP8 amax history of a
      gradient, newest entry first: that entry is ``max_i w_i x_i / denominator``). None:
      ``'mean'``, and Flax's FP8 rule in its ``_overwrite_with_gradient`` collection. A
      dict prefix matches any mapping by key (``nnx.State`` too). Max, last and FP8 leaves
      are values, not gradients: the loss scale does not divide them.
    overwrite: leaves reduced by max, last or the FP8 rule are overwritten with their window
      value at an applied boundary (Flax's rule for that collection; exact on the fused
      path, ``value - param`` from ``tx.update``) instead of going through ``inner``.

  Returns:
    An :class:`Accumulation` (state: :class:`AccumulationState`, finite while the gradients
    are). ``inner`` sees the mean in the wider of the grads' and params' dtypes; the updates
    have plain ``inner``'s dtypes (optax's ``test_multi_steps_mixed_precision`` rule).

  Raises:
    TypeError, ValueError: at construction, naming a bad argument; at trace
      time for a non-scalar, boolean, concrete negative or unrepresentable
      weight, grads that do not match the state or params, device-varying
      params under ``axis_name``, and a state of another configuration (its
      fingerprint's values on eager calls and in ``sharding.check_compatible``;
      under ``jit``, where they are traced, its sub-states and structure).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> params = {'w': jnp.zeros(2)}
    >>> u, state = tx.update({'w': jnp.array([1., 1.])}, tx.init(params), params, weight=3)
    >>> u['w']  # between boundaries: exact zeros
    Array([0., 0.], dtype=float32)
    >>> u, state = tx.update({'w': jnp.array([5., 5.])}, state, params, weight=1)
    >>> u['w']  # -(3 * 1 + 1 * 5) / 4
    Array([-2., -2.], dtype=float32)
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, denominator=16)
    >>> u, state = tx.update({'w': jnp.array([1., 1.])}, tx.init(params), params, weight=3)
    >>> u, state = tx.update({'w': jnp.array([5., 5.])}, state, params, weight=1)
    >>> u['w']  # -(3 * 1 + 1 * 5) / 16: the fixed denominator, not the weight
    Array([-0.5, -0.5], dtype=float32)

  References:
    Hugging Face, `Fixing gradient accumulation
    <https://huggingface.co/blog/gradient_accumulation>`_ (2024); ``optax.MultiSteps``.
  """
  config = _config(
    inner, every_k, window_weight, window_weight_of, accumulator_dtype, loss_scale, clip_norm,
    skip_nonfinite, axis_name, noise_scale_decay, skip_if,
    _aggregation.check(denominator, apply_empty, reduce, overwrite),
  )  # fmt: skip

  def init_fn(params):
    return init(config, params)

  return Accumulation(init_fn, _Steps(config).update)


class Config(NamedTuple):
  """``accumulate``'s configuration, validated; it lives in the closure, never in the state."""

  inner: optax.GradientTransformationExtraArgs
  every_k: int | Callable[[jax.Array], Any] | None
  budget: ww.Budget | None
  loss_scale: _loss_scale.LossScale | None
  accumulator_dtype: Any
  clip_norm: float | None
  skip_nonfinite: bool
  axis_name: str | tuple[str, ...] | None
  noise_decay: float | None
  guard: tuple[Any, ...]
  aggregation: _aggregation.Aggregation

  @property
  def fingerprint(self) -> Fingerprint:
    """What a state made by this configuration holds (``_state.Fingerprint``)."""
    fixed = self.every_k if isinstance(self.every_k, int) else 0
    ls = self.loss_scale
    if ls is None:
      return Fingerprint(fixed, None, None)
    if isinstance(ls, _loss_scale.StaticLossScale):
      return Fingerprint(fixed, "static", ls.value)
    return Fingerprint(fixed, "dynamic", None)

  def window_length(self, num_updates: jax.Array) -> jax.Array:
    """``every_k`` for the window after ``num_updates`` applied windows, int32."""
    if self.every_k is None:  # windows close on their weight (or a flush) alone
      return jnp.asarray(_checks.INT32_MAX, jnp.int32)
    if not callable(self.every_k):
      return jnp.asarray(self.every_k, jnp.int32)
    return _window_length(self.every_k(num_updates))


def _config(inner, every_k, window_weight, window_weight_of, accumulator_dtype, loss_scale,
            clip_norm, skip_nonfinite, axis_name, noise_scale_decay,
            skip_if, aggregation) -> Config:  # fmt: skip
  """Validates ``accumulate``'s arguments, each with an error naming it and the fix."""
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(
      f"inner must be an optax.GradientTransformation, got {inner!r}. Call the factory: "
      "accumulate(optax.adam(1e-3), every_k=4), not accumulate(optax.adam, ...)."
    )
  if every_k is not None and not callable(every_k):
    every_k = _checks.positive_int(every_k, "every_k", "microbatches per window, or a callable")
  if clip_norm is not None:
    clip_norm = _checks.real_number(clip_norm, "clip_norm", "a global L2 norm")
    if not 0 < clip_norm < float("inf"):
      raise ValueError(f"clip_norm must be finite and > 0 (a global L2 norm), got {clip_norm}.")
  if not isinstance(skip_nonfinite, (bool, np.bool_)):
    raise TypeError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}.")
  _checks.axis_names(axis_name)
  if noise_scale_decay is not None and aggregation != _aggregation.check(None, False, None, True):
    raise ValueError(
      "noise_scale_decay estimates the noise of a weighted mean: it cannot be combined with "
      "denominator=, apply_empty= or reduce=. Leave one of them out."
    )
  return Config(
    inner=optax.with_extra_args_support(inner),
    every_k=every_k,
    budget=ww.check_window_weight(every_k, window_weight, window_weight_of),
    loss_scale=_loss_scale.check_policy(loss_scale),
    accumulator_dtype=_accumulator_dtype(accumulator_dtype),
    clip_norm=clip_norm,
    skip_nonfinite=bool(skip_nonfinite),
    axis_name=axis_name,
    noise_decay=_noise_scale.check_decay(noise_scale_decay),
    guard=_guard.check_skip_if(skip_if),
    aggregation=aggregation,
  )


def _accumulator_dtype(dtype: Any) -> jnp.dtype | None:
  """A validated ``accumulator_dtype`` (None: the default rule, per leaf)."""
  if dtype is None:
    return None
  dtype = jnp.dtype(dtype)
  if jax.dtypes.canonicalize_dtype(dtype) != dtype:
    raise TypeError(
      f"accumulator_dtype={dtype} needs 64-bit JAX: without jax_enable_x64 every array "
      f"is at most 32-bit, so a {dtype} accumulator would silently be "
      f"{jax.dtypes.canonicalize_dtype(dtype)}. Call "
      "jax.config.update('jax_enable_x64', True) before creating the optimizer, or leave "
      "accumulator_dtype=None (float32 for bf16/fp16/float32 gradients)."
    )
  return dtype


def _window_length(k: Any) -> jax.Array:
  """An ``every_k`` schedule's value as int32, never wrapped.

  A concrete value above 2**31 - 1 raises; a traced one of a wider integer
  dtype saturates at 2**31 - 1 (a window that does not close by count).
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


def init(config: Config, params: PyTree) -> AccumulationState:
  """A fresh state: an empty window, zero counters, each feature's sub-state or ``EmptyState``."""
  pitfalls.check_params(params)
  _equinox.check_params(params)
  agg = config.aggregation
  fp8 = "grad_amax_history" in agg.rules(params)
  if config.noise_decay is not None and agg.active(params):
    raise ValueError(
      "noise_scale_decay estimates the noise of a weighted mean, but these params have leaves "
      "with other rules (Flax FP8 meta?): pass reduce='mean' for them, or drop the noise scale."
    )
  pitfalls.check_fp8_scale(fp8, agg.denominator is None, config.every_k)
  fdt = _numerics.scalar_dtype()
  # A fresh buffer per field: donating a state whose leaves share a buffer
  # fails ("Attempt to donate the same buffer twice").
  zero_f = lambda: jnp.zeros((), fdt)
  zero_i = lambda: jnp.zeros((), jnp.int32)
  zero_b = lambda: jnp.zeros((), jnp.bool_)
  acc_dtype = lambda p: _numerics.accumulator_dtype(p.dtype, config.accumulator_dtype)
  on = lambda flag, make: make() if flag else optax.EmptyState()
  window = Window(
    grad_sum=jax.tree.map(lambda p: _buffers.zeros_like_placed(p, acc_dtype(p)), params),
    weight_sum=zero_f(),
    value_sum=zero_f(),
    value_weight=zero_f(),
    weight_parts=on(config.budget is not None, wc.zero_parts),
    noise=on(config.noise_decay is not None, _noise_scale.zeros),
  )
  state = AccumulationState(
    mini_step=zero_i(),
    window=window,
    num_microbatches=zero_i(),
    num_updates=zero_i(),
    num_skipped=zero_i(),
    updated=zero_b(),
    window_loss=zero_f(),
    has_window_loss=zero_b(),
    grad_norm=zero_f(),
    has_grad_norm=zero_b(),
    every_k=jnp.asarray(config.fingerprint.every_k, jnp.int32),
    loss_scale=on(config.loss_scale is not None, lambda: _loss_scale.init_state(config.loss_scale)),
    token_budget=on(config.budget is not None, ww.init_state),
    noise_scale=on(config.noise_decay is not None, _noise_scale.init_state),
    guard=on(bool(config.guard), lambda: _guard.init_state(config.guard)),
    aggregation=config.aggregation.init_state(params),
    inner_state=pitfalls.check_inner_state(
      config.aggregation.inner_for(config.inner, params).init(params), AccumulationState
    ),
  )
  return _vma.per_device_window(state, config.axis_name)
