"""Which aggregation rule each leaf gets: ``reduce=``'s prefix, or the defaults.

A prefix is matched by the leaves' key paths (a dict by key against any mapping, ``nnx.State``
too; a list or tuple by position; a NamedTuple or dataclass by field name). The default is
``'mean'``, and in Flax's ``_overwrite_with_gradient`` collection (FP8 scales and amax
histories) the rule that makes a window equal one physical batch (``default_rule``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax

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
