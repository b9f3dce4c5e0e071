"""Aggregation rules: the window's denominator and how each leaf combines over the window.

The default is the weighted mean, ``sum_i w_i g_i / sum_i w_i``, for every leaf. Two rules
change it, on the across-step (``accumulate``) and in-step (``microbatched_value_and_grad``)
paths alike:

* ``denominator``: divide the weighted sum by a fixed number (or a schedule of ``num_updates``)
  instead of the realized weight: DP-SGD's expected batch size, a token count known before the
  update starts; ``denominator=1`` is the plain sum.
* ``reduce``: per leaf, ``'mean'`` (by the denominator), ``'sum'``, ``'max'``, ``'last'`` or
  ``'grad_amax_history'`` (an FP8 amax history of a gradient: newest entry at index 0, Flax's
  layout). The default gives Flax's ``_overwrite_with_gradient`` collection (FP8 scales and amax
  histories) the rule that makes a window equal one physical batch, every other leaf ``'mean'``.

Leaves reduced by max, last or the FP8 rule are *overwritten* at an applied boundary with the
reduced value (Flax's ``TrainState`` rule for that collection) instead of going through the
inner optimizer, unless ``overwrite=False``. Under ``axis_name`` they cross devices in one
``pmax`` (max-like leaves and the index of the last device with weight) before the window's
``psum``: two all-reduces per window instead of one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _checks, _leaf_rules, _numerics
from optax_accum._leaf_rules import RULES

PyTree = Any

SUMMED = frozenset({"mean", "sum"})
MAX_LIKE = frozenset({"max", "grad_amax_history"})
_CALLABLE = -1.0  # the fingerprint of a denominator schedule (its values are not stored)


class AggregationState(NamedTuple):
  """The sub-state of a non-default aggregation: its fingerprint, checked on restore.

  Attributes:
    denominator: float32, the fixed denominator; 0 for the weight sum, -1 for a schedule.
    rules: int32 ``[num_leaves]``, each leaf's rule as its index in ``RULES``.
    apply_empty: bool, whether an empty window runs the inner optimizer.
    overwrite: bool, whether max/last leaves are overwritten instead of optimized.
  """

  denominator: jax.Array
  rules: jax.Array
  apply_empty: jax.Array
  overwrite: jax.Array


class Aggregation(NamedTuple):
  """``accumulate``'s (or ``microbatched_value_and_grad``'s) aggregation arguments, validated."""

  denominator: float | Callable[[jax.Array], Any] | None
  apply_empty: bool
  reduce: Any
  overwrite: bool

  def rules(self, tree: PyTree) -> tuple[str, ...]:
    """The rule of each leaf of ``tree`` (grads or params), in ``jax.tree.leaves`` order."""
    if self.reduce is None:
      try:
        return _leaf_rules.defaults(jax.tree.structure(tree))
      except (TypeError, ValueError):  # a node type that cannot be rebuilt from placeholders
        paths = jax.tree_util.tree_flatten_with_path(tree)[0]
        return tuple(_leaf_rules.default_rule(path) for path, _ in paths)
    prefix = self.reduce(tree) if callable(self.reduce) else self.reduce
    return _leaf_rules.of_prefix(prefix, tree)

  def active(self, tree: PyTree) -> bool:
    """Whether the state carries an :class:`AggregationState` (anything but the default)."""
    default = self.denominator is None and not self.apply_empty and self.overwrite
    return not default or any(r != "mean" for r in self.rules(tree))

  def overwritten(self, tree: PyTree) -> tuple[bool, ...]:
    """Per leaf, whether the boundary overwrites it instead of handing it to the inner."""
    return tuple(self.overwrite and r not in SUMMED for r in self.rules(tree))

  def inner_for(self, inner: Any, tree: PyTree) -> Any:
    """``inner``, or ``optax.masked(inner, ...)`` hiding the overwritten leaves from it."""
    flags = self.overwritten(tree)
    if not any(flags):
      return inner
    mask = jax.tree.unflatten(jax.tree.structure(tree), [not f for f in flags])
    return optax.with_extra_args_support(optax.masked(inner, mask))

  def value(self, weight_sum: jax.Array, num_updates: jax.Array | None) -> jax.Array:
    """The window's denominator: its weight sum, or the fixed number (schedule) in its dtype.

    A schedule's value is checked like a fixed one where it is concrete (eager calls); a
    traced one that is not finite and > 0 makes the window non-finite (:meth:`usable`).
    """
    if self.denominator is None:
      return weight_sum
    d = self.denominator
    if callable(d):
      d = denominator_value(d(num_updates), "the denominator schedule's value")
    return jnp.asarray(d).astype(weight_sum.dtype)

  def usable(self, d: jax.Array) -> jax.Array:
    """Whether a fixed denominator can divide: finite and > 0 (True for the weight sum)."""
    if self.denominator is None:
      return jnp.ones((), jnp.bool_)
    return (d > 0) & jnp.isfinite(d)

  def fingerprint(self, tree: PyTree) -> tuple | None:
    """What :class:`AggregationState` holds for ``tree``, as Python values (None: default)."""
    if not self.active(tree):
      return None
    d = self.denominator
    fixed = 0.0 if d is None else _CALLABLE if callable(d) else d
    fixed = float(np.asarray(fixed, _numerics.scalar_dtype()))  # as the state stores it
    return (fixed, self.rules(tree), self.apply_empty, self.overwrite)

  def init_state(self, tree: PyTree) -> AggregationState | optax.EmptyState:
    """The sub-state ``init`` writes (``EmptyState`` for the default)."""
    fp = self.fingerprint(tree)
    if fp is None:
      return optax.EmptyState()
    fixed, rules, apply_empty, overwrite = fp
    return AggregationState(
      denominator=jnp.asarray(fixed, _numerics.scalar_dtype()),
      rules=jnp.asarray([RULES.index(r) for r in rules], jnp.int32).reshape(len(rules)),
      apply_empty=jnp.asarray(apply_empty),
      overwrite=jnp.asarray(overwrite),
    )


def denominator_value(d: Any, name: str = "denominator") -> float | jax.Array:
  """A denominator value, checked: a number (or concrete 0-d array) finite and > 0, as a float;
  a traced one must be a real 0-d array (its value is known only in the compiled step)."""
  if isinstance(d, jax.core.Tracer):
    if d.ndim != 0 or not jnp.issubdtype(d.dtype, jnp.number) or jnp.iscomplexobj(d):
      raise TypeError(f"{name} must be a real scalar (0-d), got {d.dtype}{list(d.shape)}.")
    return d
  if isinstance(d, (jax.Array, np.ndarray)):
    if np.ndim(d) != 0:
      raise TypeError(f"{name} must be a real scalar (0-d), got shape {np.shape(d)}.")
    d = np.asarray(d)[()]
  d = _checks.real_number(d, name, "the window's divisor")
  if not 0 < d < float("inf"):
    raise ValueError(
      f"{name} must be finite and > 0, got {d}. Use denominator=1 for the plain sum, or "
      "None to divide by the window's weight sum."
    )
  return d


def check(denominator: Any, apply_empty: Any, reduce: Any, overwrite: Any) -> Aggregation:
  """Validates the aggregation arguments, each error naming the argument and the fix."""
  if denominator is not None and not callable(denominator):
    denominator = denominator_value(denominator)
  for flag, name in ((apply_empty, "apply_empty"), (overwrite, "overwrite")):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"{name} must be True or False, got {flag!r}.")
  if apply_empty and denominator is None:
    raise ValueError(
      "apply_empty=True needs a fixed denominator: an empty window has no weight to divide "
      "by. Pass denominator= (e.g. DP-SGD's expected batch size)."
    )
  if reduce is not None and not callable(reduce):
    for rule in jax.tree.leaves(reduce):
      if rule not in RULES:
        raise ValueError(f"reduce= has the rule {rule!r}; each rule must be one of {RULES}.")
  return Aggregation(denominator, bool(apply_empty), reduce, bool(overwrite))


def check_in_step(denominator: Any, reduce: Any, noise_scale: bool) -> Aggregation:
  """``microbatched_value_and_grad``'s aggregation: a denominator value (may be a 0-d array)."""
  if callable(denominator):
    raise TypeError(
      "microbatched_value_and_grad takes a denominator value (a number or a 0-d array), "
      "not a schedule: pass denominator=schedule(step) for this step."
    )
  if noise_scale and (denominator is not None or reduce is not None):
    raise ValueError(
      "noise_scale=True estimates the noise of a weighted mean: leave out denominator= and "
      "reduce=, or noise_scale."
    )
  traced = isinstance(denominator, jax.core.Tracer)
  aggregation = check(None if traced else denominator, False, reduce, True)
  if traced:  # a value of this step (not checkable before it runs): its shape and dtype
    return aggregation._replace(denominator=denominator_value(denominator))
  return aggregation


def fingerprint(sub: Any) -> tuple | None:
  """The comparable values of an :class:`AggregationState` (None for ``EmptyState``)."""
  if not isinstance(sub, AggregationState):
    return None
  rules = tuple(RULES[int(c)] for c in np.asarray(sub.rules).reshape(-1))
  flags = (bool(np.asarray(sub.apply_empty)), bool(np.asarray(sub.overwrite)))
  return (float(np.asarray(sub.denominator)), rules, *flags)


# ------------------------------------------------------------------ the window's arithmetic


def _leaf_add(rule: str, a: jax.Array, g: Any, w: jax.Array, first: jax.Array) -> jax.Array:
  """One leaf of the window after a microbatch of weight ``w`` (``first``: none counted yet)."""
  g = jnp.asarray(g).astype(a.dtype)
  take = w != 0
  if rule in SUMMED:
    return a + jnp.where(take, w.astype(a.dtype) * g, jnp.zeros((), a.dtype))
  if rule == "last":
    return jnp.where(take, g, a)
  if rule == "grad_amax_history":
    g = jnp.where(_newest(g), w.astype(a.dtype) * g, g)
  return jnp.where(take, jnp.where(first, g, jnp.maximum(a, g)), a)


def _newest(x: jax.Array) -> jax.Array:
  """True at index 0 of the leading axis (an amax history's newest entry, Flax's layout)."""
  if jnp.ndim(x) == 0:
    raise ValueError(
      "reduce='grad_amax_history' needs an amax history (a leaf with a leading history "
      "axis, newest entry first); got a scalar leaf. Use 'max' for it."
    )
  return jax.lax.broadcasted_iota(jnp.int32, jnp.shape(x), 0) == 0


def add(rules: tuple[str, ...], acc: PyTree, grads: PyTree, w: jax.Array, first: Any) -> PyTree:
  """The window's sums with a microbatch added per rule (all summed: ``weighted_add``)."""
  if all(r in SUMMED for r in rules):
    return _numerics.weighted_add(acc, grads, w)
  leaves, treedef = jax.tree.flatten(acc)
  grads = treedef.flatten_up_to(grads)
  new = [_leaf_add(r, a, g, w, first) for r, a, g in zip(rules, leaves, grads, strict=True)]
  return jax.tree.unflatten(treedef, new)


def reduce_devices(rules, grads, rest, has, index, psum, pmax):
  """``(grads, rest)`` reduced over the devices (or lanes), exactly, per rule.

  ``psum``/``pmax`` reduce a tree over the devices; ``rest`` (the window's other sums) is
  summed with the summed leaves in one ``psum``. ``has`` says whether this device's window
  has weight, ``index`` is its position: max-like leaves and the index of the last device
  with weight go in one ``pmax`` first (only when a leaf needs it), then that device's
  ``last`` leaves ride in the ``psum`` (the others add zeros).
  """
  if all(r in SUMMED for r in rules):
    return psum((grads, rest))
  leaves, treedef = jax.tree.flatten(grads)
  low = lambda x: jnp.where(_expand(has, x), x, jnp.asarray(jnp.finfo(x.dtype).min, x.dtype))
  maxed = {i: low(x) for i, (r, x) in enumerate(zip(rules, leaves, strict=True)) if r in MAX_LIKE}
  # The device index rides in the max leaves' all-reduce as a float (exact below 2**24).
  dtype = next((leaves[i].dtype for i in maxed), jnp.float32)
  mine = jnp.where(has, index, -1).astype(dtype) if "last" in rules else None
  maxed, top = pmax((maxed, mine))
  summed = {i: x for i, (r, x) in enumerate(zip(rules, leaves, strict=True)) if r in SUMMED}
  for i, r in enumerate(rules):
    if r == "last":
      x = leaves[i]
      summed[i] = jnp.where(_expand(mine == top, x), x, jnp.zeros((), x.dtype))
  summed, rest = psum((summed, rest))
  out = [maxed[i] if i in maxed else summed[i] for i in range(len(leaves))]
  return jax.tree.unflatten(treedef, out), rest


def _expand(mask: jax.Array, x: jax.Array) -> jax.Array:
  """``mask`` with trailing unit axes to broadcast against ``x`` (a lane axis leads both)."""
  return jnp.reshape(mask, jnp.shape(mask) + (1,) * (jnp.ndim(x) - jnp.ndim(mask)))


def batch_shares(agg: Aggregation, rules, weights, total, lanes) -> tuple[jax.Array, tuple]:
  """In-step with FP8 leaves: each microbatch's share ``w_k / denominator`` and the rules of
  gradients taken at the batch's scale (``'mean'`` summed, the FP8 history a plain max).

  The backward pass quantizes each microbatch's output gradient with the batch's FP8 scale:
  the gradient of the microbatch's *mean* loss would be ``1 / share`` times larger, and
  saturate. ``total`` sums the weights over devices; ``lanes`` (``jit`` with ``axis_name``)
  is refused.
  """
  if lanes or "sum" in rules:
    raise ValueError(
      "Flax FP8 leaves in-step need every microbatch's loss scaled by its share of the "
      "batch: run under jax.shard_map (not jax.jit with axis_name), without 'sum' rules."
    )
  d = agg.value(total(jnp.sum(weights)), None)
  at_batch_scale = {"mean": "sum", "grad_amax_history": "max"}
  return _numerics.guarded_divide(weights, d), tuple(at_batch_scale.get(r, r) for r in rules)


def finish(rules: tuple[str, ...], sums: PyTree, d: jax.Array) -> PyTree:
  """Each leaf's window value: ``'mean'`` divided by ``d``, ``'sum'`` as summed, the others
  as reduced (the FP8 history's newest entry divided by ``d``). The in-step path's division."""
  if all(r == "mean" for r in rules):
    return _numerics.guarded_divide(sums, d)
  leaves, treedef = jax.tree.flatten(sums)
  value = lambda r, x: (
    _numerics.guarded_divide(x, d) if r == "mean" else x if r == "sum" else finish_other(r, x, d)
  )
  return jax.tree.unflatten(treedef, [value(r, x) for r, x in zip(rules, leaves, strict=True)])


def finish_other(rule: str, x: jax.Array, denom: jax.Array) -> jax.Array:
  """A max-like or last leaf's window value: as reduced; the FP8 history's newest entry / denom."""
  if rule != "grad_amax_history":
    return x
  nonzero = denom != 0
  safe = jnp.where(nonzero, denom, jnp.ones_like(denom)).astype(x.dtype)
  return jnp.where(_newest(x) & nonzero, x / safe, x)
