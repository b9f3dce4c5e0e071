"""Names that left the top level in 0.2, kept importable for one release with a warning.

``optax_accum.<old name>`` still works and warns with the new spelling
(CHANGELOG.md, "Deprecated"). Nothing in the package uses these.

See docs/design.md for the module map.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import jax
import optax

from optax_accum._metrics import metrics

PyTree = Any

# old top-level name -> (module it lives in now, the spelling to use instead)
MOVED = {
  "abstract_state": ("optax_accum.sharding", "optax_accum.sharding.abstract_state"),
  "check_compatible": ("optax_accum.sharding", "optax_accum.sharding.check_compatible"),
  "init_sharded": ("optax_accum.sharding", "optax_accum.sharding.init_sharded"),
  "local_state": ("optax_accum.sharding", "optax_accum.sharding.local_state"),
  "stack_windows": ("optax_accum.sharding", "optax_accum.sharding.stack_windows"),
  "stacked_state": ("optax_accum.sharding", "optax_accum.sharding.stacked_state"),
  "state_shardings": ("optax_accum.sharding", "optax_accum.sharding.state_shardings"),
  "window_specs": ("optax_accum.sharding", "optax_accum.sharding.window_specs"),
  "count_collectives": ("optax_accum.testing", "optax_accum.testing.count_collectives"),
  "StaticLossScale": ("optax_accum._loss_scale", "optax_accum.static_loss_scale(...)"),
  "DynamicLossScale": ("optax_accum._loss_scale", "optax_accum.dynamic_loss_scale(...)"),
  "apply_if_updated": (
    "optax_accum._deprecated",
    "optax_accum.update_and_apply(tx, grads, opt_state, params, ...)",
  ),
}


def lookup(name: str) -> Any:
  """The object an old top-level ``name`` refers to, with a ``DeprecationWarning``."""
  module, instead = MOVED[name]
  warnings.warn(
    f"optax_accum.{name} is deprecated and leaves the top level in the next release; "
    f"use {instead}.",
    DeprecationWarning,
    stacklevel=3,
  )
  return getattr(importlib.import_module(module), name)


def apply_if_updated(params: PyTree, updates: PyTree, opt_state: PyTree) -> PyTree:
  """Deprecated: ``optax.apply_updates`` run only when the call applied an update.

  Use :func:`optax_accum.update_and_apply`, which is faster and correct for any
  ``tx``; this skipped the apply between boundaries, which is wrong when a
  transformation after ``accumulate`` turns zero updates into non-zero ones.

  Args:
    params: the current params.
    updates: the updates ``tx.update`` returned.
    opt_state: the state that same call returned (contains one accumulation state).

  Returns:
    ``params + updates`` if the call applied an update, else ``params``.
  """
  return jax.lax.cond(
    metrics(opt_state).updated, optax.apply_updates, lambda p, u: p, params, updates
  )
