"""XLA buffer placement: two helpers that change where values live, never what they are.

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
* :func:`distinct_zeros` writes exact zeros from inside a ``lax.cond``: the
  zero updates of a non-boundary microstep, and the accumulator's reset at a
  boundary. Plain ``jnp.zeros_like`` per leaf gives equal broadcasts, which XLA
  merges into one buffer; returning one buffer in several outputs of a
  conditional then costs a full copy per extra leaf. And zeros that depend on
  nothing may be scheduled before the last read of the buffer they overwrite,
  which costs a copy of the whole accumulator. Zeros computed from a traced
  flag, with a different constant per leaf, stay distinct and wait for the
  flag: for the reset the flag is :func:`read_token` of the inner optimizer's
  output, so the zeros go into the accumulator's own buffer after the inner
  optimizer has read it. Caught by ``tests/test_buffers.py`` (no
  parameter-sized copy and at most one gradient-sized temporary in the
  compiled step).
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
