"""The numerics of a window boundary: global norm, finite check, clip, mean.

Shared by every boundary of :func:`optax_accum.accumulate`. The sums are read
as few times as possible (see docs/performance.md): the norm and the finite
check come from one pass over the accumulated sum, and the division by the
weight sum (times the loss scale), the clip and the cast are written so that
XLA fuses them into the inner optimizer's first pass.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_accum import _numerics

PyTree = Any


def norm_and_finite(g_sum: PyTree, denom: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Global L2 norm of ``g_sum / denom`` and whether every element of it is finite.

  The common case reads ``g_sum`` once: ``sqrt(sum(g_sum**2)) / |denom|``. When
  that bound is finite and below a quarter of the dtype's maximum, no element
  of the mean can be Inf or NaN. Otherwise (a non-finite window, or a sum of
  squares that overflowed) the exact check and norm of the guarded mean run, so
  the result never differs from ``all_finite`` / ``optax.tree.norm`` of the mean
  except by rounding of the norm.
  """
  leaves = jax.tree.leaves(g_sum)
  if not leaves:
    return jnp.zeros((), denom.dtype), jnp.array(True)
  sq = optax.tree.norm(g_sum, squared=True)
  dtype = _numerics.promote_types(sq.dtype, denom.dtype)
  limit = min(float(jnp.finfo(x.dtype).max) for x in leaves) / 4
  nonzero = denom != 0
  safe = jnp.where(nonzero, denom, jnp.ones_like(denom)).astype(dtype)
  absd = jnp.abs(safe)
  bound = jnp.where(nonzero, jnp.sqrt(sq.astype(dtype)) / absd, jnp.zeros((), dtype))
  fast = jnp.isfinite(bound) & (bound < jnp.asarray(limit, dtype))
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


def clip_to_norm(mean: PyTree, norm: jax.Array, max_norm: float) -> PyTree:
  """``optax.clip_by_global_norm(max_norm)`` given the already computed ``norm``.

  Written as one scalar factor (1 below the threshold, so unclipped windows are
  bit-identical) so that XLA fuses it into the inner optimizer's passes instead
  of materializing the clipped mean; clipped values may differ from optax's
  ``(t / norm) * max_norm`` in the last bit.
  """
  factor = jnp.where(norm < max_norm, jnp.ones_like(norm), max_norm / norm)
  return jax.tree.map(lambda t: t * factor.astype(t.dtype), mean)


def mean(
  g_sum: PyTree, denom: jax.Array, norm: jax.Array, clip_norm: float | None, like: PyTree
) -> PyTree:
  """The window mean as the inner optimizer receives it.

  ``g_sum / denom`` (the one division, guarded), clipped to ``clip_norm``
  given the pre-clip ``norm``, and cast leafwise to the dtypes of ``like``.
  """
  m = _numerics.guarded_divide(g_sum, denom)
  if clip_norm is not None:
    m = clip_to_norm(m, norm, clip_norm)
  return optax.tree.cast_like(m, like)


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
    return _numerics.all_finite(mean(g_sum, denom, norm, clip_norm, like))

  def fits_for_sure(_):  # True, with `bound`'s device variance (shard_map check_vma)
    return jnp.ones_like(bound, dtype=jnp.bool_)

  return jax.lax.cond(bound <= min(limits), fits_for_sure, exact, None)
