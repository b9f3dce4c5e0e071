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

from optax_accum import _checks, _numerics

PyTree = Any

RULES = ("mean", "sum", "max", "last", "grad_amax_history")
SUMMED = frozenset({"mean", "sum"})
MAX_LIKE = frozenset({"max", "grad_amax_history"})
FLAX_FP8 = "_overwrite_with_gradient"  # flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT
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
      paths = jax.tree_util.tree_flatten_with_path(tree)[0]
      return tuple(default_rule(path) for path, _ in paths)
    prefix = self.reduce(tree) if callable(self.reduce) else self.reduce
    try:
      per_leaf = jax.tree.map(lambda r, sub: [r] * len(jax.tree.leaves(sub)), prefix, tree)
    except ValueError as e:
      raise ValueError(
        f"reduce= must be a rule or a tree prefix of the params with a rule per subtree; "
        f"it does not match the gradients' tree ({e}). Rules: {RULES}."
      ) from None
    rules = [r for group in jax.tree.leaves(per_leaf, is_leaf=_is_list) for r in group]
    for rule in rules:
      if rule not in RULES:
        raise ValueError(f"reduce= has the rule {rule!r}; each rule must be one of {RULES}.")
    return tuple(rules)

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
    """The window's denominator: its weight sum, or the fixed number (schedule) in its dtype."""
    if self.denominator is None:
      return weight_sum
    d = self.denominator(num_updates) if callable(self.denominator) else self.denominator
    return jnp.asarray(d).astype(weight_sum.dtype)

  def init_state(self, tree: PyTree) -> AggregationState | optax.EmptyState:
    """The sub-state ``init`` writes (``EmptyState`` for the default)."""
    if not self.active(tree):
      return optax.EmptyState()
    d = self.denominator
    fixed = 0.0 if d is None else _CALLABLE if callable(d) else float(d)
    codes = [RULES.index(r) for r in self.rules(tree)]
    return AggregationState(
      denominator=jnp.asarray(fixed, _numerics.scalar_dtype()),
      rules=jnp.asarray(codes, jnp.int32).reshape(len(codes)),
      apply_empty=jnp.asarray(self.apply_empty),
      overwrite=jnp.asarray(self.overwrite),
    )


def _is_list(x: Any) -> bool:
  return isinstance(x, list)


def default_rule(path: tuple) -> str:
  """``'mean'``; in Flax's ``_overwrite_with_gradient`` collection, its FP8 rule by leaf name.

  The output-gradient amax history records the amax of each microbatch's gradient of its
  mean loss: ``'grad_amax_history'``. The input and kernel histories and the scales are the
  same function of the window's data in every microbatch but the newest amax: ``'max'``.
  """
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  if FLAX_FP8 not in names:
    return "mean"
  return "grad_amax_history" if names[-1] == "output_grad_amax_history" else "max"


def check(denominator: Any, apply_empty: Any, reduce: Any, overwrite: Any) -> Aggregation:
  """Validates the aggregation arguments, each error naming the argument and the fix."""
  if denominator is not None and not callable(denominator):
    denominator = _checks.real_number(denominator, "denominator", "the window's divisor")
    if not 0 < denominator < float("inf"):
      raise ValueError(
        f"denominator must be finite and > 0, got {denominator}. Use denominator=1 for the "
        "plain sum, or None to divide by the window's weight sum."
      )
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
  traced = isinstance(denominator, jax.Array)
  aggregation = check(None if traced else denominator, False, reduce, True)
  return aggregation._replace(denominator=denominator) if traced else aggregation


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


# ------------------------------------------------------------------ the boundary's values


class Split(NamedTuple):
  """A tree's leaves grouped by what the boundary does with them (trace time).

  ``groups``: ``(indices, kind)`` of the leaves handed to the inner optimizer, ``kind`` their
  divisor: ``'mean'`` (denominator times loss scale), ``'sum'`` (loss scale), ``'other'``
  (none: max, last, the FP8 history). ``overwritten``: the indices of the other leaves.
  """

  rules: tuple[str, ...]
  groups: tuple[tuple[tuple[int, ...], str], ...]
  overwritten: tuple[int, ...]

  @classmethod
  def of(cls, agg: Aggregation, tree: PyTree) -> Split:
    rules, flags = agg.rules(tree), agg.overwritten(tree)
    kind = lambda r: r if r in SUMMED else "other"
    groups = []
    for k in ("mean", "sum", "other"):
      idx = tuple(i for i, r in enumerate(rules) if kind(r) == k and not flags[i])
      if idx:
        groups.append((idx, k))
    return cls(rules, tuple(groups), tuple(i for i, f in enumerate(flags) if f))

  @property
  def plain(self) -> bool:
    """Every leaf a weighted mean: the boundary is today's, unchanged."""
    return all(r == "mean" for r in self.rules)

  def _divisor(self, kind: str, d: jax.Array, scale: jax.Array) -> jax.Array:
    if kind == "mean":
      return d * scale.astype(d.dtype)
    return scale.astype(d.dtype) if kind == "sum" else jnp.ones_like(d)

  def _leaves(self, idx, leaves, kind, d):
    if kind != "other":
      return [leaves[i] for i in idx]
    return [finish_other(self.rules[i], leaves[i], d) for i in idx]

  def norm_and_finite(self, g_sum: PyTree, d: jax.Array, scale: jax.Array):
    """The global norm of what the inner optimizer gets and whether all of the window is finite."""
    if self.plain:
      return _numerics.norm_and_finite(g_sum, self._divisor("mean", d, scale))
    leaves = jax.tree.leaves(g_sum)
    sq, finite = jnp.zeros((), d.dtype), _numerics.all_finite(self.overwritten_values(g_sum, d))
    for idx, kind in self.groups:
      n, f = _numerics.norm_and_finite(
        self._leaves(idx, leaves, kind, d), self._divisor(kind, d, scale)
      )
      dtype = _numerics.promote_types(sq.dtype, n.dtype)
      sq, finite = sq.astype(dtype) + jnp.square(n.astype(dtype)), finite & f
    return jnp.sqrt(sq), finite

  def fits(self, g_sum, d, scale, norm, clip_norm, like) -> jax.Array:
    """Whether the summed leaves' window values fit ``like``'s (maybe fp16) dtypes."""
    if self.plain:
      return _numerics.fits(g_sum, self._divisor("mean", d, scale), norm, clip_norm, like)
    leaves, likes = jax.tree.leaves(g_sum), jax.tree.leaves(like)
    ok = jnp.array(True)
    for idx, kind in self.groups:
      sub = self._leaves(idx, leaves, kind, d)
      div = self._divisor(kind, d, scale)
      ok = ok & _numerics.fits(sub, div, norm, clip_norm, [likes[i] for i in idx])
    return ok

  def window_values(self, g_sum, d, scale, norm, clip_norm, like) -> PyTree:
    """What the inner optimizer gets: each group's window value (clipped), cast like ``like``;
    the overwritten leaves' reduced values (the inner does not see them)."""
    if self.plain:
      return _numerics.window_mean(g_sum, self._divisor("mean", d, scale), norm, clip_norm, like)
    leaves, treedef = jax.tree.flatten(g_sum)
    likes = jax.tree.leaves(like)
    out = list(leaves)
    for idx, kind in self.groups:
      sub = self._leaves(idx, leaves, kind, d)
      div = self._divisor(kind, d, scale)
      values = _numerics.window_mean(sub, div, norm, clip_norm, [likes[i] for i in idx])
      for i, v in zip(idx, values, strict=True):
        out[i] = v
    for i, v in zip(self.overwritten, self.overwritten_values(g_sum, d), strict=True):
      out[i] = v.astype(likes[i].dtype)
    return jax.tree.unflatten(treedef, out)

  def overwritten_values(self, g_sum: PyTree, d: jax.Array) -> list[jax.Array]:
    """The overwritten leaves' reduced values, in index order."""
    leaves = jax.tree.leaves(g_sum)
    return [finish_other(self.rules[i], leaves[i], d) for i in self.overwritten]

  def overwrite_updates(self, updates: PyTree, values: PyTree, params: PyTree, keep) -> PyTree:
    """The inner's updates with each overwritten leaf's ``value - param`` (zero where ``keep``)."""
    if not self.overwritten:
      return updates
    if params is None:
      raise ValueError(
        "reduce= overwrites max/last leaves at the boundary, which needs the params: pass "
        "params to tx.update (or overwrite=False to hand them to the inner optimizer)."
      )
    u, treedef = jax.tree.flatten(updates)
    v, p = jax.tree.leaves(values), jax.tree.leaves(params)
    for i in self.overwritten:
      wide = _numerics.promote_types(v[i].dtype, p[i].dtype)
      delta = v[i].astype(wide) - p[i].astype(wide)
      u[i] = jnp.where(keep, jnp.zeros((), u[i].dtype), delta.astype(u[i].dtype))
    return jax.tree.unflatten(treedef, u)

  def overwrite_params(self, new_params: PyTree, values: PyTree, params: PyTree, keep) -> PyTree:
    """``new_params`` with each overwritten leaf set to its value exactly (kept where ``keep``)."""
    if not self.overwritten:
      return new_params
    n, treedef = jax.tree.flatten(new_params)
    v, p = jax.tree.leaves(values), jax.tree.leaves(params)
    for i in self.overwritten:
      n[i] = jnp.where(keep, p[i], v[i].astype(p[i].dtype))
    return jax.tree.unflatten(treedef, n)
