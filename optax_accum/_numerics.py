"""Numerics shared by every accumulation path: dtypes, weights, guarded division.

Both the across-step :func:`optax_accum.accumulate` and the in-step
:func:`optax_accum.microbatched_value_and_grad` use these helpers, so the two
paths round the same way. Nothing here zeros or selects by multiplying
(``0 * nan == nan``): selection is ``jnp.where`` / ``lax.select``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

# Counters are int32 and saturate here instead of wrapping to negative values.
COUNTER_MAX = np.iinfo(np.int32).max


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


def check_weight(weight: Any, name: str = "weight") -> jax.Array:
  """Validates a microbatch weight and returns it as a scalar array.

  Args:
    weight: a non-negative scalar (Python number, NumPy or JAX array, traced or
      not): the number of examples or unmasked tokens the microbatch's mean
      loss averages over.
    name: the argument's name for error messages.

  Returns:
    A 0-d array of :func:`scalar_dtype`.

  Raises:
    ValueError: if the weight is not a scalar, or is concrete and negative or
      not finite.
    TypeError: if the weight is complex or not numeric.
  """
  if weight is None or isinstance(weight, (str, bytes)):
    raise TypeError(
      f"{name} must be a number (examples or unmasked tokens), got {weight!r}. "
      f"Pass e.g. {name}=mask.sum() or {name}=x.shape[0]."
    )
  if isinstance(weight, bool) or (
    hasattr(weight, "dtype") and jnp.dtype(weight.dtype) == jnp.bool_
  ):
    raise TypeError(
      f"{name} must be a number (examples or unmasked tokens), got a boolean. "
      f"Pass e.g. {name}=mask.sum()."
    )
  if np.ndim(weight) != 0:
    raise ValueError(
      f"{name} must be a scalar (the number of examples or unmasked tokens in this "
      f"microbatch), got shape {np.shape(weight)}. Sum it first, e.g. {name}=mask.sum()."
    )
  dtype = jnp.result_type(weight)
  if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
    raise TypeError(f"{name} must be a real number, got dtype {dtype}.")
  if not isinstance(weight, jax.core.Tracer):
    value = float(np.asarray(weight))
    if not np.isfinite(value) or value < 0:
      raise ValueError(
        f"{name} must be finite and non-negative, got {value}. A microbatch with no "
        f"real examples has {name}=0; a negative {name} has no meaning."
      )
  return jnp.asarray(weight).astype(scalar_dtype())


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


def saturating_increment(counter: jax.Array, pred: Any = True) -> jax.Array:
  """``counter + 1`` where ``pred``, never past :data:`COUNTER_MAX`."""
  bumped = jnp.where(counter >= COUNTER_MAX, counter, counter + jnp.ones_like(counter))
  return jnp.where(pred, bumped, counter)


def zeros_like_placed(x: jax.Array, dtype: Any) -> jax.Array:
  """Zeros with ``x``'s shape and sharding in ``dtype``, also when traced under ``jit``.

  Under ``jit`` ``jnp.zeros_like`` is a constant with no tie to ``x``, so the
  compiler puts it on one device (or replicates it under ``jax.set_mesh``).
  Selecting from ``x`` with an all-False mask ties the zeros to ``x``'s
  sharding; XLA folds the select away, so nothing of ``x`` is read and a NaN in
  ``x`` cannot leak (selected, not multiplied).
  """
  return jnp.where(jnp.zeros(jnp.shape(x), jnp.bool_), x.astype(dtype), jnp.zeros((), dtype))


def ordered_zeros(like: PyTree, after: Any) -> PyTree:
  """Exact zeros shaped like ``like`` that XLA computes only once ``after`` exists.

  A buffer-reuse helper for branches of ``lax.cond``: zeros written with a plain
  ``jnp.zeros_like`` depend on nothing, so XLA may not schedule them after the
  last read of the buffer they overwrite and inserts a full copy instead; and
  equal broadcasts of the same shape are merged into one, which costs a copy per
  extra leaf. Here each leaf is ``broadcast(min(b + i + 1, i + 1) - (i + 1))``
  with ``b = after.astype(int32)`` in ``{0, 1}``: exactly zero for any ``after``,
  distinct per leaf, and data-dependent on ``after``.

  Args:
    like: a tree of arrays (or shape-dtype structs) to match.
    after: a boolean scalar array; the zeros are ordered after it is computed.

  Returns:
    A tree like ``like`` of exact zeros in each leaf's dtype.
  """
  b = jnp.asarray(after).astype(jnp.int32)
  leaves, treedef = jax.tree.flatten(like)
  out = []
  for i, x in enumerate(leaves):
    k = jnp.int32(i + 1)
    zero = jnp.minimum(b + k, k) - k
    out.append(jnp.full_like(x, zero.astype(x.dtype)))  # keeps x's sharding
  return jax.tree.unflatten(treedef, out)


def read_token(tree: PyTree) -> jax.Array:
  """A boolean scalar that depends on ``tree``'s values (reads one element).

  Pass it as ``after`` to :func:`ordered_zeros` so that the zeros are written
  only after whatever produced ``tree`` (and everything it read) has run. It
  reads the first element of the smallest non-empty leaf, or, where that slice
  is not allowed (a dimension sharded in ``jax.sharding.AxisType.Explicit``
  mode), reduces that leaf.
  """
  leaves = sorted((x for x in jax.tree.leaves(tree) if np.size(x)), key=np.size)
  if not leaves:
    return jnp.zeros((), jnp.bool_)
  x = leaves[0]
  try:
    return x[(0,) * np.ndim(x)] == 0
  except Exception:  # noqa: BLE001 - e.g. ShardingTypeError; the reduction always works
    return jnp.any(x == 0)
