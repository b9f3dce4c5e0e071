"""XLA buffer placement: helpers that change where values live, never what they are.

Nothing here is arithmetic; each helper exists because of how XLA compiles a
``jax.jit`` step, and each has a test that fails if a JAX upgrade changes that
behaviour (docs/design.md lists them):

* :func:`zeros_like_placed` builds the accumulator in ``init``. Under ``jit``,
  ``jnp.zeros_like(x)`` is a constant with no tie to ``x``, so the compiler puts
  it on one device (or replicates it under ``jax.set_mesh``) while the params
  are sharded. Selecting from ``x`` with an all-False mask ties the zeros to
  ``x``'s sharding; XLA folds the select away, so nothing of ``x`` is read.
  Caught by ``tests/test_sharding.py`` (the accumulator follows the params
  under plain ``jax.jit(tx.init)``).
* :func:`distinct_zeros` writes exact zeros from inside a ``lax.cond``: zero
  updates for leaves the accumulator cannot hold (see :func:`stash_fits`), and
  the accumulator's reset after a skipped or empty window. Plain
  ``jnp.zeros_like`` per leaf gives equal broadcasts, which XLA merges into one
  buffer; returning one buffer in several outputs of a conditional then costs a
  full copy per extra leaf. Zeros computed from a traced flag, with a different
  constant per leaf, stay distinct. Caught by ``tests/test_buffers.py`` (no
  parameter-sized copy in the compiled step).
* :func:`open_window` and :func:`stash` let the accumulator's buffer serve
  twice (the lazy reset): at an applied boundary the inner optimizer's updates
  are written into the accumulator's buffer (:func:`stash`; they are returned
  from there), and the window's sum is not zeroed; the next microbatch reads
  the buffer as zeros because ``mini_step == 0`` (:func:`open_window`, fused
  into the pass that adds it). So no microstep writes a separate buffer of
  zero updates (a gradient-sized temporary that XLA:CPU allocates, and the
  kernel page-faults in, on every call) and no boundary writes zeros. Caught by
  ``tests/test_buffers.py`` (no gradient-sized temporary at all on the default
  optax path).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def zeros_like_placed(x: jax.Array, dtype: Any) -> jax.Array:
  """Zeros with ``x``'s shape and sharding in ``dtype``, also when traced under ``jit``.

  Args:
    x: an array (traced or not).
    dtype: the dtype of the zeros.

  Returns:
    Exact zeros; a NaN in ``x`` cannot leak (selected, not multiplied).
  """
  return jnp.where(jnp.zeros(jnp.shape(x), jnp.bool_), x.astype(dtype), jnp.zeros((), dtype))


def distinct_zeros(like: PyTree, flag: jax.Array) -> PyTree:
  """Exact zeros shaped like ``like``, one distinct computation per leaf.

  Each leaf is ``broadcast(min(b + i + 1, i + 1) - (i + 1))`` with
  ``b = flag.astype(int32)`` in ``{0, 1}``: exactly zero for either value of
  ``flag``, different per leaf ``i``, and dependent on a traced value, so XLA
  neither merges the leaves nor computes them before ``flag`` exists.

  Args:
    like: a tree of arrays (or shape-dtype structs) to match.
    flag: a boolean scalar array.

  Returns:
    A tree like ``like`` of exact zeros in each leaf's dtype and sharding.
  """
  b = jnp.asarray(flag).astype(jnp.int32)
  leaves, treedef = jax.tree.flatten(like)
  out = []
  for i, x in enumerate(leaves):
    k = jnp.int32(i + 1)
    zero = jnp.minimum(b + k, k) - k
    out.append(jnp.full_like(x, zero.astype(x.dtype)))  # keeps x's sharding
  return jax.tree.unflatten(treedef, out)


def read_token(tree: PyTree) -> jax.Array:
  """A boolean scalar that depends on ``tree``'s values, a flag for :func:`distinct_zeros`.

  Reduces the smallest non-empty leaf (e.g. Adam's step count), so it costs one
  read of that leaf and works on any sharding.

  Args:
    tree: a tree of arrays (what the boundary computed last).

  Returns:
    A bool 0-d array.
  """
  leaves = sorted((x for x in jax.tree.leaves(tree) if jnp.size(x)), key=jnp.size)
  if not leaves:
    return jnp.zeros((), jnp.bool_)
  return jnp.any(leaves[0] == 0)


def open_window(acc: PyTree, mini_step: jax.Array) -> PyTree:
  """The open window's weighted sum: ``acc``, read as zeros while the window is empty.

  An empty window (``mini_step == 0``: after ``init``, a boundary or
  ``discard``) may hold scratch in ``acc`` (the last window's updates, see
  :func:`stash`); it is selected away, never multiplied.

  Args:
    acc: the accumulator tree.
    mini_step: int32 0-d array, microbatches in the open window.

  Returns:
    A tree like ``acc``.
  """
  empty = mini_step == 0
  return jax.tree.map(lambda a: jnp.where(empty, jnp.zeros((), a.dtype), a), acc)


def stash_fits(updates: PyTree, acc: PyTree) -> PyTree:
  """Per leaf, whether an update of that dtype is held exactly in the accumulator's dtype.

  True when the shapes match and every value of the update's dtype is a value
  of the accumulator's (bf16, fp16 or float32 updates in a float32
  accumulator; decided from ``finfo``, so ``jax_numpy_dtype_promotion=strict``
  does not matter); such leaves travel in the accumulator's
  buffer (:func:`stash`), the others in a buffer of their own.

  Args:
    updates: a tree of arrays or shape-dtype structs (the updates).
    acc: the accumulator tree, same structure.

  Returns:
    A tree of Python bools like ``updates``.
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

  return jax.tree.map(holds, updates, acc)


def stash(updates: PyTree, acc: PyTree, fits: PyTree) -> PyTree:
  """``updates`` in the accumulator's dtype where they fit, else ``acc`` unchanged (scratch)."""
  return jax.tree.map(lambda f, u, a: u.astype(a.dtype) if f else a, fits, updates, acc)
