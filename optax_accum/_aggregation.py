"""Aggregation: the window's denominator and how each leaf combines over the window.

The default is the weighted mean, ``sum_i w_i g_i / sum_i w_i``, for every leaf.
:func:`optax_accum.aggregate` changes it, on the across-step (``accumulate(aggregate=...)``)
and in-step (``microbatched_value_and_grad(aggregate=...)``) paths alike:

* ``denominator``: divide the weighted sum by a fixed number (or a schedule of ``num_updates``)
  instead of the realized weight: DP-SGD's expected batch size, a token count known before the
  update starts; ``denominator=1`` is the plain sum.
* ``reduce``: per leaf, ``'mean'`` (by the denominator), ``'sum'``, ``'max'``, ``'last'`` or
  ``'grad_amax_history'`` (an FP8 amax history of a gradient: newest entry at index 0, Flax's
  layout), given as a tree prefix of the params matched by key path. The default gives Flax's
  ``_overwrite_with_gradient`` collection (FP8 scales and amax histories) the rule that makes a
  window equal one physical batch, every other leaf ``'mean'``.

Leaves reduced by max, last or the FP8 rule are *overwritten* at an applied boundary with the
reduced value (Flax's ``TrainState`` rule for that collection) instead of going through the
inner optimizer, unless ``overwrite=False``. Under ``axis_name`` they cross devices in one
``pmax`` (max-like leaves and the index of the last device with weight) before the window's
``psum``: two all-reduces per window instead of one. The boundary reads the window through a
:class:`Split`: the leaves grouped by what is done with them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _checks, _numerics

PyTree = Any

RULES = ("mean", "sum", "max", "last", "grad_amax_history")
FLAX_FP8 = "_overwrite_with_gradient"  # flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT


@functools.lru_cache(maxsize=256)
def defaults(treedef: Any) -> tuple[str, ...]:
  """The default rule of each leaf of a tree structure (cached: eager calls read it)."""
  dummy = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
  return tuple(default_rule(path) for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0])


def of_prefix(prefix: Any, tree: PyTree) -> tuple[str, ...]:
  """Each leaf's rule from ``reduce=``'s tree prefix, matched by the leaves' key paths.

  A dict prefix matches any mapping node by key (a dict, Flax's ``FrozenDict``, an NNX
  ``nnx.State``), a list or tuple by position, a NamedTuple or dataclass by field name. Raises
  for a leaf the prefix does not reach and for a name of the prefix the params lack.
  """
  used, rules = set(), []
  # None entries of the params (no leaves) are walked too: a prefix may name them, or not.
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_none)[0]:
    node, at = prefix, ()
    for key in path:
      if isinstance(node, str) or (leaf is None and _entry(node, key) is _MISSING):
        break
      node, at = _entry(node, key), (*at, _key_of(key))
      if node is _MISSING:
        raise _prefix_error(f"it has no entry for {at}, where the params have a leaf")
      used.add(at)
    if leaf is None:
      continue
    if not isinstance(node, str):
      raise _prefix_error(f"it has {type(node).__name__} at {at}, below the leaf there")
    if node not in RULES:
      raise ValueError(f"reduce= has the rule {node!r}; each rule must be one of {RULES}.")
    rules.append(node)
  for at in _prefix_paths(prefix):
    if at not in used:
      raise _prefix_error(f"it names {at}, which the params do not have")
  return tuple(rules)


def _is_none(x: Any) -> bool:
  return x is None


def _key_of(key: Any) -> Any:
  """A key path entry's name or index (``DictKey``, ``SequenceKey``, ``GetAttrKey``)."""
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return getattr(key, attr)
  raise TypeError(f"reduce= cannot match a tree node with the key {key!r}: pass a callable.")


_MISSING = object()


def _entry(node: Any, key: Any) -> Any:
  """A prefix node's entry for one key of a leaf's path, or ``_MISSING``."""
  k = _key_of(key)
  if isinstance(node, Mapping):
    return node.get(k, _MISSING)
  if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):  # by position
    return node[k] if isinstance(k, int) and k < len(node) else _MISSING
  return getattr(node, k, _MISSING) if isinstance(k, str) else _MISSING  # by field name


def _prefix_paths(prefix: Any, at: tuple = ()) -> list[tuple]:
  """Every path of ``prefix``'s containers' entries (dicts, lists, tuples, NamedTuples)."""
  if isinstance(prefix, Mapping):
    items = prefix.items()
  elif isinstance(prefix, (list, tuple)):
    items = zip(getattr(prefix, "_fields", range(len(prefix))), prefix, strict=True)
  else:
    return []
  return [p for k, v in items for p in [(*at, k), *_prefix_paths(v, (*at, k))]]


def _prefix_error(what: str) -> ValueError:
  return ValueError(
    f"reduce= must be a rule or a tree prefix of the params with a rule per subtree (dicts "
    f"by key, lists by position), but {what}. Rules: {RULES}. Or pass a callable of the "
    "params tree returning the prefix."
  )


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


# ------------------------------------------------------------------ the rules, validated


SUMMED = frozenset({"mean", "sum"})
MAX_LIKE = frozenset({"max", "grad_amax_history"})


class Aggregation(NamedTuple):
  """How a window combines its microbatches; made by :func:`optax_accum.aggregate` (its Args).

  Configuration only: it keeps no sub-state (the rules live in the closure, optax's way).
  What the microstep calls: :meth:`add` (a microbatch into the window), :meth:`all_reduce`
  (the window over the devices), :meth:`value` and :meth:`usable` (the denominator),
  :meth:`split` (the boundary's leaf groups) and :meth:`inner_for` (the inner optimizer,
  masked from overwritten leaves).
  """

  denominator: float | Callable[[jax.Array], Any] | jax.Array | None
  apply_empty: bool
  reduce: Any
  overwrite: bool

  @property
  def weighted_mean(self) -> bool:
    """Every setting at its default: the weighted mean (Flax FP8 leaves aside)."""
    return self.denominator is None and not self.apply_empty and self.reduce is None

  def rules(self, tree: PyTree) -> tuple[str, ...]:
    """The rule of each leaf of ``tree`` (grads or params), in ``jax.tree.leaves`` order."""
    if self.reduce is None:
      try:
        return defaults(jax.tree.structure(tree))
      except (TypeError, ValueError):  # a node type that cannot be rebuilt from placeholders
        paths = jax.tree_util.tree_flatten_with_path(tree)[0]
        return tuple(default_rule(path) for path, _ in paths)
    prefix = self.reduce(tree) if callable(self.reduce) else self.reduce
    return of_prefix(prefix, tree)

  def active(self, tree: PyTree) -> bool:
    """Whether anything but the default weighted mean of every leaf is configured."""
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

  def add(self, acc: PyTree, grads: PyTree, w: jax.Array, first: Any) -> PyTree:
    """The window's sums with a microbatch of weight ``w`` added, leaf by leaf per rule."""
    return add(self.rules(acc), acc, grads, w, first)

  def all_reduce(
    self, grads: PyTree, rest: PyTree, has: jax.Array, axis_name: Any
  ) -> tuple[PyTree, PyTree]:
    """``(grads, rest)`` summed over ``axis_name`` in one variadic ``psum`` (max/last leaves: a
    ``pmax`` first); ``has``: whether this device's window has weight."""
    return reduce_devices(
      self.rules(grads),
      grads,
      rest,
      has,
      jax.lax.axis_index(axis_name),
      lambda t: jax.lax.psum(t, axis_name),
      lambda t: jax.lax.pmax(t, axis_name),
    )

  def split(self, tree: PyTree) -> Split:
    """The boundary's leaf groups of a window shaped like ``tree``."""
    return Split.of(self, tree)

  def value(self, weight_sum: jax.Array, num_updates: jax.Array | None) -> jax.Array:
    """The window's denominator: its weight sum, or the fixed number (schedule) in its dtype.

    A schedule's value is checked like a fixed one where it is concrete (eager calls); a
    traced one that is not finite and > 0 makes the window non-finite (:meth:`usable`).
    """
    if self.denominator is None:
      return weight_sum
    d = self.denominator
    if callable(d):
      assert num_updates is not None, "a schedule is accumulate's (in-step refuses one)"
      d = denominator_value(d(num_updates), "the denominator schedule's value")
    return jnp.asarray(d).astype(weight_sum.dtype)

  def usable(self, d: jax.Array) -> jax.Array:
    """Whether a fixed denominator can divide: finite and > 0 (True for the weight sum)."""
    if self.denominator is None:
      return jnp.ones((), jnp.bool_)
    return (d > 0) & jnp.isfinite(d)

  def loss_denominator(self, value_weight: jax.Array, d: jax.Array) -> jax.Array:
    """What the window's loss (``value``) is divided by: the weight of the microbatches that
    passed one, or the fixed denominator."""
    return value_weight if self.denominator is None else d


def aggregate(
  denominator: float | Callable[[jax.Array], Any] | jax.Array | None = None,
  *,
  apply_empty: bool = False,
  reduce: Any = None,
  overwrite: bool = True,
) -> Aggregation:
  """How a window combines its microbatches: the denominator and per-leaf rules.

  For ``accumulate(inner, every_k, aggregate=...)`` and
  ``microbatched_value_and_grad(..., aggregate=...)``. The default, ``aggregate()``, is the
  weighted mean ``sum_i w_i g_i / sum_i w_i`` of every leaf (and Flax's FP8 rule in its
  ``_overwrite_with_gradient`` collection). docs/aggregation.md.

  Args:
    denominator: None (default): divide the window's weighted sum by its weight sum. A number
      > 0, or (across steps) a callable of ``num_updates`` (int32) returning one, or (in-step)
      a 0-d array: divide by it whatever the realized weight (DP-SGD's expected batch size, a
      token count known in advance; global under ``axis_name``); ``1``: the plain sum
      ``sum_i w_i g_i``. The window's ``value`` (loss) is divided the same way. A schedule's
      value that is not finite and > 0 raises where it is concrete; traced, it skips the window
      (counted in ``num_skipped``). In-step, a fixed denominator needs an explicit
      ``weight_fn`` (what each microbatch's gradient is multiplied by).
    apply_empty: with a fixed ``denominator``, run the inner optimizer on the zero mean of an
      empty window (weight 0: DP-SGD's noise is still added) instead of skipping it. A flush
      of a window that holds no microbatch stays a no-op.
    reduce: per-leaf rules, a rule or a tree prefix of the params with one per subtree (or a
      callable of the params tree returning one): ``'mean'`` (by the denominator), ``'sum'``
      (``sum_i w_i g_i``), ``'max'`` (elementwise, over the microbatches with weight > 0),
      ``'last'``, ``'grad_amax_history'`` (an FP8 amax history of a gradient, newest entry
      first: that entry is ``max_i w_i x_i / denominator``). None: ``'mean'``, and Flax's FP8
      rule in its ``_overwrite_with_gradient`` collection. A dict prefix matches any mapping by
      key (``nnx.State`` too). Max, last and FP8 leaves are values, not gradients: the loss
      scale does not divide them.
    overwrite: leaves reduced by max, last or the FP8 rule are overwritten with their window
      value at an applied boundary (Flax's rule for that collection; exact on the fused path,
      ``value - param`` from ``tx.update``) instead of going through ``inner``.

  Returns:
    An ``Aggregation``.

  Raises:
    TypeError, ValueError: naming a bad argument (a denominator not finite and > 0,
      ``apply_empty`` without a denominator, an unknown rule).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2,
    ...                             aggregate=optax_accum.aggregate(denominator=16))
    >>> params = {'w': jnp.zeros(2)}
    >>> u, state = tx.update({'w': jnp.array([1., 1.])}, tx.init(params), params, weight=3)
    >>> u, state = tx.update({'w': jnp.array([5., 5.])}, state, params, weight=1)
    >>> u['w']  # -(3 * 1 + 1 * 5) / 16: the fixed denominator, not the weight
    Array([-0.5, -0.5], dtype=float32)

  References:
    Abadi et al. 2016, `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_ (the expected batch size); Hugging Face,
    `Fixing gradient accumulation <https://huggingface.co/blog/gradient_accumulation>`_
    (``num_items_in_batch``); Flax ``fp8_ops`` (the ``_overwrite_with_gradient`` collection).
  """
  if denominator is not None and not callable(denominator):
    denominator = denominator_value(denominator)
  for flag, name in ((apply_empty, "apply_empty"), (overwrite, "overwrite")):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"aggregate: {name} must be True or False, got {flag!r}.")
  if apply_empty and denominator is None:
    raise ValueError(
      "aggregate: apply_empty=True needs a fixed denominator: an empty window has no weight to "
      "divide by. Pass denominator= (e.g. DP-SGD's expected batch size)."
    )
  if reduce is not None and not callable(reduce):
    for rule in jax.tree.leaves(reduce):
      if rule not in RULES:
        raise ValueError(f"aggregate: reduce has the rule {rule!r}; each must be one of {RULES}.")
  return Aggregation(denominator, bool(apply_empty), reduce, bool(overwrite))


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


def check_in_step(aggregation: Any, noise_scale: bool, weight_fn: Any) -> Aggregation:
  """``microbatched_value_and_grad``'s aggregation: a value, not a schedule; the weighted mean
  with ``noise_scale``; a fixed denominator with an explicit ``weight_fn``."""
  aggregation = aggregate() if aggregation is None else aggregation
  if not isinstance(aggregation, Aggregation):
    raise TypeError(f"aggregate must be optax_accum.aggregate(...) or None, got {aggregation!r}.")
  if callable(aggregation.denominator):
    raise TypeError(
      "microbatched_value_and_grad takes a denominator value (a number or a 0-d array), "
      "not a schedule: pass aggregate(denominator=schedule(step)) for this step."
    )
  if noise_scale and not aggregation.weighted_mean:
    raise ValueError(
      "noise_scale=True estimates the noise of a weighted mean: leave out aggregate=, or "
      "noise_scale."
    )
  if aggregation.denominator is not None and weight_fn is None:
    raise ValueError(
      "microbatched_value_and_grad with a fixed denominator needs weight_fn=, what each "
      "microbatch's gradient is multiplied by before the division (accumulate's weight=, "
      "whose default is 1): weight_fn=lambda mb: 1 for losses already at the window's scale "
      "(e.g. a sum over the batch divided by its known total), or the count its mean is over "
      "for mean losses (weight_fn=lambda mb: mb['mask'].sum(), or rows). The default, rows, "
      "would differ from accumulate's default weight 1 (docs/aggregation.md)."
    )
  return aggregation


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
  return jnp.where(take, jnp.where(first, g, _max_keeping_nonfinite(a, g)), a)


def _max_keeping_nonfinite(a: jax.Array, g: jax.Array) -> jax.Array:
  """``max(a, g)`` elementwise, non-finite wherever either is (``a + g``: NaN or an Inf), so that
  the boundary's finite check sees it; nothing here trusts ``max`` to carry a NaN (-Inf would not
  survive a max at all)."""
  return jnp.where(jnp.isfinite(a) & jnp.isfinite(g), jnp.maximum(a, g), a + g)


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
  # A pmax need not carry a NaN: the max leaves' non-finite elements are counted and summed.
  bad = {i: _nonfinite_count(leaves[i], has) for i in maxed}
  # The device index rides in the max leaves' all-reduce as a float (exact below 2**24).
  dtype = next((leaves[i].dtype for i in maxed), jnp.float32)
  mine = jnp.where(has, index, -1).astype(dtype) if "last" in rules else None
  maxed, top = pmax((maxed, mine))
  summed = {i: x for i, (r, x) in enumerate(zip(rules, leaves, strict=True)) if r in SUMMED}
  for i, r in enumerate(rules):
    if r == "last":
      x = leaves[i]
      summed[i] = jnp.where(_expand(mine == top, x), x, jnp.zeros((), x.dtype))
  summed, rest, bad = psum((summed, rest, bad))
  maxed = {i: jnp.where(bad[i] > 0, jnp.asarray(jnp.nan, x.dtype), x) for i, x in maxed.items()}
  out = [maxed[i] if i in maxed else summed[i] for i in range(len(leaves))]
  return jax.tree.unflatten(treedef, out), rest


def _nonfinite_count(x: jax.Array, has: jax.Array) -> jax.Array:
  """How many elements of ``x`` are NaN or Inf where ``has`` (per device, or per lane: ``has``'s
  axes lead ``x``'s), float32 with ``has``'s shape."""
  bad = _expand(has, x) & ~jnp.isfinite(x)
  return jnp.sum(bad, axis=tuple(range(jnp.ndim(has), jnp.ndim(x)))).astype(jnp.float32)


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


# ------------------------------------------------------------------ the boundary's leaf groups


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
    """The groups of ``tree``'s leaves under ``agg``'s rules."""
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

  def fits(self, g_sum, d, scale, norm, like) -> jax.Array:
    """Whether the summed leaves' window values fit ``like``'s (maybe fp16) dtypes."""
    if self.plain:
      return _numerics.fits(g_sum, self._divisor("mean", d, scale), norm, like)
    leaves, likes = jax.tree.leaves(g_sum), jax.tree.leaves(like)
    ok = jnp.array(True)
    for idx, kind in self.groups:
      sub = self._leaves(idx, leaves, kind, d)
      div = self._divisor(kind, d, scale)
      ok = ok & _numerics.fits(sub, div, norm, [likes[i] for i in idx])
    return ok

  def window_values(self, g_sum, d, scale, like) -> PyTree:
    """What the inner optimizer gets: each group's window value, cast like ``like``;
    the overwritten leaves' reduced values (the inner does not see them)."""
    if self.plain:
      return _numerics.window_mean(g_sum, self._divisor("mean", d, scale), like)
    leaves, treedef = jax.tree.flatten(g_sum)
    likes = jax.tree.leaves(like)
    out = list(leaves)
    for idx, kind in self.groups:
      sub = self._leaves(idx, leaves, kind, d)
      div = self._divisor(kind, d, scale)
      values = _numerics.window_mean(sub, div, [likes[i] for i in idx])
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
        "aggregate(reduce=...) overwrites max/last leaves at the boundary, which needs the "
        "params: pass params to tx.update (or aggregate(..., overwrite=False) to hand them to "
        "the inner optimizer)."
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
