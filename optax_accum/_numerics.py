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
  """The dtype of weight sums and float scalars in our state: float32, float64 under x64."""
  return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))


def promote_types(a: Any, b: Any) -> jnp.dtype:
  """``jnp.promote_types`` that does not raise under ``jax_numpy_dtype_promotion='strict'``."""
  with jax.numpy_dtype_promotion("standard"):
    return jnp.dtype(jnp.promote_types(a, b))


def accumulator_dtype(grad_dtype: Any, override: Any = None) -> jnp.dtype:
  """The accumulator dtype of a gradient leaf: ``override``, or ``promote_types(dtype, float32)``.

  float32 for bf16/fp16/float32, float64 for float64, complex kept complex. TypeError for a
  non-inexact dtype or a real override of a complex gradient (it would drop the imaginary part).
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
  """``acc + weight * grads`` leafwise in the accumulator's dtypes; ``weight == 0`` adds nothing.

  Selected, not multiplied: a weight-0 microbatch's NaN gradient (0/0 of an
  all-padding mask) is not read.
  """

  def add(a, g):
    w = weight.astype(a.dtype)
    return a + jnp.where(weight != 0, w * jnp.asarray(g).astype(a.dtype), jnp.zeros((), a.dtype))

  return jax.tree.map(add, acc, grads)


def guarded_divide(tree: PyTree, denom: jax.Array) -> PyTree:
  """Every leaf divided by the scalar ``denom``; zeros where ``denom == 0`` (no 0/0 evaluated)."""
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
  """Global L2 norm of the mean ``g_sum / denom`` and whether all of it is finite, in one read.

  One sum of squares per leaf (``optax.tree.norm``) of the mean's elements ``x * (1 / denom)``
  (the factor ``window_mean`` multiplies by), each leaf squared in float32 or wider (its own
  dtype if wider, complex kept): finite iff every element is, since IEEE squares and sums
  propagate NaN and Inf (no max is trusted to: XLA:CPU's large reduce-max drops NaN). No
  ``lax.cond`` and no second pass (issue 47: the rescaled branch cost a reduction per leaf and
  12-20% of the step's compile time). A mean whose squared norm is not representable (float32:
  norm >= 2**64, about 1.8e19) counts as not finite, as under ``shard_optimizer=True`` and as
  Adam's second moment would become Inf with it; so does one whose norm is not below every leaf
  dtype's max. A mean all of whose squares underflow (elements below about 1e-19 in float32)
  reports its norm rounded towards 0, as ``optax.tree.norm``.

  Returns:
    ``(norm, finite)``: 0-d, the norm in the widest of float32, ``denom``'s and the leaves' real
    dtypes (NaN if an element is NaN, else Inf, where not finite), and a bool.

  Examples:
    >>> norm, finite = norm_and_finite({'a': jnp.array([6.0, 8.0])}, jnp.float32(2.0))
    >>> float(norm), bool(finite)  # |(3, 4)|
    (5.0, True)
  """
  leaves = jax.tree.leaves(g_sum)
  if not leaves:
    return jnp.zeros((), denom.dtype), jnp.array(True)
  factor = _reciprocal(denom)

  def mean(x):  # squared in float32 or wider: a float16 leaf's squares overflow at 256
    wide = promote_types(x.dtype, jnp.float32)
    return x.astype(wide) * factor.astype(jnp.finfo(wide).dtype)

  dtype = promote_types(denom.dtype, jnp.float32)
  for x in leaves:
    dtype = promote_types(dtype, jnp.finfo(x.dtype).dtype)  # the real part's dtype
  sq = optax.tree.norm(jax.tree.map(mean, g_sum), squared=True).astype(dtype)
  norm = jnp.sqrt(sq)
  finite = jnp.isfinite(norm)
  for dt in {x.dtype for x in leaves}:  # each element of the mean fits the leaf's dtype
    finite = finite & (norm < jnp.asarray(float(jnp.finfo(dt).max), dtype))
  return jnp.where(finite | jnp.isnan(norm), norm, jnp.inf), finite


def mean_dtypes(grads: PyTree, params: PyTree | None) -> PyTree:
  """Per leaf, the dtype the inner optimizer gets the window mean in: the wider of grad and param.

  Never narrower than the gradients (Adam's ``eps`` underflows in fp16), and float32 master
  params keep the float32 mean of bf16 gradients. ``params=None``: the gradients' dtypes.

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


def window_mean(g_sum: PyTree, denom: jax.Array, like: PyTree) -> PyTree:
  """``g_sum * (1 / denom)``, cast to ``like``'s dtypes.

  One scalar multiplies every element, so XLA fuses the mean into the inner
  optimizer (docs/performance.md); exact for a power-of-two ``denom``, else 1 ulp.
  """
  nonzero = denom != 0
  factor = _reciprocal(denom)

  def scale(x, t):
    y = jnp.where(nonzero, x * factor.astype(x.dtype), jnp.zeros((), x.dtype))
    return y.astype(t.dtype)

  return jax.tree.map(scale, g_sum, like)


def _reciprocal(denom: jax.Array) -> jax.Array:
  """``1 / denom``, 0 where ``denom == 0`` (no division by zero evaluated); ``denom``'s dtype."""
  nonzero = denom != 0
  return jnp.where(nonzero, 1 / jnp.where(nonzero, denom, jnp.ones_like(denom)), 0)


def _narrow(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def updates_finite(
  updates: PyTree, new_inner: PyTree, old_inner: PyTree, like: PyTree, params: PyTree = None
) -> jax.Array | None:
  """Whether the inner updates, 16-bit inner state and 16-bit new params are finite.

  A 16-bit param is checked as ``optax.apply_updates`` makes it, ``(p + u).astype(p.dtype)``
  (a finite float32 update can overflow an fp16 param). None if no 16-bit dtype.

  A finite float32 mean gives finite float32 updates, so float32 steps skip the pass.
  ``like``: the trees whose dtypes decide whether anything is 16-bit.

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
  applied = []
  if params is not None:
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(updates), strict=True)
    wide = lambda p, u: promote_types(p.dtype, u.dtype)
    applied = [
      (p.astype(wide(p, u)) + u.astype(wide(p, u))).astype(p.dtype)
      for p, u in pairs
      if _narrow(p.dtype)
    ]
  dtypes = [x.dtype for x in jax.tree.leaves((updates, like))]
  if not narrowed and not applied and not any(_narrow(d) for d in dtypes):
    return None
  return all_finite((updates, narrowed, applied))


def fits(g_sum: PyTree, denom: jax.Array, norm: jax.Array, like: PyTree) -> jax.Array:
  """Whether the finite window mean stays finite cast to ``like``'s (maybe fp16) dtypes.

  Elements are read only when the norm exceeds the narrowest target's max.
  """
  pairs = zip(jax.tree.leaves(like), jax.tree.leaves(g_sum), strict=True)
  limits = [
    float(jnp.finfo(t.dtype).max)
    for t, a in pairs
    if jnp.finfo(t.dtype).max < jnp.finfo(a.dtype).max
  ]
  if not limits:
    return jnp.array(True)
  bound = norm

  def exact(_):
    return all_finite(window_mean(g_sum, denom, like))

  def fits_for_sure(_):  # True, with `bound`'s device variance (shard_map check_vma)
    return jnp.ones_like(bound, dtype=jnp.bool_)

  return jax.lax.cond(bound <= min(limits), fits_for_sure, exact, None)
