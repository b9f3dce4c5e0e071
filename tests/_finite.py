"""Shared test helper: the whole optimizer state is finite (issue 11, item 1)."""

import jax
import jax.numpy as jnp
import numpy as np


def assert_state_finite(state):
  """Asserts that every inexact leaf of ``state`` (any nesting, inner state included) is finite.

  The contract of ``accumulate``: with finite gradients fed in, no NaN or Inf
  ever sits in the state ("no value yet" is a flag, not NaN). Leaves are read
  on the host, so a sharded or stacked state works too.
  """
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  assert leaves, "the state has no leaves"
  for path, leaf in leaves:
    x = np.asarray(leaf)
    if jnp.issubdtype(x.dtype, jnp.inexact):
      assert np.all(np.isfinite(x)), f"state{jax.tree_util.keystr(path)} is not finite: {x}"
