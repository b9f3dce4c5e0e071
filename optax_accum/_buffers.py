"""XLA buffer placement: helpers that change where values live, never what they are.

Each helper exists because of how XLA compiles a ``jax.jit`` step; a test fails if a JAX
upgrade changes that:

* :func:`zeros_like_placed` (``init``): ``jnp.zeros_like`` under ``jit`` is a constant on one
  device; a select from ``x`` ties the zeros to ``x``'s sharding (``tests/test_sharding.py``).
* :func:`distinct_zeros` (in a ``lax.cond``): equal broadcasts would be merged into one
  buffer, costing a copy per extra output leaf (``tests/test_buffers.py``).
* :class:`UpdatesOut` (``Output.UPDATES``, ``tx.update``): the lazy reset. The
  updates are written into the accumulator's buffer and returned from there; the
  next microbatch reads it as zeros because ``mini_step == 0``, so no microstep
  writes a gradient-sized buffer of zeros. :class:`ParamsOut`
  (``Output.PARAMS``, :func:`optax_accum.update_and_apply`) returns the params,
  written by the inner optimizer's last pass (``tests/test_buffers.py``).
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum._vma import varying

PyTree = Any


def zeros_like_placed(x: jax.Array, dtype: Any) -> jax.Array:
  """Exact zeros with ``x``'s shape and sharding in ``dtype``, also under ``jit``.

  Selected, not multiplied: a NaN in ``x`` cannot leak.
  """
  return jnp.where(jnp.zeros(jnp.shape(x), jnp.bool_), x.astype(dtype), jnp.zeros((), dtype))


def distinct_zeros(like: PyTree, flag: jax.Array) -> PyTree:
  """Exact zeros shaped like ``like``, one distinct buffer per leaf, one kernel per shape.

  An array leaf ``x`` becomes ``where(never, x, 0)``, ``never = flag.astype(int32) > 1`` (false
  for either value of ``flag``, which XLA cannot prove): exactly zero (a NaN in ``x`` cannot
  leak), a computation of ``x`` itself, so XLA neither merges equal leaves into one buffer nor
  computes them before ``flag`` exists, while leaves of one shape share one fused kernel
  (compile time stays flat in the number of leaves; issue 47). A leaf without values (a
  ``jax.ShapeDtypeStruct``) is a broadcast of a zero made distinct by a per-leaf constant.
  Each leaf keeps its dtype and sharding.
  """
  b = jnp.asarray(flag).astype(jnp.int32)
  never = b > 1
  leaves, treedef = jax.tree.flatten(like)
  out = []
  for i, x in enumerate(leaves):
    if isinstance(x, jax.Array):
      out.append(jnp.where(never, x, jnp.zeros((), x.dtype)))
      continue
    k = jnp.int32(i + 1)
    zero = jnp.minimum(b + k, k) - k
    out.append(_full_like(x, zero.astype(x.dtype)))  # keeps x's sharding
  return jax.tree.unflatten(treedef, out)


def _full_like(x: Any, fill: jax.Array) -> jax.Array:
  """``jnp.full_like(x, fill)``; on JAX 0.7, whose ``full_like`` cannot take a device-varying
  ``fill`` (it ``pvary``-s it again), zeros like ``x`` plus ``fill``, typed the same."""
  try:
    return jnp.full_like(x, fill)
  except ValueError:
    return jnp.zeros_like(x) + fill


def read_token(tree: PyTree) -> jax.Array:
  """A boolean scalar that depends on ``tree``'s values, a flag for :func:`distinct_zeros`.

  Reduces the smallest non-empty leaf (e.g. Adam's step count): one read of that leaf, on
  any sharding. A bool 0-d array.
  """
  leaves = sorted((x for x in jax.tree.leaves(tree) if jnp.size(x)), key=jnp.size)
  if not leaves:
    return jnp.zeros((), jnp.bool_)
  return jnp.any(leaves[0] == 0)


def stash_fits(updates: PyTree, acc: PyTree) -> PyTree:
  """Per leaf, whether an update of that dtype is held exactly in the accumulator's dtype.

  True when the shapes match and every value of the update's dtype is one of the
  accumulator's (bf16, fp16 or float32 in float32; from ``finfo``, so strict dtype
  promotion does not matter). Such leaves travel in the accumulator's buffer
  (:func:`stash`), the others in their own. A tree of Python bools like ``updates``.
  """

  def holds(u, a):
    if u.shape != a.shape:
      return False
    if u.dtype == a.dtype:
      return True
    if not (jnp.issubdtype(u.dtype, jnp.floating) and jnp.issubdtype(a.dtype, jnp.floating)):
      return False
    fu, fa = jnp.finfo(u.dtype), jnp.finfo(a.dtype)  # every u value is an a value
    return fa.nmant >= fu.nmant and fa.maxexp >= fu.maxexp and fa.minexp <= fu.minexp

  # Under shard_map with axis_name the accumulator is per device and the updates are
  # replicated: such leaves get a buffer of their own too.
  same = lambda u, a: holds(u, a) and varying(u) == varying(a)
  return jax.tree.map(same, updates, acc)


def stash(updates: PyTree, acc: PyTree, fits: PyTree) -> PyTree:
  """``updates`` in the accumulator's dtype where they fit, else ``acc`` unchanged (scratch)."""
  return jax.tree.map(lambda f, u, a: u.astype(a.dtype) if f else a, fits, updates, acc)


class Output(enum.Enum):
  """What a step returns: the updates (``tx.update``) or the new params (``update_and_apply``)."""

  UPDATES = "updates"
  PARAMS = "params"


def placement(output: Output, like_updates: PyTree, grad_sum: PyTree) -> UpdatesOut | ParamsOut:
  """The placement of ``output``'s mode for a step with these update dtypes and accumulator."""
  if output is Output.PARAMS:
    return ParamsOut()
  return UpdatesOut(stash_fits(like_updates, grad_sum), like_updates)


def _own(updates: PyTree, fits: PyTree) -> PyTree:
  """The update leaves that travel in a buffer of their own (None where ``grad_sum`` holds them)."""
  return jax.tree.map(lambda f, u: None if f else u, fits, updates)


class UpdatesOut(NamedTuple):
  """``Output.UPDATES``: the boundary's updates leave in the accumulator's buffer (lazy reset).

  Attributes:
    fits: per update leaf, whether the accumulator's buffer holds it (:func:`stash_fits`).
    like: the updates' shapes and dtypes (the zeros between boundaries).
  """

  fits: PyTree
  like: PyTree

  def between(self, params: PyTree, boundary: jax.Array) -> PyTree:
    """The non-boundary output: exact zeros for the leaves with a buffer of their own."""
    del params
    return _own(distinct_zeros(self.like, boundary), self.fits)

  def applied(self, updates: PyTree, params: PyTree, grad_sum: PyTree) -> tuple[PyTree, PyTree]:
    """The applied boundary's ``(output, accumulator)``: the window's sum is dead now."""
    del params
    return _own(updates, self.fits), stash(updates, grad_sum, self.fits)

  def overwrite(self, split, out: PyTree, values: PyTree, params: PyTree, keep) -> PyTree:
    """Overwritten leaves (``reduce=``): their updates are already ``value - param``."""
    del split, values, params, keep
    return out

  def skipped(self, params: PyTree, grad_sum: PyTree, flag: jax.Array) -> tuple[PyTree, PyTree]:
    """A skipped or empty window: zeros out, and zeros in the accumulator (nothing stays)."""
    return self.between(params, flag), distinct_zeros(grad_sum, flag)

  def after_inner(self, before: PyTree, after: PyTree, inner_state: PyTree, out: PyTree) -> PyTree:
    """The accumulator after the inner optimizer's cond: as that cond left it (``after``)."""
    del before, inner_state, out
    return after

  def result(self, out: PyTree, grad_sum: PyTree, updated: jax.Array) -> PyTree:
    """The updates: read from the accumulator (selected by ``updated``) or their own buffer."""

    def leaf(f, o, a, u):
      return jnp.where(updated, a.astype(u.dtype), jnp.zeros((), u.dtype)) if f else o

    return jax.tree.map(leaf, self.fits, out, grad_sum, self.like, is_leaf=lambda x: x is None)


class ParamsOut(NamedTuple):
  """``Output.PARAMS``: the params are the output; the accumulator is reset with zeros."""

  def between(self, params: PyTree, boundary: jax.Array) -> PyTree:
    """The non-boundary output: the params, untouched in their (donated) buffer."""
    del boundary
    return params

  def applied(self, updates: PyTree, params: PyTree, grad_sum: PyTree) -> tuple[PyTree, None]:
    """``params + updates``, written by the inner optimizer's last pass."""
    del grad_sum
    return optax.apply_updates(params, updates), None

  def overwrite(self, split, out: PyTree, values: PyTree, params: PyTree, keep) -> PyTree:
    """Overwritten leaves (``reduce=``) set to their window value exactly, not ``p + (v - p)``."""
    return split.overwrite_params(out, values, params, keep)

  def skipped(self, params: PyTree, grad_sum: PyTree, flag: jax.Array) -> tuple[PyTree, None]:
    """A skipped or empty window: the params unchanged."""
    del grad_sum, flag
    return params, None

  def after_inner(self, before: PyTree, after: None, inner_state: PyTree, out: PyTree) -> PyTree:
    """Zeros written into the accumulator's buffer (``before``) once the inner optimizer read it.

    They wait for a token read from its output, so XLA reuses the buffer.
    """
    del after
    return distinct_zeros(before, read_token((inner_state, out)))

  def result(self, out: PyTree, grad_sum: PyTree, updated: jax.Array) -> PyTree:
    """The new params, as the cond returned them."""
    del grad_sum, updated
    return out
