"""The arithmetic of accumulation: dtypes, weighted sums, the one division, the boundary math.

Both paths (across-step and in-step) use these helpers, so they round the same
way. Nothing here zeros or selects by multiplying (``0 * nan == nan``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

PyTree = Any


def scalar_dtype() -> jnp.dtype:
  """The dtype of weight sums and other float scalars in our state.

  float32, or float64 when ``jax_enable_x64`` is on (so that float64 runs keep
  float64 weight sums).
  """
  return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))


def promote_types(a: Any, b: Any) -> jnp.dtype:
  """``jnp.promote_types`` that also works under ``jax_numpy_dtype_promotion='strict'``.

  Choosing an accumulator dtype is our explicit decision, not an implicit
  promotion, so it must not raise in strict mode.
  """
  with jax.numpy_dtype_promotion("standard"):
    return jnp.dtype(jnp.promote_types(a, b))


def accumulator_dtype(grad_dtype: Any, override: Any = None) -> jnp.dtype:
  """The accumulator dtype for one gradient leaf.

  Args:
    grad_dtype: dtype of the incoming gradient leaf.
    override: ``None`` for the default rule, else the dtype to use.

  Returns:
    ``promote_types(grad_dtype, float32)`` by default: float32 for bf16, fp16
    and float32 gradients, float64 for float64, complex kept complex. With an
    override, that dtype.

  Raises:
    TypeError: if the gradient is complex and the override is real (the
      imaginary part would be dropped), or either dtype is not inexact.
  """
  grad_dtype = jnp.dtype(grad_dtype)
  if not jnp.issubdtype(grad_dtype, jnp.inexact):
    raise TypeError(
      f"Gradients must be floating point or complex, got a {grad_dtype} leaf. "
      "Pass gradients from jax.grad (integer leaves have no gradient; "
      "filter them out of the params tree, e.g. with optax.masked)."
    )
  if override is None:
    return jnp.dtype(jax.dtypes.canonicalize_dtype(promote_types(grad_dtype, jnp.float32)))
  override = jnp.dtype(override)
  if not jnp.issubdtype(override, jnp.inexact):
    raise TypeError(f"accumulator_dtype must be a float or complex dtype, got {override}.")
  if jnp.issubdtype(grad_dtype, jnp.complexfloating) and not jnp.issubdtype(
    override, jnp.complexfloating
  ):
    raise TypeError(
      f"accumulator_dtype={override} would drop the imaginary part of a {grad_dtype} "
      "gradient. Use a complex accumulator_dtype or leave it as None."
    )
  return override


def weighted_add(acc: PyTree, grads: PyTree, weight: jax.Array) -> PyTree:
  """Returns ``acc + weight * grads`` leafwise, in the accumulator's dtypes.

  A microbatch with ``weight == 0`` adds exactly nothing, even when its gradient
  is NaN (an all-padding microbatch's masked mean is 0/0): selected, not
  multiplied. A (traced) negative weight subtracts its microbatch, consistently
  from the sum and from the weight sum.
  """

  def add(a, g):
    w = weight.astype(a.dtype)
    return a + jnp.where(weight != 0, w * jnp.asarray(g).astype(a.dtype), jnp.zeros((), a.dtype))

  return jax.tree.map(add, acc, grads)


def guarded_divide(tree: PyTree, denom: jax.Array) -> PyTree:
  """Divides every leaf by the scalar ``denom``; leaves are zero where ``denom == 0``.

  This is the one division of a window: the weighted sum by the weight sum
  (times the loss scale). No 0/0 is ever evaluated.
  """
  nonzero = denom != 0
  safe = jnp.where(nonzero, denom, jnp.ones_like(denom))

  def div(x):
    return jnp.where(nonzero, x / safe.astype(x.dtype), jnp.zeros((), x.dtype))

  return jax.tree.map(div, tree)


def all_finite(tree: PyTree) -> jax.Array:
  """One fused reduction: True iff every element of every leaf is finite."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.array(True)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def norm_and_finite(g_sum: PyTree, denom: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Global L2 norm of ``g_sum / denom`` and whether every element of it is finite.

  The common case reads ``g_sum`` once: ``sqrt(sum(g_sum**2)) / |denom|``. When
  that bound is finite and below a quarter of the dtype's maximum, no element
  of the mean can be Inf or NaN. Otherwise (a non-finite window, or a sum of
  squares that overflowed or may have underflowed: below ``tiny / eps``) the
  exact check and norm of the guarded mean (rescaled by its largest element) run, so
  the result never differs from ``all_finite`` / ``optax.tree.norm`` of the mean
  except by rounding of the norm.
  """
  leaves = jax.tree.leaves(g_sum)
  if not leaves:
    return jnp.zeros((), denom.dtype), jnp.array(True)
  sq = optax.tree.norm(g_sum, squared=True)
  dtype = promote_types(sq.dtype, denom.dtype)
  limit = min(float(jnp.finfo(x.dtype).max) for x in leaves) / 4
  nonzero = denom != 0
  safe = jnp.where(nonzero, denom, jnp.ones_like(denom)).astype(dtype)
  absd = jnp.abs(safe)
  bound = jnp.where(nonzero, jnp.sqrt(sq.astype(dtype)) / absd, jnp.zeros((), dtype))
  fast = jnp.isfinite(bound) & (bound < jnp.asarray(limit, dtype))
  # Nor underflow: a sum of squares below tiny / eps may have lost its elements
  # (weight=1e-25 squares to 0 in float32), so the norm would read 0 and
  # clipping would not happen. Such windows (all-zero ones too) take the exact,
  # rescaled path.
  sq_info = jnp.finfo(sq.dtype)
  fast = fast & (sq >= jnp.asarray(float(sq_info.tiny) / float(sq_info.eps), sq.dtype))
  for x in leaves:  # the divisor must not underflow in a narrow accumulator dtype
    fast = fast & (safe.astype(x.dtype) != 0)

  def exact(_):
    # Per leaf, in its dtype: |g_i| / |d| <= max |g| / |d| survives rounding
    # and max propagates NaN, so the mean is finite iff each ratio is. The norm
    # is rescaled by max |g| so that its sum of squares cannot overflow.
    finite = jnp.array(True)
    bigs = []
    for x in leaves:
      big = jnp.max(jnp.abs(x))
      d = jnp.abs(safe.astype(x.dtype)).astype(big.dtype)
      finite = finite & (~nonzero | jnp.isfinite(big / d))
      bigs.append(big.astype(dtype))
    big = jnp.max(jnp.stack(bigs))
    ratio = jnp.where(nonzero, big / absd, jnp.zeros((), dtype))
    inv = jnp.ones((), dtype) / jnp.where(finite & (big > 0), big, jnp.ones((), dtype))
    scaled = jax.tree.map(lambda x: x * inv.astype(x.dtype), g_sum)
    norm = ratio * jnp.sqrt(optax.tree.norm(scaled, squared=True).astype(dtype))
    not_finite = jnp.where(jnp.isnan(sq) | jnp.isnan(big), jnp.nan, jnp.inf).astype(dtype)
    return jnp.where(finite, norm, not_finite), finite

  # The constant True is built from `bound` so that it has the same device variance
  # (shard_map with check_vma=True) as the exact branch's result.
  return jax.lax.cond(fast, lambda _: (bound, jnp.isfinite(bound)), exact, None)


def clip_factor(norm: jax.Array, max_norm: float) -> jax.Array:
  """The scalar ``optax.clip_by_global_norm(max_norm)`` multiplies by, given the ``norm``.

  1 below the threshold (so unclipped windows are bit-identical), else
  ``max_norm / norm``. Clipped values may differ from optax's
  ``(t / norm) * max_norm`` in the last bit.
  """
  return jnp.where(norm < max_norm, jnp.ones_like(norm), max_norm / norm)


def mean_dtypes(grads: PyTree, params: PyTree | None) -> PyTree:
  """Per leaf, the dtype the window mean is handed to the inner optimizer in.

  The wider of the gradient's and the param's dtype (``promote_types``): the
  inner optimizer never computes in a dtype narrower than the gradients it
  would receive without accumulation (fp16 params with float32 gradients get a
  float32 mean: Adam's ``eps`` underflows in fp16), and float32 master params
  keep the float32 mean of bf16/fp16 gradients. Issue 11, item 3.

  Args:
    grads: the gradients (arrays or anything with ``dtype``).
    params: the params, or None (the gradients' dtypes).

  Returns:
    A tree like ``grads`` of ``jax.ShapeDtypeStruct``.

  Examples:
    >>> import jax.numpy as jnp
    >>> g = {'w': jnp.zeros(2, jnp.float32), 'b': jnp.zeros((), jnp.bfloat16)}
    >>> p = {'w': jnp.zeros(2, jnp.float16), 'b': jnp.zeros((), jnp.float32)}
    >>> {k: str(v.dtype) for k, v in mean_dtypes(g, p).items()}
    {'b': 'float32', 'w': 'float32'}
  """
  if params is None:
    return jax.tree.map(lambda g: jax.ShapeDtypeStruct(jnp.shape(g), g.dtype), grads)
  return jax.tree.map(
    lambda g, p: jax.ShapeDtypeStruct(jnp.shape(g), promote_types(g.dtype, p.dtype)),
    grads,
    params,
  )


def window_mean(
  g_sum: PyTree, denom: jax.Array, norm: jax.Array, clip_norm: float | None, like: PyTree
) -> PyTree:
  """The window mean as the inner optimizer receives it.

  ``g_sum * (1 / denom)``, clipped to ``clip_norm`` given the pre-clip global
  ``norm``, cast leafwise to the dtypes of ``like`` (:func:`mean_dtypes`); zeros
  where ``denom == 0``.
  One scalar per window (the reciprocal of ``denom`` times the clip factor)
  multiplies every element, so XLA fuses the mean into the inner optimizer's
  passes instead of materializing it (it does not duplicate a division into its
  consumers). For ``denom`` a power of two (a weight sum of 1, any ``2**k``
  loss scale) this is the exact quotient; otherwise within 1 ulp of it.
  """
  nonzero = denom != 0
  factor = jnp.where(nonzero, 1 / jnp.where(nonzero, denom, jnp.ones_like(denom)), 0)
  if clip_norm is not None:
    factor = factor * clip_factor(norm, clip_norm).astype(factor.dtype)

  def scale(x, t):
    y = jnp.where(nonzero, x * factor.astype(x.dtype), jnp.zeros((), x.dtype))
    return y.astype(t.dtype)

  return jax.tree.map(scale, g_sum, like)


def _narrow(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def updates_finite(
  updates: PyTree, new_inner: PyTree, old_inner: PyTree, like: PyTree
) -> jax.Array | None:
  """Whether the inner optimizer's updates (and its narrowed state) are finite; None: not read.

  Read only where a 16-bit dtype is involved: an update leaf, a leaf of ``like``
  (the mean's and the output's dtypes), or an inner-state leaf kept in 16 bits
  (``old_inner``'s dtype). A finite float32 mean gives finite float32 updates for
  every optax optimizer short of an absurd learning rate, so the common float32
  step pays no pass over the updates. Issue 11, item 3.

  Args:
    updates: the inner optimizer's updates, in their final dtypes.
    new_inner: its new state, cast back to ``old_inner``'s dtypes.
    old_inner: its state before the window.
    like: trees of arrays or shape-dtype structs whose dtypes matter.

  Returns:
    A boolean scalar, or None when nothing 16-bit is involved.

  Examples:
    >>> import jax.numpy as jnp
    >>> u = jnp.array([1.0, jnp.inf], jnp.float16)
    >>> bool(updates_finite(u, (), (), u))
    False
    >>> updates_finite(jnp.ones(2), (), (), jnp.ones(2)) is None
    True
  """
  pairs = zip(jax.tree.leaves(new_inner), jax.tree.leaves(old_inner), strict=True)
  narrowed = [new for new, old in pairs if _narrow(old.dtype)]
  dtypes = [x.dtype for x in jax.tree.leaves((updates, like))]
  if not narrowed and not any(_narrow(d) for d in dtypes):
    return None
  return all_finite((updates, narrowed))


def fits(
  g_sum: PyTree, denom: jax.Array, norm: jax.Array, clip_norm: float | None, like: PyTree
) -> jax.Array:
  """Whether the (finite) window mean stays finite once cast to ``like``'s dtypes.

  A narrower dtype (fp16, max 65504) can overflow in the cast, e.g. under a
  loss scale below 1. No element exceeds the (clipped) global norm, so the
  elements are read only when that bound is above the narrowest target's
  maximum; float32 targets of a float32 accumulator cost nothing.
  """
  pairs = zip(jax.tree.leaves(like), jax.tree.leaves(g_sum), strict=True)
  limits = [
    float(jnp.finfo(t.dtype).max)
    for t, a in pairs
    if jnp.finfo(t.dtype).max < jnp.finfo(a.dtype).max
  ]
  if not limits:
    return jnp.array(True)
  bound = norm if clip_norm is None else jnp.minimum(norm, jnp.asarray(clip_norm, norm.dtype))

  def exact(_):
    return all_finite(window_mean(g_sum, denom, norm, clip_norm, like))

  def fits_for_sure(_):  # True, with `bound`'s device variance (shard_map check_vma)
    return jnp.ones_like(bound, dtype=jnp.bool_)

  return jax.lax.cond(bound <= min(limits), fits_for_sure, exact, None)
