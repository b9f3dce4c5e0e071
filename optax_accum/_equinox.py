"""Equinox models as params: a whole ``eqx.Module`` is refused, with the filter that fixes it.

An ``eqx.Module`` holds non-array leaves beside its arrays (``eqx.nn.MLP``'s activation
functions, Python numbers). Optax's optimizers, ``accumulate`` among them, keep a state for
array leaves only; Equinox's pattern passes them the arrays, ``eqx.filter(model, eqx.is_array)``,
and applies the updates with ``eqx.apply_updates(model, updates)``. Equinox is detected through
its public types, and only where it is already imported: this module never imports it.
"""

from __future__ import annotations

import sys
from typing import Any

import jax


def check_params(params: Any) -> None:
  """Raises ``TypeError`` when ``params`` is (or holds) an ``eqx.Module`` with non-array leaves.

  Args:
    params: what ``accumulate(...).init`` got.

  Raises:
    TypeError: naming the first leaf that is not an array (its key path and type) and the
      fix, ``eqx.filter(model, eqx.is_array)``. A module filtered that way (``None`` where the
      leaves were not arrays) passes.

  Examples:
    >>> import equinox as eqx
    >>> from optax_accum._equinox import check_params
    >>> model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    >>> check_params(eqx.filter(model, eqx.is_array))  # arrays only: nothing to say
    >>> check_params(eqx.nn.Lambda(jax.nn.relu))
    Traceback (most recent call last):
    TypeError: accumulate(...).init got an eqx.Module whose leaf .fn is a ...
  """
  eqx = sys.modules.get("equinox")
  if eqx is None:
    return
  is_module = lambda x: isinstance(x, eqx.Module)
  if not any(is_module(x) for x in jax.tree.leaves(params, is_leaf=is_module)):
    return
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not eqx.is_array(leaf):
      raise TypeError(
        f"accumulate(...).init got an eqx.Module whose leaf {jax.tree_util.keystr(path)} is a "
        f"{type(leaf).__name__}, not an array: an optimizer state holds arrays only. Pass the "
        "model's arrays, eqx.filter(model, eqx.is_array), to tx.init and tx.update (the "
        "gradients of eqx.filter_grad have that structure), and apply the updates with "
        "eqx.apply_updates(model, updates)."
      )
