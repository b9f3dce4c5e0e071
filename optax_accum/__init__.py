"""optax_accum: correct, fast gradient accumulation for Optax.

Wrap any Optax optimizer with :func:`accumulate`; pass each microbatch's
gradient with its ``weight`` (examples or unmasked tokens); get exactly the
update one physical batch would give. :func:`update_and_apply` is the fastest
train step. Each option is an object from its own factory (:func:`token_budget`,
:func:`adaptive_window`, :func:`aggregate`, :func:`noise_scale`, :func:`spike_rule`, the
loss scales).
Public submodules: :mod:`optax_accum.sharding` (scale-out and checkpoints),
:mod:`optax_accum.testing` (pre-flight checks and test tools), :mod:`optax_accum.flax`
(needs the ``flax`` extra), :mod:`optax_accum.pitfalls` (the warning).
docs/design.md maps the code.
"""

from typing import Any

from optax_accum import pitfalls as pitfalls
from optax_accum import sharding as sharding
from optax_accum._accumulate import accumulate
from optax_accum._actions import discard, flush, update_and_apply
from optax_accum._adaptive_window import adaptive_window
from optax_accum._aggregation import aggregate
from optax_accum._guard import spike_rule
from optax_accum._loss_scale import dynamic_loss_scale, static_loss_scale
from optax_accum._metrics import metrics
from optax_accum._microbatch import microbatched_value_and_grad
from optax_accum._noise_scale import noise_scale
from optax_accum._planning import plan_microbatch
from optax_accum._state import AccumulationState
from optax_accum._token_budget import token_budget

__version__ = "0.4.0"


__all__ = [
  "AccumulationState",
  "accumulate",
  "adaptive_window",
  "aggregate",
  "discard",
  "dynamic_loss_scale",
  "flush",
  "metrics",
  "microbatched_value_and_grad",
  "noise_scale",
  "plan_microbatch",
  "spike_rule",
  "static_loss_scale",
  "token_budget",
  "update_and_apply",
]


def __getattr__(name: str) -> Any:
  """``optax_accum.testing`` on first use (PEP 562): importing the package stays light."""
  if name == "testing":
    import importlib

    return importlib.import_module("optax_accum.testing")
  raise AttributeError(f"module 'optax_accum' has no attribute {name!r}")
