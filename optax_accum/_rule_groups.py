"""The boundary's values under aggregation rules: the leaves grouped by what is done with them.

Across steps, ``_step.close`` reads the window through a :class:`Split`: the global norm and the
finite check of what the inner optimizer gets, the values it gets (each group divided once), and
the overwritten leaves (max, last, the FP8 history) set from their reduced values. With every
leaf a weighted mean this is exactly the default boundary (``_numerics``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_accum import _numerics
from optax_accum._aggregation import SUMMED, Aggregation, finish_other

PyTree = Any


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
