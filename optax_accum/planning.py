"""0.3's ``optax_accum.planning`` module, kept for one release (``optax_accum._migration``).

Since 0.4 the planner is :func:`optax_accum.plan_microbatch`, and a plan cuts a global batch
itself: ``plan.microbatches_for(global_batch)``.
"""

from __future__ import annotations

from typing import Any

__all__: list[str] = []


def __getattr__(name: str) -> Any:
  """0.3's names, with a ``DeprecationWarning`` naming the 0.4 spelling."""
  from optax_accum import _migration

  return _migration.attribute("optax_accum.planning", name)
