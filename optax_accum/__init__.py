"""optax_accum: correct, fast gradient accumulation for Optax.

Wrap any Optax optimizer with :func:`accumulate`; pass each microbatch's
gradient with its ``weight`` (examples or unmasked tokens); get exactly the
update one physical batch would give.
"""

from optax_accum._accumulate import AccumulationState, accumulate, flush
from optax_accum._loss_scale import (
  DynamicLossScale,
  StaticLossScale,
  dynamic_loss_scale,
  static_loss_scale,
)
from optax_accum._microbatch import microbatched_value_and_grad, split_batch
from optax_accum._resume import abstract_state, check_compatible
from optax_accum._scaled_grad import scaled_value_and_grad
from optax_accum._sharding import (
  count_collectives,
  init_sharded,
  local_state,
  stack_windows,
  stacked_state,
  state_shardings,
  window_specs,
)
from optax_accum._state import Metrics, discard, get_loss_scale, metrics
from optax_accum._train_step import apply_if_updated, update_and_apply
from optax_accum.planning import plan_microbatch

__version__ = "0.1.0"

__all__ = [
  "AccumulationState",
  "DynamicLossScale",
  "Metrics",
  "StaticLossScale",
  "abstract_state",
  "accumulate",
  "apply_if_updated",
  "check_compatible",
  "count_collectives",
  "discard",
  "dynamic_loss_scale",
  "flush",
  "get_loss_scale",
  "init_sharded",
  "local_state",
  "metrics",
  "microbatched_value_and_grad",
  "plan_microbatch",
  "scaled_value_and_grad",
  "split_batch",
  "stack_windows",
  "stacked_state",
  "state_shardings",
  "static_loss_scale",
  "update_and_apply",
  "window_specs",
]
