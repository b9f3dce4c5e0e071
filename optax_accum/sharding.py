"""Scale-out and checkpoint helpers for :func:`optax_accum.accumulate`.

Placement of the whole state like the params under ``jax.jit``
(:func:`init_sharded`, :func:`state_shardings`); per-device windows under
``jax.shard_map`` with ``accumulate(..., axis_name=...)`` (:func:`window_specs`,
:func:`stack_windows`, :func:`local_state`, :func:`stacked_state`); and
resuming from a checkpoint (:func:`abstract_state`, :func:`check_compatible`,
:func:`migrate_state` for a run started with or without accumulation).
See docs/scaling.md for when to use which, and docs/design.md for the modules.
"""

from optax_accum._resume import abstract_state, check_compatible, migrate_state
from optax_accum._sharding import (
  init_sharded,
  local_state,
  stack_windows,
  stacked_state,
  state_shardings,
  window_specs,
)

__all__ = [
  "abstract_state",
  "check_compatible",
  "init_sharded",
  "local_state",
  "migrate_state",
  "stack_windows",
  "stacked_state",
  "state_shardings",
  "window_specs",
]
