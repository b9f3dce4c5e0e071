"""optax_accum: correct, fast gradient accumulation for Optax.

Wrap any Optax optimizer with :func:`accumulate`; pass each microbatch's
gradient with its ``weight`` (examples or unmasked tokens); get exactly the
update one physical batch would give. :func:`update_and_apply` is the fastest
train step. Public submodules: :mod:`optax_accum.sharding` (scale-out and
checkpoints), :mod:`optax_accum.testing` (pre-flight checks and test tools),
:mod:`optax_accum.flax` (needs the ``flax`` extra). docs/design.md maps the code.
"""

from typing import Any

from optax_accum import sharding as sharding
from optax_accum._accumulate import Accumulation, accumulate
from optax_accum._actions import discard, flush, update_and_apply
from optax_accum._guard import spike_rule
from optax_accum._loss_scale import dynamic_loss_scale, static_loss_scale
from optax_accum._metrics import Metrics, get_loss_scale, metrics
from optax_accum._microbatch import microbatched_value_and_grad, split_batch
from optax_accum._scaled_grad import scaled_value_and_grad
from optax_accum._state import AccumulationState
from optax_accum._window_weight import sqrt_scaled_schedule
from optax_accum.planning import plan_microbatch

__version__ = "0.3.0"


__all__ = [
  "Accumulation",
  "AccumulationState",
  "Metrics",
  "accumulate",
  "discard",
  "dynamic_loss_scale",
  "flush",
  "get_loss_scale",
  "metrics",
  "microbatched_value_and_grad",
  "plan_microbatch",
  "scaled_value_and_grad",
  "split_batch",
  "spike_rule",
  "sqrt_scaled_schedule",
  "static_loss_scale",
  "update_and_apply",
]


def __getattr__(name: str) -> Any:
  """``optax_accum.testing`` on first use (PEP 562)."""
  if name == "testing":
    import importlib

    return importlib.import_module("optax_accum.testing")
  raise AttributeError(f"module 'optax_accum' has no attribute {name!r}")
