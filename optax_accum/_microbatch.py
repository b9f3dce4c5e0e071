"""In-step accumulation: ``microbatched_value_and_grad`` runs one ``lax.scan`` over microbatches.

Inside one jitted train step the batch is cut into ``K`` microbatches; a
``lax.scan`` adds ``w_k * grad(loss_k)`` to a float32 (or wider) carry and
``w_k`` to a weight sum, and divides once at the end. Only one microbatch's
activations are live at a time, so the step's temporary memory is about ``1/K``
of the physical batch's activations plus one gradient-sized carry.

The sums and the division are :mod:`optax_accum._numerics`'s
(``weighted_add``, ``guarded_divide``, ``accumulator_dtype``; ``_checks.weight``),
the same code the across-step :func:`optax_accum.accumulate` runs, so both
paths round the same way and an empty (all-padding) batch gives zeros, not NaN.

See docs/design.md for the module map.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _checks, _loss_scale, _noise_scale, _numerics
from optax_accum import _microbatch_mesh as _mesh
from optax_accum._microbatch_mesh import split_batch

PyTree = Any

_AUX_MODES = ("mean", "stack")


def _carry_dtype(dtype: Any, override: Any = None) -> jnp.dtype:
  """The dtype a sum of ``dtype`` values is carried in (integers and bools become float)."""
  dt = jnp.dtype(dtype)
  dt = dt if jnp.issubdtype(dt, jnp.inexact) else _numerics.scalar_dtype()
  return _numerics.accumulator_dtype(dt, override)


def _scale_value(loss_scale: Any) -> jax.Array | None:
  """The loss scale in force as a float32 scalar; a concrete one must be finite and > 0."""
  if loss_scale is None:
    return None
  if isinstance(loss_scale, (_loss_scale.StaticLossScale, _loss_scale.DynamicLossScale)):
    raise TypeError(
      "microbatched_value_and_grad takes the loss scale in force (a number), not a loss-scale "
      "policy: pass loss_scale=optax_accum.get_loss_scale(opt_state) and give the policy "
      f"({type(loss_scale).__name__}) to accumulate(..., loss_scale=...)."
    )
  if not isinstance(loss_scale, jax.core.Tracer):
    if not 0 < float(np.asarray(loss_scale)) < float("inf"):
      raise ValueError(
        f"loss_scale must be a finite number > 0, got {loss_scale}. Pass None for no "
        "scaling, or optax_accum.get_loss_scale(opt_state)."
      )
  return jnp.asarray(loss_scale, _numerics.scalar_dtype())


def microbatched_value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  weight_fn: Callable[[PyTree], Any] | None = None,
  has_aux: bool = False,
  has_state: bool = False,
  aux_mode: str = "mean",
  strided: bool = True,
  axis_name: str | tuple[str, ...] | None = None,
  loss_scale: Any = None,
  accumulator_dtype: Any = None,
  noise_scale: bool = False,
) -> Callable[..., tuple[Any, PyTree]]:
  """``jax.value_and_grad(loss_fn)`` over a batch, computed one microbatch at a time.

  The returned ``f(params, batch, *args, **kwargs)`` splits ``batch`` with
  :func:`split_batch`, runs ``jax.lax.scan`` over the ``K`` microbatches and
  returns the value and gradient of the weighted mean loss
  ``sum_k w_k loss_k / sum_k w_k`` with ``w_k = weight_fn(microbatch_k)``. With
  ``loss_fn`` returning the mean over examples (or unmasked tokens) and
  ``w_k`` their count, that is exactly ``jax.value_and_grad(loss_fn)`` on the
  whole batch, whatever the counts per microbatch (the mean-of-means bug is
  avoided). Microbatches of weight 0 add nothing (even a NaN); a total weight
  of 0 gives a zero loss and zero gradients.

  Sums are carried in ``promote_types(dtype, float32)`` (the accumulator rule of
  :func:`optax_accum.accumulate`); gradients are returned in the params'
  dtypes, the loss and mean aux in that accumulator dtype.

  Args:
    loss_fn: ``loss_fn(params, batch, *args, **kwargs)`` (with ``has_state``:
      ``loss_fn(params, batch, state, *args, **kwargs)``) returning the MEAN
      loss over the examples / unmasked tokens of ``batch`` (a scalar), or
      ``(loss, aux)`` with ``has_aux``. With ``has_state`` it returns
      ``(loss, new_state)``, or ``(loss, (aux, new_state))`` with ``has_aux``.
      If the caller passes ``key=`` it is folded with the microbatch index
      (``jax.random.fold_in(key, k)``) for each call, so dropout masks differ
      between microbatches and are reproducible.
    num_microbatches: ``K`` >= 1; the batch size must be divisible by it
      (checked at trace time).
    weight_fn: ``weight_fn(microbatch) -> scalar``, the count the microbatch's
      mean is over (e.g. ``lambda mb: mb['mask'].sum()``). Default: its rows.
    has_aux: as in ``jax.value_and_grad``.
    has_state: thread non-differentiated state (BatchNorm statistics, RNG
      counters of a split ``nnx`` model) through the microbatches in order:
      microbatch ``k`` sees the state microbatch ``k-1`` returned, and ``f``
      returns the last one.
    aux_mode: ``'mean'`` (default): aux leaves are combined by the same
      weighted mean as the loss (so per-microbatch means of a metric combine
      into the batch mean; integer leaves come back as float).
      ``'stack'``: aux leaves are stacked per microbatch, shape ``[K, ...]``.
    strided: microbatch ``k`` takes rows ``k, k+K, ...`` (default; keeps rows
      on their device under data-parallel sharding when the local batch is
      divisible by ``K``); ``False`` takes contiguous slices.
    axis_name: the mesh axis (or tuple of axes) the batch is sharded over.
      ``f`` then communicates once per call, after the scan, never per
      microbatch. Inside ``jax.shard_map`` over the axis, ``batch`` is the
      device's rows; one ``psum`` of the sums (gradient, weight, loss, aux)
      follows the scan, so the result is weighted by the global weight sum
      (a device's rows may hold fewer real tokens). Under ``jax.jit`` (call
      it inside ``with jax.set_mesh(mesh):``, or with Explicit-sharded batch
      leaves), each microbatch is cut into one lane per device
      (``loss_fn`` and ``weight_fn`` see ``rows / (K * D)`` rows) and every
      device keeps its partial sum; the lanes are summed once after the scan
      (one all-reduce, or reduce-scatter for sharded params, per leaf). The
      batch size must then be divisible by ``K * D``, ``has_state`` is
      refused, ``key`` is also folded with the lane index, and ``'stack'``
      aux is the weighted mean over lanes per microbatch. The carry then
      holds one gradient-sized partial sum per device (not a shard of one).
      Default ``None``: no reduction of ours; under ``jit`` with a sharded
      batch the compiler all-reduces every microbatch's gradient.
    loss_scale: the loss scale in force: ``None`` or a positive scalar, the
      number ``optax_accum.get_loss_scale(opt_state)`` returns (may be
      traced). The same convention as :func:`optax_accum.scaled_value_and_grad`:
      each microbatch differentiates ``loss * loss_scale`` in float32, the
      returned loss is unscaled, and the gradient is that of the scaled loss,
      for ``accumulate(inner, ..., loss_scale=policy)`` to divide out once at
      the boundary (and skip non-finite steps, adjust a dynamic scale). A
      policy object (``static_loss_scale(...)``) raises ``TypeError``: the
      policy goes to ``accumulate``, its current value here.
    accumulator_dtype: override of the carry's dtype, as in ``accumulate``.
    noise_scale: also return this batch's gradient noise estimates (McCandlish
      et al. 2018, appendix A; the same code as ``accumulate``'s
      ``noise_scale_decay``): one scalar ``w_k |g_k|^2`` per microbatch (per
      lane under ``jit`` with ``axis_name``, per device under ``shard_map``:
      each is a sample), the rest after the scan. Average ``trace`` and
      ``signal`` over steps (e.g. EMAs) and take their ratio for ``B_simple``.
      docs/noise_scale.md.

  Returns:
    ``f(params, batch, *args, **kwargs) -> (value, grads)`` with
    ``jax.value_and_grad(loss_fn, has_aux=has_aux or has_state)``'s output
    structure: ``value`` is ``loss``, ``(loss, aux)``, ``(loss, new_state)`` or
    ``(loss, (aux, new_state))``; ``grads`` is a tree like ``params``. With
    ``noise_scale=True`` the value is ``(value, estimate)``: ``estimate`` an
    ``NoiseEstimate`` named tuple of 0-d arrays (``trace``, ``signal``:
    the unbiased estimates of ``tr(Sigma)`` and ``|G|^2``, unscaled, in the
    weight-sum dtype; ``num_samples``: int32; ``valid``: bool, False for fewer
    than 2 nonzero-weight samples).

  Raises:
    TypeError, ValueError: for a bad ``num_microbatches``, ``aux_mode`` or
      ``noise_scale`` (not a bool) at construction; at trace time for an
      indivisible batch, a non-scalar loss or weight, a boolean weight, a
      loss-scale policy or a concrete non-positive or non-finite
      ``loss_scale``, an ``axis_name`` that is not an axis of the current
      mesh, or ``has_state`` with a ``jit`` ``axis_name``.

  Examples:
    >>> import optax_accum
    >>> def loss_fn(w, batch):  # masked mean of 0.5 * (w - y)**2
    ...   m = batch['mask']
    ...   return (0.5 * (w - batch['y']) ** 2 * m).sum() / jnp.maximum(m.sum(), 1.0)
    >>> batch = {'y': jnp.array([1., 3., 3., 0.]), 'mask': jnp.array([1., 1., 0., 0.])}
    >>> f = optax_accum.microbatched_value_and_grad(
    ...     loss_fn, 2, weight_fn=lambda mb: mb['mask'].sum(), strided=False)
    >>> loss, g = jax.jit(f)(jnp.asarray(0.0), batch)  # second microbatch is all padding
    >>> float(loss), float(g)  # = jax.value_and_grad(loss_fn)(0.0, batch)
    (2.5, -2.0)

  References:
    Hugging Face, `Fixing gradient accumulation
    <https://huggingface.co/blog/gradient_accumulation>`_ (2024), on weighting
    by token counts.
  """
  k_total = _checks.positive_int(num_microbatches, "num_microbatches", "slices of the batch")
  if aux_mode not in _AUX_MODES:
    raise ValueError(f"aux_mode must be one of {_AUX_MODES}, got {aux_mode!r}.")
  if not isinstance(noise_scale, (bool, np.bool_)):
    raise TypeError(f"noise_scale must be True or False, got {noise_scale!r}.")
  if accumulator_dtype is not None:
    accumulator_dtype = jnp.dtype(accumulator_dtype)

  def scaled_loss(params, mb, scale, extra, kwargs):
    args = (params, mb, *extra)
    out = loss_fn(*args, **kwargs)
    if has_state:
      loss, rest = out
      aux, state = rest if has_aux else (None, rest)
    else:
      loss, aux = out if has_aux else (out, None)
      state = None
    loss = jnp.asarray(loss)
    if loss.ndim != 0:
      raise ValueError(f"loss_fn must return a scalar mean loss, got shape {loss.shape}.")
    loss = loss.astype(_numerics.accumulator_dtype(loss.dtype))
    scaled = loss if scale is None else loss * scale.astype(loss.dtype)
    return scaled, (loss, aux, state)

  grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

  def value_and_grad(params, batch, *args, **kwargs):
    mode, axes, mesh = _mesh.resolve(axis_name, batch)
    lanes = _mesh.num_lanes(mesh, axes) if mode == "jit" else 0
    if lanes and has_state:
      raise ValueError(
        f"has_state=True with axis_name={axis_name!r} under jax.jit: every device would "
        "return its own state. Run the step inside jax.shard_map over that axis instead "
        "(each device then threads its own state)."
      )
    if lanes:
      split_batch(batch, k_total, strided=strided)  # the same checks and messages first
      micro = _mesh.split_lanes(batch, k_total, lanes, mesh, axes, strided)
    else:
      micro = split_batch(batch, k_total, strided=strided)
    diff_params = params
    if mode == "shard_map":
      diff_params = _mesh.to_varying(params, axes)
    elif lanes:
      diff_params = _mesh.gather_over(params, mesh, axes)
    if has_state:
      if not args:
        raise TypeError("has_state=True: call f(params, batch, state, *args, **kwargs).")
      state0, args = args[0], args[1:]
    else:
      state0 = None
    key = kwargs.pop("key", None)
    scale = _scale_value(loss_scale)

    def lane_grads(mb, k, state, lane):
      kw = dict(kwargs)
      if key is not None:
        kw["key"] = jax.random.fold_in(key, k)
        if lane is not None:
          kw["key"] = jax.random.fold_in(kw["key"], lane)
      extra = args if state is None else (state, *args)
      (_, (loss, aux, new_state)), g = grad_fn(diff_params, mb, scale, extra, kw)
      w = jax.tree.leaves(mb)[0].shape[0] if weight_fn is None else weight_fn(mb)
      return loss, aux, new_state, g, _checks.weight(w, "weight_fn(microbatch)")

    def grads_of(mb, k, state):
      if not lanes:
        return lane_grads(mb, k, state, None)
      per_lane = lambda m, d: lane_grads(m, k, None, d)
      lane_ids = _mesh.lane_indices(lanes, mesh, axes)
      return jax.vmap(per_lane, spmd_axis_name=axes)(mb, lane_ids)

    add = jax.vmap(_numerics.weighted_add, spmd_axis_name=axes) if lanes else _numerics.weighted_add

    # Trace one microbatch abstractly to size the carry (no compute is staged).
    mb0 = jax.tree.map(lambda x: x[0], micro)
    loss_s, aux_s, _, g_s, w_s = jax.eval_shape(grads_of, mb0, 0, state0)
    zeros = lambda s, dt: _mesh.carry_zeros(s, dt, mesh, axes, lanes)
    acc0 = jax.tree.map(lambda s: zeros(s, _carry_dtype(s.dtype, accumulator_dtype)), g_s)
    loss0 = zeros(loss_s, loss_s.dtype)
    aux0 = None
    if has_aux and aux_mode == "mean":
      aux0 = jax.tree.map(lambda s: zeros(s, _carry_dtype(s.dtype)), aux_s)
    wsum0 = zeros(w_s, _numerics.scalar_dtype())
    noise0 = ()
    if noise_scale:  # (sum_k w_k |g_k|^2, samples), one per lane
      noise0 = tuple(zeros(w_s, z.dtype) for z in _noise_scale.zeros())
    add_noise = jax.vmap(_noise_scale.add, spmd_axis_name=axes) if lanes else _noise_scale.add

    def body(carry, xs):
      acc, wsum, loss_sum, aux_sum, state, noise = carry
      k, mb = xs
      loss, aux, new_state, g, w = grads_of(mb, k, state)
      if noise:
        noise = add_noise(noise, acc, g, w)
      acc = add(acc, g, w)
      loss_sum = add(loss_sum, loss, w)
      if aux_sum is not None:
        aux_sum = add(aux_sum, aux, w)
      stacked = (aux, w) if (has_aux and aux_mode == "stack") else None
      return (acc, wsum + w, loss_sum, aux_sum, new_state, noise), stacked

    carry0 = (acc0, wsum0, loss0, aux0, state0, noise0)
    ks = jnp.arange(k_total, dtype=jnp.int32)
    (acc, wsum, loss_sum, aux_sum, state, noise), stacked = jax.lax.scan(body, carry0, (ks, micro))

    # The one reduction over devices, after the scan.
    sums = (acc, wsum, loss_sum, aux_sum, noise)
    if lanes:
      acc, wsum, loss_sum, aux_sum, noise = jax.tree.map(lambda x: x.sum(0), sums)
    elif mode == "shard_map":
      acc, wsum, loss_sum, aux_sum, noise = _mesh.psum_sums(sums, axes)
    # The one division of the step (by the weight sum).
    grads = optax.tree.cast_like(_numerics.guarded_divide(acc, wsum), params)
    if lanes:
      grads = _mesh.like_params(grads, params)
    loss = _numerics.guarded_divide(loss_sum, wsum)
    if aux_mode == "stack":
      aux = None
      if stacked is not None:
        aux = _mesh.lane_mean(*stacked) if lanes else stacked[0]
    else:
      aux = _numerics.guarded_divide(aux_sum, wsum)
    if has_state:
      value = (loss, (aux, state)) if has_aux else (loss, state)
    else:
      value = (loss, aux) if has_aux else loss
    if noise_scale:
      # |G_B| from the boundary's own norm of the unscaled mean (docs/noise_scale.md).
      unscaled = wsum if scale is None else wsum * scale
      norm, _ = _numerics.norm_and_finite(acc, unscaled)
      value = (value, _noise_scale.estimate(*noise, wsum, norm, scale))
    return value, grads

  return value_and_grad
