"""Detection of the README's accumulation pitfalls, with a warning that says the fix.

Each check reads optax's public state types at ``init`` or trace time and warns with
``optax_accum.pitfalls.PitfallWarning`` (free in the compiled step): ``accumulate(...).init``
runs :func:`check_inner_state`; ``update_and_apply``, ``flush``, ``discard`` and the Flax
integrations run :func:`check_state` (``accumulate``'s own ``init`` and ``update`` cannot
see what wraps them). A clip before ``accumulate`` has an ``EmptyState`` like many
transformations: documented (README, Pitfalls), not detected. None is wrong in every case,
so they warn, once per call site by default.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import warnings
from typing import Any

import jax
import optax

from optax_accum.pitfalls import PitfallWarning

PyTree = Any

# `inject_hyperparams` states: a schedule only where `hyperparams_states` is non-empty (the
# deprecated `InjectHyperparamsState` has no such field: its count is a counter like any other).
_INJECT_STATES = (optax.InjectStatefulHyperparamsState,)
# True while optax_accum.flax.Optimizer (whose `step` counts applied updates) calls tx.init.
_COUNTS_UPDATES = contextvars.ContextVar("optax_accum_counts_updates", default=False)
# Packages whose frames are skipped when pointing a warning at the user's code.
_INTERNAL_PACKAGES = ("optax_accum", "jax", "optax", "flax")


def _warn(message: str) -> None:
  """Warns at the first frame outside optax_accum, jax and optax (the user's call)."""
  files = (getattr(sys.modules.get(p), "__file__", None) for p in _INTERNAL_PACKAGES)
  internal = tuple(os.path.dirname(f) + os.sep for f in files if f)
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_code.co_filename.startswith(internal):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, PitfallWarning, stacklevel=level + 1)


def _find(tree: PyTree, types: tuple[type, ...]) -> list[Any]:
  stop = lambda x: isinstance(x, types)
  return [x for x in jax.tree.leaves(tree, is_leaf=stop) if stop(x)]


def check_inner_state(inner_state: PyTree, state_type: type) -> PyTree:
  """Warns when the inner optimizer of ``accumulate`` accumulates too.

  ``accumulate(accumulate(opt, k2), k1)`` and ``accumulate(optax.MultiSteps(opt,
  k2), k1)`` hand each k1-window's mean to the inner accumulator with weight 1:
  the update is the unweighted mean of k2 window means (the mean of means), and
  the inner optimizer steps once per ``k1 * k2`` microbatches.

  Args:
    inner_state: the inner optimizer's fresh state (returned unchanged).
    state_type: :class:`optax_accum.AccumulationState` (this module imports no state module).

  Warns:
    PitfallWarning: naming the fix, one ``accumulate(opt, every_k=k1 * k2)``.

  Examples:
    >>> import warnings, jax.numpy as jnp, optax, optax_accum
    >>> inner = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   _ = optax_accum.accumulate(inner, every_k=4).init({'w': jnp.zeros(2)})
    >>> [w.category.__name__ for w in caught]
    ['PitfallWarning']
  """
  if _find(inner_state, (state_type,)):
    _warn(
      "accumulate's inner optimizer contains another accumulate: the inner one averages the "
      "outer windows' means with equal weights (the mean of means). Use one "
      "accumulate(opt, every_k=k_outer * k_inner)."
    )
  if _find(inner_state, (optax.MultiStepsState,)):
    _warn(
      "accumulate's inner optimizer is an optax.MultiSteps: it averages accumulate's window "
      "means with equal weights (the mean of means) and steps once per every_k * "
      "every_k_schedule microbatches. Use accumulate(opt, every_k=every_k * every_k_schedule) "
      "alone (README: Migrating from optax.MultiSteps)."
    )
  return inner_state


@contextlib.contextmanager
def counting_updates():
  """Marks ``tx.init`` calls made by an optimizer whose ``step`` counts applied updates."""
  token = _COUNTS_UPDATES.set(True)
  try:
    yield
  finally:
    _COUNTS_UPDATES.reset(token)


def check_params(params: PyTree) -> None:
  """Warns when ``accumulate(...).init`` gets what a plain ``nnx.Optimizer`` passes it.

  ``nnx.Optimizer(model, accumulate(...), wrt=nnx.Param)`` calls ``init`` with an ``nnx.State``
  of the model's Variables, then adds 1 to ``step`` on every microbatch: a schedule, EMA,
  evaluation or checkpoint keyed on ``step`` runs ``every_k`` times too often.
  :class:`optax_accum.flax.Optimizer` (its ``step`` counts applied updates) does not warn.

  Examples:
    >>> import warnings, optax, optax_accum
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   _ = nnx.Optimizer(model, optax_accum.accumulate(optax.sgd(0.1), 4), wrt=nnx.Param)
    >>> [w.category.__name__ for w in caught]
    ['PitfallWarning']
  """
  nnx = sys.modules.get("flax.nnx")  # a State of Variables exists only where Flax is imported
  if nnx is None or _COUNTS_UPDATES.get() or not isinstance(params, nnx.State):
    return
  is_var = lambda x: isinstance(x, nnx.Variable)
  if any(is_var(x) for x in jax.tree.leaves(params, is_leaf=is_var)):
    _warn(
      "accumulate(...).init got an nnx.State of Variables, as a plain nnx.Optimizer passes "
      "it: nnx.Optimizer adds 1 to `step` per microbatch, not per update, so schedules, EMA, "
      "evaluation and checkpoints keyed on it run every_k times too often. Use "
      "optax_accum.flax.Optimizer (the same constructor; its step counts applied updates), "
      "or read optax_accum.metrics(opt.opt_state).num_updates. Calling tx.init yourself? "
      "Pass arrays (nnx.as_pure(state), nnx.pure before Flax 0.12.7) and this is not shown."
    )


def check_state(opt_state: PyTree, state_type: type) -> None:
  """Warns about transformations around ``accumulate`` visible in the optimizer state.

  - ``optax.apply_if_finite(accumulate(...))``: it drops a non-finite
    microbatch and keeps the rest of its window, so the window silently
    shrinks; ``accumulate`` already skips a non-finite window whole.
  - Any state outside ``accumulate`` with a step counter (optax's ``count`` field:
    ``optax.scale_by_schedule``, an optimizer given a schedule, ``optax.add_noise``, Adam or
    an EMA chained beside it, an ``optax.inject_hyperparams`` around it given a schedule):
    it advances once per microbatch, not once per window. Found by kind, through optax's
    public state types and their counters, not by a list of names.

  Args:
    opt_state: any optimizer state (or ``nnx.Optimizer.opt_state``); nothing is checked
      without an :class:`optax_accum.AccumulationState` (``state_type``) in it.
    state_type: :class:`optax_accum.AccumulationState`.

  Warns:
    PitfallWarning: naming the fix.

  Examples:
    >>> import warnings, jax.numpy as jnp, optax, optax_accum
    >>> tx = optax.chain(optax_accum.accumulate(optax.sgd(0.1), every_k=4),
    ...                  optax.scale_by_adam())  # Adam's count and bias correction per call
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   check_state(state, optax_accum.AccumulationState)
    >>> [str(w.message)[:43] for w in caught]
    ['optax.ScaleByAdamState outside accumulate c']
  """
  acc = state_type
  if not _find(opt_state, (acc,)):
    return
  finite = _find(opt_state, (optax.ApplyIfFiniteState, acc))
  if any(isinstance(s, optax.ApplyIfFiniteState) and _find(s, (acc,)) for s in finite):
    _warn(
      "optax.apply_if_finite around accumulate drops a non-finite microbatch and keeps the rest "
      "of its window: the window silently shrinks. Remove apply_if_finite: accumulate skips a "
      "non-finite window whole and counts it in metrics(state).num_skipped."
    )
  counters = sorted({_name(s) for s in _counting_states(opt_state, acc)})
  if counters:
    _warn(
      f"{', '.join(counters)} outside accumulate counts calls: its step counter advances "
      "once per microbatch, not once per window (a schedule, noise annealing, bias "
      "correction or an EMA would run every_k times too fast). Put it inside: "
      "accumulate(optax.chain(..., transform), every_k), or give the inner optimizer the "
      "schedule: accumulate(optax.adamw(schedule), every_k)."
    )


def _counting_states(node: PyTree, acc: type) -> list[Any]:
  """The states outside ``acc`` with a step counter: a NamedTuple whose ``count`` field is an
  integer scalar (``optax.inject_hyperparams``' only where it injects a schedule)."""
  if isinstance(node, acc):
    return []
  if "count" in getattr(node, "_fields", ()) and _is_counter(node.count):
    if not isinstance(node, _INJECT_STATES) or node.hyperparams_states:
      return [node]  # its own parts (a schedule's state inside it) are its business
  found = []
  children = jax.tree.leaves(node, is_leaf=lambda x: x is not node)
  if not (len(children) == 1 and children[0] is node):
    for child in children:
      found.extend(_counting_states(child, acc))
  return found


def _is_counter(x: Any) -> bool:
  x = x.get_value() if hasattr(x, "get_value") else getattr(x, "value", x)
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.integer) and x.ndim == 0


def _name(state: Any) -> str:
  t = type(state)
  return f"{t.__module__.split('.')[0]}.{t.__name__}"


def check_fp8_scale(fp8: bool, weighted_mean: bool, keeps_window: bool) -> None:
  """Warns when Flax FP8 meta meets windows of mean losses (``accumulate`` without a denominator).

  The backward pass quantizes each microbatch's output gradient with the window's FP8 scale,
  set for the whole window's gradient; the gradient of one microbatch's *mean* loss is
  ``1 / share`` times larger and saturates. The fix: each microbatch's loss at the window's
  scale (its sum over the window's weight, known in advance) with ``aggregate(denominator=1)``, or
  :func:`optax_accum.microbatched_value_and_grad`, which does it (docs/aggregation.md).

  Examples:
    >>> import warnings, optax_accum
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   check_fp8_scale(True, True, keeps_window=True)
    >>> [w.category.__name__ for w in caught]
    ['PitfallWarning']
  """
  if fp8 and weighted_mean and keeps_window:
    _warn(
      "accumulate got Flax FP8 meta (the _overwrite_with_gradient collection) with windows "
      "of mean losses: each microbatch's output gradient would be quantized with the whole "
      "window's FP8 scale while being 1/share times larger, and saturate. Compute each "
      "microbatch's loss at the window's scale (sum over the window's weight N, known in "
      "advance: loss.sum() / N) and pass aggregate=optax_accum.aggregate(denominator=1), or use "
      "optax_accum.microbatched_value_and_grad (docs/aggregation.md)."
    )


def check_shared_weight(opt_state: PyTree, state_type: type, extra_args: Any) -> None:
  """Warns when one ``weight`` reaches several ``accumulate`` states.

  ``optax.multi_transform({'a': accumulate(...), 'b': accumulate(...)}, labels)`` forwards the
  same extra arguments to every transformation: adapters (LoRA) whose microbatches hold
  different numbers of examples each get one shared weight, and their windows are off
  (docs/porting.md shows one weight per adapter with ``jax.vmap``).

  Examples:
    >>> import warnings, jax.numpy as jnp, optax, optax_accum
    >>> tx = optax.multi_transform(
    ...   {'a': optax_accum.accumulate(optax.sgd(0.1), 2),
    ...    'b': optax_accum.accumulate(optax.sgd(0.1), 2)}, {'x': 'a', 'y': 'b'})
    >>> state = tx.init({'x': jnp.zeros(2), 'y': jnp.zeros(2)})
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   check_shared_weight(state, optax_accum.AccumulationState, {'weight': 3})
    >>> [w.category.__name__ for w in caught]
    ['PitfallWarning']
  """
  if "weight" not in extra_args:
    return
  n = len(_find(opt_state, (state_type,)))
  if n > 1:
    _warn(
      f"one weight= reaches {n} accumulate states (an optax.multi_transform of accumulators?): "
      "each window is weighted by the same count. If their microbatches hold different "
      "numbers of examples (one LoRA adapter's batch is not another's), give each its own "
      "weight: keep one accumulate per adapter with its own state and call update_and_apply "
      "per adapter, or stack the adapters and jax.vmap it over (grads, state, params, "
      "weight) (docs/porting.md, several accumulators)."
    )
