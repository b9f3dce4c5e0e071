"""In-step accumulation: ``microbatched_value_and_grad`` runs one ``lax.scan`` over microbatches.

The sums and the one division are :mod:`optax_accum._numerics`'s, the code the
across-step :func:`optax_accum.accumulate` runs, so both paths round the same
way (docs/in_step.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _aggregation, _checks, _loss_scale, _noise_scale, _numerics
from optax_accum import _microbatch_mesh as _mesh
from optax_accum._microbatch_mesh import split_batch

PyTree = Any


class _Config(NamedTuple):
  """One ``microbatched_value_and_grad``'s arguments, checked at construction."""

  loss_fn: Callable[..., Any]
  num_microbatches: int
  weight_fn: Callable[[PyTree], Any] | None
  has_aux: bool
  has_state: bool
  aux_mode: str
  strided: bool
  axis_name: Any
  loss_scale: Any
  accumulator_dtype: Any
  noise_scale: bool
  aggregation: _aggregation.Aggregation


class _Sums(NamedTuple):
  """The scan's carried sums, all that crosses devices (in one reduction after the scan):
  ``sum_k w_k x_k`` of the (scaled) ``grads`` in the accumulator dtype, ``weight``, ``loss``,
  ``aux`` (``aux_mode`` 'mean'/'sum', else None), ``noise`` (``noise_scale``, else ``()``)."""

  grads: PyTree
  weight: jax.Array
  loss: jax.Array
  aux: PyTree
  noise: tuple


class _Mode(NamedTuple):
  """The steps of one call that depend on where the sums live (:func:`_local`, :func:`_lanes`)."""

  grads_of: Callable  # (microbatch, k, state) -> (loss, aux, new_state, grads, weight)
  add: Callable  # _numerics.weighted_add (per lane under jit with axis_name)
  add_grads: Callable  # _aggregation.add with the leaves' rules, likewise
  add_noise: Callable  # _noise_scale.add, likewise
  zeros: Callable  # (struct, dtype) -> zeros typed and placed like a carry of struct
  reduce: Callable  # the one reduction of the _Sums over devices, after the scan
  place: Callable  # grads -> grads placed like the params
  stack: Callable  # (aux, weights) stacked per microbatch -> the aux_mode='stack' aux
  concat: Callable  # per-example aux stacked per microbatch -> [B, ...] in the batch's order
  lead: int  # leading lane dimensions of what grads_of returns (1 under jit with axis_name)


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
  aggregate: _aggregation.Aggregation | None = None,
) -> Callable[..., tuple[Any, PyTree]]:
  """``jax.value_and_grad(loss_fn)`` over a batch, computed one microbatch at a time.

  ``f(params, batch, *args, **kwargs)`` runs one ``lax.scan`` over the ``K`` microbatches
  of ``batch`` (split as ``strided`` says): the value and gradient of ``sum_k w_k loss_k / sum_k
  w_k``, for a mean loss and ``w_k`` its count those of the whole batch. A weight-0
  microbatch adds nothing (even a NaN); a total weight of 0 gives zeros. docs/in_step.md.

  Args:
    loss_fn: ``loss_fn(params, mb, *args, **kwargs)`` -> the MEAN loss, or
      ``(loss, aux)``; with ``has_state``, ``loss_fn(params, mb, state, ...)`` ->
      ``(loss, new_state)`` or ``(loss, (aux, new_state))``. Every PRNG key in
      ``kwargs`` (``key=``, ``rngs={'dropout': key}``; typed keys or raw
      ``uint32[2]``) is folded with the microbatch index (and the lane, on a mesh).
    num_microbatches: ``K`` >= 1, dividing the batch size.
    weight_fn: ``weight_fn(mb)``, the count its mean is over (accumulate's ``weight``).
      Default: its rows (every microbatch has as many), for mean losses; with a fixed
      denominator it must be given (``lambda mb: 1`` for losses already at the batch's scale).
    has_aux: as in ``jax.value_and_grad``.
    has_state: thread state (BatchNorm statistics, NNX RNG counters) through
      the microbatches in order; ``f`` returns the last one.
    aux_mode: how aux leaves combine: ``'mean'`` (by the loss's weights: mean metrics such as
      accuracy), ``'sum'`` (count and sum metrics), ``'concat'`` (per-example values, ``[B,
      ...]`` in the batch's order) or ``'stack'`` (per microbatch, ``[K, ...]``). ``'mean'`` and
      ``'sum'`` refuse a per-example leaf (one row per example) rather than reshape it.
    strided: microbatch ``k`` takes rows ``k, k+K, ...``; ``False``: contiguous.
    axis_name: the mesh axis (or axes) the batch is sharded over: the sums are reduced
      once after the scan, in ``jax.shard_map`` or under ``jax.jit`` with a mesh (then the
      batch must divide by ``K * D``).
    loss_scale: ``None`` or ``metrics(opt_state).loss_scale``: the loss comes back unscaled,
      the gradient is that of ``loss * scale``, for ``accumulate(loss_scale=...)`` to divide.
    accumulator_dtype: the carry's dtype; default ``promote_types(dtype, float32)``.
      Gradients come back in the params' dtypes.
    noise_scale: also return the batch's ``NoiseEstimate`` (docs/noise_scale.md).
    aggregate: :func:`optax_accum.aggregate`, as ``accumulate``'s: a fixed denominator
      (a number > 0 or a 0-d array made in the step, checked for its shape only: it must be
      finite and > 0; ``1``: the sum; global under ``axis_name``; needs ``weight_fn``) and
      per-leaf rules (a max, last or FP8 leaf comes back as its reduced value, the FP8 meta
      one physical batch would give). None: the weighted mean (and Flax's FP8 rule).

  Returns:
    ``f -> (value, grads)`` in ``jax.value_and_grad(loss_fn, has_aux=has_aux or
    has_state)``'s structure; with ``noise_scale``, ``((value, estimate), grads)``.

  Raises:
    TypeError, ValueError: for a bad argument, or when ``f`` is traced for an indivisible
      batch, a non-scalar loss or weight, a policy or a scale not finite and > 0 as
      ``loss_scale``, or an ``axis_name`` the mesh lacks.

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
  """
  _check_modes(aux_mode, noise_scale)
  aggregation = _aggregation.check_in_step(aggregate, noise_scale, weight_fn)
  cfg = _Config(
    loss_fn=loss_fn,
    num_microbatches=_checks.positive_int(num_microbatches, "num_microbatches", _SLICES),
    weight_fn=weight_fn,
    has_aux=has_aux,
    has_state=has_state,
    aux_mode=aux_mode,
    strided=strided,
    axis_name=axis_name,
    loss_scale=loss_scale,
    accumulator_dtype=None if accumulator_dtype is None else jnp.dtype(accumulator_dtype),
    noise_scale=noise_scale,
    aggregation=aggregation,
  )
  return lambda params, batch, *args, **kwargs: _value_and_grad(cfg, params, batch, args, kwargs)


_SLICES = "slices of the batch"


def _check_modes(aux_mode: str, noise_scale: Any) -> None:
  if aux_mode not in MODES:
    raise ValueError(f"aux_mode must be one of {MODES}, got {aux_mode!r}.")
  if not isinstance(noise_scale, (bool, np.bool_)):
    raise TypeError(f"noise_scale must be True or False, got {noise_scale!r}.")


def _value_and_grad(
  cfg: _Config, params: PyTree, batch: PyTree, args: tuple, kwargs: dict
) -> tuple[Any, PyTree]:
  """One call of ``f``: split, scan, one reduction over devices, one division."""
  name, axes, mesh = _mesh.resolve(cfg.axis_name, batch)
  if name is None:
    _mesh.check_without_axis_name(params, batch)
  lanes = _mesh.num_lanes(mesh, axes) if name == "jit" else 0
  if lanes and cfg.has_state:
    raise ValueError(
      f"has_state=True with axis_name={cfg.axis_name!r} under jax.jit: every device would "
      "return its own state. Run the step inside jax.shard_map over that axis instead "
      "(each device then threads its own state)."
    )
  micro = split_batch(batch, cfg.num_microbatches, strided=cfg.strided)  # checks and messages
  if lanes:
    micro = _mesh.split_lanes(batch, cfg.num_microbatches, lanes, mesh, axes, cfg.strided)
  state0, args = take_state(cfg.has_state, args)
  scale = _loss_scale.in_force(cfg.loss_scale)
  rules, shares = cfg.aggregation.rules(params), None
  if "grad_amax_history" in rules:  # FP8: every microbatch's backward at the batch's scale
    total = lambda t: _mesh.psum_sums(t, axes) if name == "shard_map" else t
    weights = jax.vmap(functools.partial(_weight_of, cfg))(micro)
    shares, rules = _aggregation.batch_shares(cfg.aggregation, rules, weights, total, lanes)
  one = _microbatch_fn(cfg, _differentiated(params, name, mesh, axes), scale, shares, args, kwargs)
  if lanes:
    mode = _lanes(one, params, mesh, axes, cfg.strided, rules)
  else:
    mode = _local(one, name, mesh, axes, cfg.strided, rules)
  sums, state, stacked = _scan(cfg, mode, micro, state0, shares is not None)
  return _finish(cfg, mode, params, mode.reduce(sums), state, stacked, scale, rules)


def _differentiated(params: PyTree, name: str | None, mesh: Any, axes: tuple[str, ...]) -> PyTree:
  """The params ``jax.grad`` sees: device-varying in ``shard_map`` (so ``check_vma`` does not
  ``psum`` each microbatch's gradient), gathered for ``jit`` lanes (each holds a whole one)."""
  if name == "shard_map":
    return _mesh.to_varying(params, axes)
  if name == "jit":
    return _mesh.gather_over(params, mesh, axes)
  return params


def _scaled_loss(cfg: _Config, params, mb, scale, extra, kwargs):
  """``(loss * scale, (loss, aux, state))``: the loss in its accumulator dtype, float32 or wider."""
  out = cfg.loss_fn(params, mb, *extra, **kwargs)
  loss, aux, state = unpack(cfg.has_aux, cfg.has_state, out)
  loss = jnp.asarray(loss)
  if loss.ndim != 0:
    raise ValueError(f"loss_fn must return a scalar mean loss, got shape {loss.shape}.")
  loss = loss.astype(_numerics.accumulator_dtype(loss.dtype))
  scaled = loss if scale is None else loss * scale.astype(loss.dtype)
  return scaled, (loss, aux, state)


def _weight_of(cfg: _Config, mb: PyTree) -> jax.Array:
  """A microbatch's weight: ``weight_fn(mb)``, or its rows."""
  w = jax.tree.leaves(mb)[0].shape[0] if cfg.weight_fn is None else cfg.weight_fn(mb)
  return _checks.weight(w, "weight_fn(microbatch)")


def _microbatch_fn(cfg: _Config, params, scale, shares, args, kwargs) -> Callable:
  """``one(mb, k, state, lane)``: microbatch ``k``'s ``(loss, aux, new_state, grads, weight)``;
  with ``shares``, the gradient of its loss times its share of the batch's weight."""
  grad_fn = jax.value_and_grad(functools.partial(_scaled_loss, cfg), has_aux=True)

  def one(mb, k, state, lane):
    kw = jax.tree.map(lambda x: _fold_key(x, k, lane), kwargs)
    extra = args if state is None else (state, *args)
    s = scale if shares is None else shares[k] if scale is None else shares[k] * scale
    (_, (loss, aux, new_state)), g = grad_fn(params, mb, s, extra, kw)
    return loss, aux, new_state, g, _weight_of(cfg, mb)

  return one


def _fold_key(x: Any, k: jax.Array, lane: Any) -> Any:
  """A PRNG key (typed, or raw ``uint32[2]``) folded with the microbatch index and lane."""
  typed = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  raw = hasattr(x, "dtype") and x.dtype == jnp.uint32 and np.shape(x) == (2,)
  if not (typed or raw):
    return x
  x = jax.random.fold_in(x, k)
  return x if lane is None else jax.random.fold_in(x, lane)


def _local(one: Callable, name: str | None, mesh: Any, axes, strided, rules) -> _Mode:
  """No ``axis_name`` (``name`` None), or inside ``shard_map``: one ``psum`` after the scan
  (a ``pmax`` before it for max/last leaves)."""
  axis = axes if len(axes) > 1 else axes[0] if axes else None
  reduce = lambda s: s
  if name == "shard_map":
    reduce = lambda sums: _reduce_sums(
      rules, sums, jax.lax.axis_index(axis),
      lambda t: _mesh.psum_sums(t, axes), lambda t: jax.lax.pmax(t, axis),
    )  # fmt: skip
  return _Mode(
    grads_of=lambda mb, k, state: one(mb, k, state, None),
    add=_numerics.weighted_add,
    add_grads=functools.partial(_aggregation.add, rules),
    add_noise=_noise_scale.add,
    zeros=lambda struct, dtype: _mesh.carry_zeros(struct, dtype, mesh, axes, 0),
    reduce=reduce,
    place=lambda grads: grads,
    stack=lambda aux, w: aux,
    concat=lambda aux: _mesh.merge_batch(aux, strided),
    lead=0,
  )


def _lanes(one: Callable, params: PyTree, mesh: Any, axes, strided, rules) -> _Mode:
  """Under ``jit`` with ``axis_name``: one lane per device, the lanes summed after the scan."""
  lanes = _mesh.num_lanes(mesh, axes)
  per_lane = lambda f: jax.vmap(f, spmd_axis_name=_mesh.spmd_axis_name(mesh, axes))

  def grads_of(mb, k, state):  # state is None: has_state is refused here
    lane_ids = _mesh.lane_indices(lanes, mesh, axes)
    loss, aux, _, g, w = per_lane(lambda m, d: one(m, k, None, d))(mb, lane_ids)
    # What does not depend on the data (the default weight, rows) comes out of vmap unsharded,
    # and JAX 0.7 drops a size-1 axis from some outputs: every lane dimension is put on `axes`.
    lane_sharded = lambda t: jax.tree.map(lambda x: _mesh.constrain(x, mesh, axes, 0), t)
    return lane_sharded(loss), lane_sharded(aux), None, lane_sharded(g), lane_sharded(w)

  over_lanes = lambda f: lambda t: jax.tree.map(lambda x: f(x, 0), t)
  return _Mode(
    grads_of=grads_of,
    add=per_lane(_numerics.weighted_add),
    add_grads=per_lane(functools.partial(_aggregation.add, rules)),
    add_noise=per_lane(_noise_scale.add),
    zeros=lambda struct, dtype: _mesh.carry_zeros(struct, dtype, mesh, axes, lanes),
    reduce=lambda sums: _reduce_sums(
      rules, sums, _mesh.lane_indices(lanes, mesh, axes), over_lanes(jnp.sum), over_lanes(jnp.max)
    ),
    place=lambda grads: _mesh.like_params(grads, params),
    stack=_mesh.lane_mean,
    concat=lambda aux: _mesh.merge_lanes(aux, strided),
    lead=1,
  )


def _reduce_sums(rules, sums: _Sums, index, psum, pmax) -> _Sums:
  """The scan's sums reduced over devices or lanes, per rule (``_aggregation.reduce_devices``)."""
  grads, rest = _aggregation.reduce_devices(
    rules, sums.grads, sums._replace(grads=None), sums.weight > 0, index, psum, pmax
  )
  return rest._replace(grads=grads)


def _zero_sums(cfg: _Config, mode: _Mode, micro: PyTree, state0: Any) -> _Sums:
  """The scan's first sums, sized by tracing one microbatch abstractly (no compute is staged)."""
  mb0 = jax.tree.map(lambda x: x[0], micro)
  loss_s, aux_s, _, g_s, w_s = jax.eval_shape(mode.grads_of, mb0, 0, state0)
  carry = lambda s: mode.zeros(s, carry_dtype(s.dtype, cfg.accumulator_dtype))
  grads = jax.tree.map(carry, g_s)
  aux = None
  if cfg.has_aux:
    check_leaves(cfg.aux_mode, aux_s, jax.tree.leaves(mb0)[0].shape[mode.lead], mode.lead)
  if cfg.has_aux and cfg.aux_mode in ("mean", "sum"):
    dtype = sum_dtype if cfg.aux_mode == "sum" else carry_dtype
    aux = jax.tree.map(lambda s: mode.zeros(s, dtype(s.dtype)), aux_s)
  noise = ()
  if cfg.noise_scale:  # (sum_k w_k |g_k|^2, samples), one per lane
    noise = tuple(mode.zeros(w_s, z.dtype) for z in _noise_scale.zeros())
  weight = mode.zeros(w_s, _numerics.scalar_dtype())
  return _Sums(grads, weight, mode.zeros(loss_s, loss_s.dtype), aux, noise)


def _scan(cfg: _Config, mode: _Mode, micro: PyTree, state0: Any, shared: bool):
  """``lax.scan`` over the microbatches: ``(sums, last state, stacked (aux, w) or None)``;
  ``shared``: the gradients are at the batch's scale already (added with weight 1)."""
  stack = cfg.has_aux and cfg.aux_mode in ("stack", "concat")
  # 'sum': every microbatch's aux counts once, weight 0 or not: the batch's sum.
  aux_weight = (lambda w: w) if cfg.aux_mode == "mean" else jnp.ones_like

  def body(carry, xs):
    sums, state = carry
    k, mb = xs
    loss, aux, new_state, g, w = mode.grads_of(mb, k, state)
    noise = mode.add_noise(sums.noise, w, g) if sums.noise else ()
    sums = _Sums(
      grads=mode.add_grads(
        sums.grads, g, (w != 0).astype(w.dtype) if shared else w, sums.weight == 0
      ),  # fmt: skip
      weight=sums.weight + w,
      loss=mode.add(sums.loss, loss, w),
      aux=None if sums.aux is None else mode.add(sums.aux, aux, aux_weight(w)),
      noise=noise,
    )
    return (sums, new_state), ((aux, w) if stack else None)

  carry0 = (_zero_sums(cfg, mode, micro, state0), state0)
  ks = jnp.arange(cfg.num_microbatches, dtype=jnp.int32)
  (sums, state), stacked = jax.lax.scan(body, carry0, (ks, micro))
  return sums, state, stacked


def _finish(cfg: _Config, mode: _Mode, params, sums: _Sums, state, stacked, scale, rules):
  """The one division of the step (by the weight sum or the denominator) and the value's
  structure."""
  d = cfg.aggregation.value(sums.weight, None)
  grads = optax.tree.cast_like(_aggregation.finish(rules, sums.grads, d), params)
  loss = _numerics.guarded_divide(sums.loss, d)
  if cfg.aux_mode == "stack":
    aux = None if stacked is None else mode.stack(*stacked)
  elif cfg.aux_mode == "concat":
    aux = None if stacked is None else mode.concat(stacked[0])
  elif cfg.aux_mode == "sum":
    aux = sums.aux
  else:
    aux = _numerics.guarded_divide(sums.aux, sums.weight)
  value = pack(cfg.has_aux, cfg.has_state, loss, aux, state)
  if cfg.noise_scale:
    value = (value, _noise_estimate(sums, scale))
  return value, mode.place(grads)


def _noise_estimate(sums: _Sums, scale: jax.Array | None) -> _noise_scale.NoiseEstimate:
  """``noise_scale=True``: the batch's noise estimates (one sample per microbatch and lane)."""
  unscaled = sums.weight if scale is None else sums.weight * scale
  norm, _ = _numerics.norm_and_finite(sums.grads, unscaled)
  sq_sum, samples = sums.noise
  return _noise_scale.estimate(sq_sum, samples, sums.weight, norm, scale)


# ------------------------------------------------------------------ what loss_fn returns
# Its output is unpacked into (loss, aux, state) and the value packed back in
# jax.value_and_grad's structure; aux leaves combine over microbatches by aux_mode: 'mean' by
# the loss's weights, 'sum' plainly, 'concat' back into the batch's rows, 'stack' per
# microbatch; a mode that would change a leaf's meaning or shape raises.


MODES = ("mean", "sum", "concat", "stack")


def carry_dtype(dtype: Any, override: Any = None) -> jnp.dtype:
  """The dtype a sum of ``dtype`` values is carried in (integers and bools become float)."""
  dt = jnp.dtype(dtype)
  dt = dt if jnp.issubdtype(dt, jnp.inexact) else _numerics.scalar_dtype()
  return _numerics.accumulator_dtype(dt, override)


def sum_dtype(dtype: Any) -> jnp.dtype:
  """The dtype ``aux_mode='sum'`` carries a leaf in: integers (and bools) stay exact as int32."""
  integer = jnp.issubdtype(dtype, jnp.integer) or jnp.dtype(dtype) == jnp.bool_
  return jnp.dtype(jnp.int32) if integer else carry_dtype(dtype)


def check_leaves(aux_mode: str, aux_s: PyTree, rows: int, lead: int) -> None:
  """Raises where ``aux_mode`` would silently change an aux leaf's meaning or shape."""
  for path, s in jax.tree_util.tree_flatten_with_path(aux_s)[0]:
    shape, name = tuple(s.shape[lead:]), jax.tree_util.keystr(path)
    per_example = len(shape) >= 1 and shape[0] == rows
    if aux_mode in ("mean", "sum") and per_example and rows > 1:
      raise ValueError(
        f"aux leaf {name} has shape {shape}: one row per example of the {rows}-row microbatch. "
        f"aux_mode={aux_mode!r} would combine the microbatches row by row and return {rows} "
        "rows instead of the batch's. Pass aux_mode='concat' for per-example values (back to "
        "the batch's rows and order) or aux_mode='stack' ([K, ...] per microbatch)."
      )
    if aux_mode == "concat" and not per_example:
      raise ValueError(
        f"aux_mode='concat' joins per-example aux leaves ({rows} rows per microbatch), but "
        f"aux leaf {name} has shape {shape}. Return per-example values, or use aux_mode="
        "'mean' (mean metrics) or 'sum' (count and sum metrics)."
      )


def take_state(has_state: bool, args: tuple) -> tuple[Any, tuple]:
  """``(state, rest)``: with ``has_state`` the first extra argument is the threaded state."""
  if not has_state:
    return None, args
  if not args:
    raise TypeError("has_state=True: call f(params, batch, state, *args, **kwargs).")
  return args[0], args[1:]


def unpack(has_aux: bool, has_state: bool, out: Any) -> tuple[Any, Any, Any]:
  """``loss_fn``'s output as ``(loss, aux, state)``, None for a part it does not return."""
  if has_state:
    loss, rest = out
    aux, state = rest if has_aux else (None, rest)
    return loss, aux, state
  loss, aux = out if has_aux else (out, None)
  return loss, aux, None


def pack(has_aux: bool, has_state: bool, loss: Any, aux: Any, state: Any) -> Any:
  """The value in ``jax.value_and_grad(loss_fn, has_aux=has_aux or has_state)``'s structure."""
  if has_state:
    return (loss, (aux, state)) if has_aux else (loss, state)
  return (loss, aux) if has_aux else loss
