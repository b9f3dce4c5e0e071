"""From 0.3 to 0.4: the old keywords, the old names and the old checkpoints.

One translation table per kind of change, each read by one function, never a second code path:

* :data:`KEYWORDS`: ``accumulate``'s 0.3 keywords and their 0.4 spelling; :func:`translate`
  rewrites a call (with a ``DeprecationWarning`` naming the new spelling) and the 0.4 code runs.
  Removed in 0.5.
* :data:`DEPRECATED`: names that moved in 0.4, still reachable for one release through a
  module's ``__getattr__`` (:func:`attribute`), with a ``DeprecationWarning``.
* :data:`REMOVED`: names removed earlier; reaching one raises an ``AttributeError`` that names
  its replacement.
* :func:`state_paths_03`: how a 0.3 checkpoint's leaf paths map to a 0.4 state's
  (``sharding.migrate_state`` converts, ``sharding.check_compatible`` names the step).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import optax

PyTree = Any

_AGGREGATION = ("denominator", "apply_empty", "reduce", "overwrite")

KEYWORDS = {
  "window_weight": "every_k=optax_accum.token_budget(N, of=..., max_microbatches=k)",
  "window_weight_of": "every_k=optax_accum.token_budget(ramp, of=...)",
  "clip_norm": "inner=optax.chain(optax.clip_by_global_norm(c), inner)",
  "skip_nonfinite": "nothing: non-finite windows are always skipped (the state stays finite)",
  "noise_scale_decay": "observe=(optax_accum.noise_scale(decay),)",
  **{k: f"aggregate=optax_accum.aggregate({k}=...)" for k in _AGGREGATION},
}


def translate(inner: Any, every_k: Any, aggregate: Any, observe: Any, legacy: dict) -> tuple:
  """``(inner, every_k, aggregate, observe)`` with ``accumulate``'s 0.3 keywords rewritten.

  Raises:
    TypeError: for a keyword ``accumulate`` never took.
    ValueError: for ``skip_nonfinite=False`` (0.4 always skips a non-finite window), and for a
      0.3 keyword given together with its 0.4 replacement.
  """
  unknown = sorted(set(legacy) - set(KEYWORDS))
  if unknown:
    raise TypeError(f"accumulate() got an unexpected keyword argument {unknown[0]!r}.")
  for name in legacy:
    warnings.warn(
      f"accumulate({name}=...) is deprecated since optax_accum 0.4 and will be removed in "
      f"0.5; write {KEYWORDS[name]} (CHANGELOG: migrating to 0.4).",
      DeprecationWarning,
      stacklevel=3,
    )
  from optax_accum import _aggregation, _noise_scale, _token_budget

  if legacy.get("window_weight") is not None:  # None: 0.3's default, no budget
    if callable(every_k) or not (every_k is None or isinstance(every_k, int)):
      raise ValueError(
        "accumulate(window_weight=...) with an every_k schedule has no 0.4 spelling: "
        "token_budget(max_microbatches=) takes an int. Write a window policy "
        "(docs/protocols.md)."
      )
    every_k = _token_budget.token_budget(
      legacy["window_weight"], of=legacy.get("window_weight_of"), max_microbatches=every_k
    )
  elif legacy.get("window_weight_of") is not None:
    raise ValueError(
      f"accumulate(window_weight_of={legacy['window_weight_of']!r}) is only meaningful with a "
      "ramp: write every_k=optax_accum.token_budget(ramp, of=...)."
    )
  if legacy.get("clip_norm") is not None:
    inner = optax.chain(optax.clip_by_global_norm(legacy["clip_norm"]), inner)
  if "skip_nonfinite" in legacy and legacy["skip_nonfinite"] is not True:
    raise ValueError(
      f"accumulate(skip_nonfinite={legacy['skip_nonfinite']!r}): since 0.4 a window with a NaN "
      "or Inf is always skipped (counted in metrics(state).num_skipped), so that the optimizer "
      "state stays finite. Drop skip_nonfinite."
    )
  if legacy.get("noise_scale_decay") is not None:
    observe = (*observe, _noise_scale.noise_scale(legacy["noise_scale_decay"]))
  given = {k: legacy[k] for k in _AGGREGATION if k in legacy}
  if given:
    if aggregate is not None:
      raise ValueError(
        f"accumulate got aggregate= and the 0.3 keywords {sorted(given)}: put them in "
        "aggregate=optax_accum.aggregate(...)."
      )
    aggregate = _aggregation.aggregate(**given)
  return inner, every_k, aggregate, observe


def translate_in_step(aggregate: Any, legacy: dict) -> Any:
  """``microbatched_value_and_grad``'s 0.3 ``denominator=``/``reduce=`` as ``aggregate=``."""
  unknown = sorted(set(legacy) - {"denominator", "reduce"})
  if unknown:
    raise TypeError(
      f"microbatched_value_and_grad() got an unexpected keyword argument {unknown[0]!r}."
    )
  for name in legacy:
    warnings.warn(
      f"microbatched_value_and_grad({name}=...) is deprecated since optax_accum 0.4 and will "
      f"be removed in 0.5; write aggregate=optax_accum.aggregate({name}=...).",
      DeprecationWarning,
      stacklevel=3,
    )
  if aggregate is not None:
    raise ValueError(
      f"microbatched_value_and_grad got aggregate= and the 0.3 keywords {sorted(legacy)}: put "
      "them in aggregate=optax_accum.aggregate(...)."
    )
  from optax_accum import _aggregation

  return _aggregation.aggregate(**legacy)


# Names that moved in 0.4: (module, name) -> (where it lives now, the 0.4 spelling).
DEPRECATED = {
  ("optax_accum", "get_loss_scale"): ("optax_accum._metrics:get_loss_scale",
                                      "optax_accum.metrics(opt_state).loss_scale"),
  ("optax_accum", "scaled_value_and_grad"): (
    "optax_accum._scaled_grad:scaled_value_and_grad",
    "optax_accum.microbatched_value_and_grad(loss_fn, 1, loss_scale=metrics(opt_state)"
    ".loss_scale)",
  ),
  ("optax_accum", "split_batch"): ("optax_accum._microbatch_mesh:split_batch",
                                   "optax_accum.microbatched_value_and_grad (it splits)"),
  ("optax_accum", "sqrt_scaled_schedule"): (
    "optax_accum._token_budget:sqrt_scaled_schedule",
    "optax_accum.token_budget(ramp, of='num_updates').sqrt_scaled_schedule(lr, reference)",
  ),
  ("optax_accum", "Metrics"): ("optax_accum._metrics:Metrics",
                               "the return value of optax_accum.metrics(...)"),
  ("optax_accum", "Accumulation"): ("optax_accum._accumulate:Accumulation",
                                    "the return value of optax_accum.accumulate(...)"),
  ("optax_accum.planning", "plan_microbatch"): ("optax_accum._planning:plan_microbatch",
                                                "optax_accum.plan_microbatch"),
  ("optax_accum.planning", "microbatches_for"): ("optax_accum._migration:microbatches_for",
                                                 "plan.microbatches_for(global_batch)"),
  **{
    ("optax_accum.planning", n): (f"optax_accum._planning:{n}", "the result of plan_microbatch")
    for n in ("MicrobatchPlan", "MicrobatchSplit")
  },
  ("optax_accum.testing", "assert_equivalent"): ("optax_accum.testing:_assert_equivalent",
                                                  "check_equivalence(...).assert_passed()"),
  ("optax_accum.testing", "BatchDependentLayerWarning"): (
    "optax_accum.testing:_BatchDependentLayerWarning",
    "optax_accum.pitfalls.PitfallWarning (its base class)",
  ),
  ("optax_accum.testing", "batch_dependent_layers"): (
    "optax_accum.testing:_batch_dependent_layers",
    "check_equivalence(...).batch_dependent_layers",
  ),
  **{
    ("optax_accum.planning", n): (f"optax_accum._planning:{n}", "nothing: it is internal")
    for n in ("SAFETY_MARGIN", "compiled_peak_bytes", "default_budget", "parse_bytes")
  },
}  # fmt: skip


def microbatches_for(plan: Any, global_batch: int, *, multiple_of: int = 1) -> Any:
  """0.3's ``planning.microbatches_for(plan, n)``: ``plan.microbatches_for(n)``."""
  return plan.microbatches_for(global_batch, multiple_of=multiple_of)


# Names removed earlier: (module, name) -> what to use instead.
REMOVED = {
  **{
    ("optax_accum", n): f"optax_accum.sharding.{n}"
    for n in (
      "init_sharded",
      "check_compatible",
      "abstract_state",
      "local_state",
      "stack_windows",
      "stacked_state",
      "state_shardings",
      "window_specs",
    )
  },
  ("optax_accum", "count_collectives"): "optax_accum.testing.count_collectives",
  ("optax_accum", "StaticLossScale"): "optax_accum.static_loss_scale(value)",
  ("optax_accum", "DynamicLossScale"): "optax_accum.dynamic_loss_scale(...)",
  ("optax_accum", "apply_if_updated"): "optax_accum.update_and_apply",
  ("optax_accum.flax", "flush"): "flush=True on the last microbatch, or optax_accum.flush",
  ("optax_accum.flax", "discard"): "optax_accum.discard(opt_state)",
  ("optax_accum.flax", "num_updates"): "optax_accum.metrics(opt_state).num_updates",
  ("Optimizer", "flush"): "optimizer.update(model, grads, flush=True) on the last microbatch",
  ("Optimizer", "discard"): "optimizer.opt_state = optax_accum.discard(optimizer.opt_state)",
  ("TrainState", "flush"): "state.apply_gradients(grads=..., flush=True) on the last microbatch",
  ("TrainState", "discard"): "state.replace(opt_state=optax_accum.discard(state.opt_state))",
}


def attribute(module: str, name: str) -> Any:
  """A module's ``__getattr__``: a moved name (with a ``DeprecationWarning``), or an
  ``AttributeError`` that names the replacement of a removed one."""
  if (module, name) in DEPRECATED:
    where, spelling = DEPRECATED[(module, name)]
    warnings.warn(
      f"{module}.{name} is deprecated since optax_accum 0.4 and will be removed in 0.5; use "
      f"{spelling}.",
      DeprecationWarning,
      stacklevel=3,
    )
    path, attr = where.split(":")
    return getattr(importlib.import_module(path), attr)
  raise removed(module, name)


def removed(owner: str, name: str) -> AttributeError:
  """The ``AttributeError`` for ``owner.name``, naming the replacement if it was removed."""
  if (owner, name) in REMOVED:
    return AttributeError(
      f"{owner}.{name} was removed from optax_accum; use {REMOVED[(owner, name)]}."
    )
  return AttributeError(f"module {owner!r} has no attribute {name!r}")


# A 0.3 state's leaf paths under an AccumulationState -> the 0.4 state's (by path prefix).
STATE_PATHS_03 = {
  "window.weight_parts": "window.policy",
  "window.noise": "window.observers.0",
  "token_budget": "policy",
  "noise_scale": "observers.0",
}
# Leaves a 0.4 state has and a 0.3 one had not, with their value in a 0.3 state.
NEW_IN_04 = ("flush_pending", "guard.num_dropped")


def state_path_03(path_in_state: str) -> str | None:
  """The 0.3 path of a 0.4 state's leaf (relative to its AccumulationState); None if new."""
  if path_in_state in NEW_IN_04:
    return None
  for old, new in STATE_PATHS_03.items():
    if path_in_state == new or path_in_state.startswith(new + "."):
      return old + path_in_state[len(new) :]
  return path_in_state


def is_03(paths: Any) -> bool:
  """Whether the leaf paths of a restored state are a 0.3 ``AccumulationState``'s."""
  names = [p.rsplit(".", 1)[-1] for p in paths]
  has_state = "mini_step" in names
  return has_state and "flush_pending" not in names
