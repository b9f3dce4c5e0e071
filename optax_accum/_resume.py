"""Resuming from a checkpoint: restore targets and a compatibility check.

A checkpoint of the whole state resumes bitwise, mid-window included; what can
go wrong is a transformation configured differently (Orbax casts restored leaves
to the target's dtypes without a word). :func:`check_compatible` says what differs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _aggregation, _migration
from optax_accum._sharding import on_mesh, state_shardings
from optax_accum._state import (
  Fingerprint,
  _is_state,
  find_states,
  fingerprint_of,
  fingerprint_problems,
  map_per_device,
  map_states,
  raise_on_problems,
)

PyTree = Any


def abstract_state(tx: optax.GradientTransformation, params: PyTree) -> PyTree:
  """The shapes, dtypes and shardings of ``tx.init(params)``, without computing it.

  The target of a sharded restore (orbax's ``StandardCheckpointer().restore(path, target)``):
  each restored leaf is read directly into its shard.

  Args:
    tx: any ``optax.GradientTransformation``.
    params: a tree of sharded ``jax.Array`` or ``jax.ShapeDtypeStruct`` with
      ``sharding`` (see :func:`optax_accum.sharding.state_shardings`).

  Returns:
    A tree of ``jax.ShapeDtypeStruct``: ``jax.eval_shape(tx.init, params)`` with the
    shardings of :func:`optax_accum.sharding.state_shardings`.

  Raises:
    TypeError: as :func:`optax_accum.sharding.state_shardings` (a param without sharding).

  Examples:
    >>> import optax, optax_accum
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> params = jax.device_put({'w': jnp.zeros(8)}, NamedSharding(mesh, P('data')))
    >>> tx = optax_accum.accumulate(optax.sgd(1.), 2)
    >>> target = optax_accum.sharding.abstract_state(tx, params)
    >>> tuple(target.window.grad_sum['w'].sharding.spec)  # sharded like the param
    ('data',)
  """
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    jax.eval_shape(tx.init, params),
    state_shardings(tx, params),
  )


def _key(entry: Any) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _leaves_by_path(tree: PyTree) -> dict[str, Any]:
  """Leaves keyed by a path that NamedTuples and Orbax's metadata dicts share."""
  out = {}
  is_leaf = lambda x: x is not None and hasattr(x, "shape") and hasattr(x, "dtype")
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
    out[".".join(_key(e) for e in path)] = leaf
  return out


def _fingerprints(tx: optax.GradientTransformation, params: PyTree) -> list[Fingerprint]:
  """The fingerprint of each state ``tx.init`` writes, computed without materializing it."""
  shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), p.dtype), params)

  def fields(p):
    return [(s.every_k, s.loss_scale, s.aggregation) for s in find_states(tx.init(p))]

  def made():  # zeros of the params' shapes, never materialized outside the program
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return on_mesh(fields, zeros, like=params)

  found = [_fingerprint(*f) for f in jax.jit(made)()]
  return [fp for fp in found if fp is not None]  # all of them: jit's outputs are concrete


def _fingerprint(every_k: Any, loss_scale: Any, aggregation: Any) -> Fingerprint | None:
  """A state's fingerprint, its aggregation rules included (None while traced)."""
  fp = fingerprint_of(every_k, loss_scale)
  return None if fp is None else fp._replace(aggregation=_aggregation.fingerprint(aggregation))


# Leaves only the previous release's flat state had (optax_accum 0.2).
_OLD_LAYOUT = ("loss_scale_kind", "window_weight_parts", "noise_sq_sum")


def _check_layout(got: dict[str, Any]) -> None:
  """Raises for a checkpoint of an earlier release's state, naming the step to take."""
  if _migration.is_03(got):
    raise ValueError(
      "The restored optimizer state was written by optax_accum 0.3 (its AccumulationState "
      "has no flush_pending; a token budget's and a noise scale's sub-states were named "
      "token_budget and noise_scale, now policy and observers). Restore it without a target "
      "(e.g. orbax's checkpointer.restore(path) gives a tree of arrays), then convert it: "
      "state = optax_accum.sharding.migrate_state(tx, params, restored)."
    )
  old = sorted(p for p in got if p.rsplit(".", 1)[-1] in _OLD_LAYOUT)
  if old:
    raise ValueError(
      f"The restored optimizer state was written by optax_accum 0.2 (its flat "
      f"AccumulationState has {old[0]}). Since 0.3 the state is nested: the open window in "
      "state.window (acc is window.grad_sum), and each optional feature in its own sub-state "
      "(loss_scale, token_budget, noise_scale; optax.EmptyState() when off), so the leaves "
      "do not map one to one. Finish the window with optax_accum 0.2 (optax_accum.flush) "
      "and save the params, or resume with 0.2; then start a fresh state with "
      "tx.init(params)."
    )


def _accumulates(paths: Any) -> bool:
  return any(p.rsplit(".", 1)[-1] == "mini_step" for p in paths)


def _check_accumulation(want: dict[str, Any], got: dict[str, Any]) -> None:
  """Raises for a checkpoint written with accumulation restored without it, or the reverse."""
  if _accumulates(want) == _accumulates(got):
    return
  written = "without" if _accumulates(want) else "with"
  raise ValueError(
    f"The restored optimizer state was written by a run {written} optax_accum.accumulate, "
    f"and tx is {'with' if written == 'without' else 'without'} it: the layouts differ (the "
    "accumulate state holds the inner optimizer's state in inner_state), so a restore into "
    "tx.init(params) would silently keep fresh values (Adam's count and the warmup would "
    "restart). Restore it with the layout it was written with (the old optimizer's "
    "init(params) as the target), then convert it: "
    "optax_accum.sharding.migrate_state(tx, params, restored)."
  )


def migrate_state(tx: optax.GradientTransformation, params: PyTree, restored: PyTree) -> PyTree:
  """``restored`` (another configuration, without ``accumulate``, or 0.3's) as a state of ``tx``.

  A state of another ``accumulate`` configuration (another ``every_k``, a token budget, a
  loss scale, guards or observers added or removed: a larger effective batch mid-run) moves to
  ``tx``'s once its window is empty (after a boundary or a flush): the inner optimizer's state
  (Adam's moments and count) and the counters are kept, and so is every feature sub-state of
  the same structure (the loss scale, a spike rule's history); the others start fresh.

  A 0.3 checkpoint (restored without a target, as a tree of arrays) is converted leaf by leaf:
  the token budget's and noise scale's sub-states move to ``policy`` and ``observers``, and
  the leaves 0.4 added take their fresh values (the open window, counters and inner state are
  kept, so a run resumes mid-window). A run started without accumulation continues with it:
  each ``accumulate`` state of
  ``tx.init(params)`` takes, as its ``inner_state``, the restored state in its place (an empty
  window, counters from 0; the inner optimizer's own count, its schedules and Adam's bias
  correction continue). The reverse keeps each ``inner_state``, after a window that is empty.

  Args:
    tx: the transformation to continue with.
    params: the params (arrays, or ``jax.ShapeDtypeStruct`` only for the reverse).
    restored: the restored state, with the types its optimizer's ``init`` gives (restore it
      with that ``init(params)``, or ``jax.eval_shape`` of it, as the target).

  Returns:
    A state of ``tx``; checked with :func:`check_compatible`.

  Raises:
    ValueError: if ``restored`` does not have the layout ``tx`` less (or plus) ``accumulate``
      gives, or holds an open window (flush it, or :func:`optax_accum.discard` it, first);
      a 0.3 state that lacks a leaf ``tx`` needs.

  Examples:
    >>> import optax, optax_accum
    >>> params = {'w': jnp.zeros(3)}
    >>> old = optax.adam(1e-3).init(params)  # written by a run without accumulation
    >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4)
    >>> state = optax_accum.sharding.migrate_state(tx, params, old)
    >>> int(state.inner_state[0].count), int(state.mini_step)
    (0, 0)
    >>> optax_accum.sharding.migrate_state(optax.adam(1e-3), params, state)[0].count
    Array(0, dtype=int32)
    >>> larger = optax_accum.accumulate(optax.adam(1e-3), every_k=8)  # a larger batch
    >>> int(optax_accum.sharding.migrate_state(larger, params, state).every_k)
    8
  """
  if _migration.is_03(_leaves_by_path(restored)):
    return check_compatible(tx, params, _from_03(tx, params, restored))
  restored_states = find_states(restored)
  if not find_states(jax.eval_shape(tx.init, params)):
    if held := _open_window(restored_states):
      raise ValueError(
        f"The restored accumulate state's open window holds {held} microbatches, which a state "
        "without accumulate cannot keep. Close it first (optax_accum.flush, or flush=True on its "
        "last microbatch) or drop it (optax_accum.discard)."
      )
    migrated = map_states(lambda s: s.inner_state, restored)
  elif restored_states:
    try:
      return check_compatible(tx, params, restored)
    except ValueError:
      migrated = _reconfigure(tx, params, restored)
  else:
    adopt = lambda fresh, old: fresh._replace(inner_state=old) if _is_state(fresh) else old
    try:
      migrated = jax.tree.map(adopt, tx.init(params), restored, is_leaf=_is_state)
    except ValueError as e:
      raise ValueError(
        "The restored state does not have the layout of tx without accumulate: restore it "
        f"with the old optimizer's init(params) as the target. ({e})"
      ) from e
  return check_compatible(tx, params, migrated)


def check_compatible(
  tx: optax.GradientTransformation, params: PyTree, state: PyTree, *, stacked: bool = False
) -> PyTree:
  """Checks that a restored optimizer state belongs to ``tx`` before training on.

  Compares ``state`` with an abstract ``tx.init(params)``: the same leaves (by path), shapes
  and dtypes, and in every ``accumulate`` state the same ``every_k`` and loss-scale kind
  (and static value). Resuming with another window length, loss scale or accumulator dtype
  would silently mix windows, divide by the wrong scale or round the sum differently.

  Orbax casts leaves to the restore target's dtypes, so check the checkpoint's metadata
  before restoring, then the restored values (for the fingerprint)::

    meta = checkpointer.metadata(path).item_metadata.tree
    optax_accum.sharding.check_compatible(tx, params, meta)
    state = checkpointer.restore(path, optax_accum.sharding.abstract_state(tx, params))
    optax_accum.sharding.check_compatible(tx, params, state)

  Args:
    tx: the transformation to resume with.
    params: the params (arrays or ``jax.ShapeDtypeStruct``) it was initialized with.
    state: the restored state, or any tree of leaves with ``shape`` and ``dtype`` (Orbax
      ``ArrayMetadata``; dicts and lists match NamedTuples and tuples by field and index).
    stacked: True for a :func:`optax_accum.sharding.stack_windows` state (a device axis).

  Returns:
    ``state``, unchanged.

  Raises:
    ValueError: listing every differing leaf, or the fingerprints (``every_k``,
      loss scale), with what to do; for a checkpoint of optax_accum 0.2's flat
      state, naming the change to the nested one.

  Examples:
    >>> import optax, optax_accum
    >>> params = {'w': jnp.zeros(3)}
    >>> saved = optax_accum.accumulate(optax.sgd(1.0), every_k=4).init(params)
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=8)
    >>> optax_accum.sharding.check_compatible(tx, params, saved)
    Traceback (most recent call last):
    ...
    ValueError: The restored optimizer state was made by another accumulate configuration:
    the state has every_k=4, the transformation every_k=8. ...
  """
  expected = on_mesh(tx.init, params, shapes=True)
  if stacked:
    expected = _stacked_shapes(expected)
  want, got = _leaves_by_path(expected), _leaves_by_path(state)
  _check_layout(got)
  _check_accumulation(want, got)
  problems, one_axis_more = [], False
  for path in sorted(want.keys() - got.keys()):
    problems.append(f"  {path}: missing from the restored state")
  for path in sorted(got.keys() - want.keys()):
    problems.append(f"  {path}: in the restored state but not in tx.init(params)")
  for path in sorted(want.keys() & got.keys()):
    w, g = want[path], got[path]
    w_shape = tuple(w.shape)
    g_shape = tuple(g.shape)
    if stacked and w_shape and w_shape[0] == -1:
      w_shape = (g_shape[0] if g_shape else -1, *w_shape[1:])
    if w_shape != g_shape or jnp.dtype(w.dtype) != jnp.dtype(g.dtype):
      one_axis_more |= not stacked and g_shape[1:] == w_shape
      problems.append(
        f"  {path}: restored {jnp.dtype(g.dtype)}{list(g_shape)}, "
        f"tx.init gives {jnp.dtype(w.dtype)}{list(w_shape)}"
      )
  if problems:
    hint = (
      "\nThe restored window has a leading device axis: a stack_windows state (shard_map, "
      "axis_name=) is checked with check_compatible(..., stacked=True)."
      if one_axis_more
      else ""
    )
    hint += _sharding_hint(want, got)
    raise ValueError(
      "The restored optimizer state does not match this transformation:\n"
      + "\n".join(problems)
      + hint
      + "\nRestore with the configuration that wrote the checkpoint (the same inner "
      "optimizer, accumulator_dtype and param dtypes), or start a fresh optimizer state "
      "with tx.init(params) and keep only the params."
    )
  restored = [_fingerprint(s.every_k, s.loss_scale, s.aggregation) for s in find_states(state)]
  concrete = [fp for fp in restored if fp is not None]
  if restored and len(concrete) == len(restored):
    expected_fp = _fingerprints(tx, params)
    where = lambda i: f"accumulate state {i}: " if len(expected_fp) > 1 else ""
    problems = [
      where(i) + p
      for i, (got_fp, want_fp) in enumerate(zip(concrete, expected_fp, strict=True))
      for p in fingerprint_problems(got_fp, want_fp)
    ]
    raise_on_problems(problems, "The restored optimizer state")
  return state


def _sharding_hint(want: dict[str, Any], got: dict[str, Any]) -> str:
  """Names a replicated/sharded inner state mismatch, or shards of another device count."""
  sharded = lambda paths: any(".inner_state.inner." in f".{p}" for p in paths)
  if sharded(want) != sharded(got):
    how = lambda s: "sharded (shard_optimizer=True)" if s else "replicated"
    return (
      f"\nThe restored inner state is {how(sharded(got))}, this tx's is {how(sharded(want))}: "
      "restore with the accumulate(..., shard_optimizer=...) that wrote it."
    )
  differs = [
    p for p in want.keys() & got.keys()
    if ".inner_state.inner." in f".{p}" and tuple(want[p].shape)[-1:] != tuple(got[p].shape)[-1:]
  ]  # fmt: skip
  if differs:
    return (
      "\nThe inner state's shards (shard_optimizer=True) have other sizes: the checkpoint was "
      "written on another number of devices. Restore it on a mesh of the same size."
    )
  return ""


class _Leaf:
  """An expected leaf; a leading ``-1`` in ``shape`` matches any device-axis length."""

  def __init__(self, shape: tuple[int, ...], dtype: Any):
    self.shape, self.dtype = shape, dtype


def _stacked_shapes(expected: PyTree) -> PyTree:
  """Expected shapes with a leading device axis on the window sums."""
  return map_states(lambda s: map_per_device(lambda a: _Leaf((-1, *a.shape), a.dtype), s), expected)


def _open_window(states: list[Any]) -> int:
  """The microbatches held by the first concrete state with an open window, else 0."""
  for s in states:
    if not isinstance(s.mini_step, jax.core.Tracer) and int(s.mini_step):
      return int(s.mini_step)
  return 0


def _reconfigure(tx: optax.GradientTransformation, params: PyTree, restored: PyTree) -> PyTree:
  """``restored``'s accumulate states, each with an empty window, moved into ``tx.init(params)``'s
  configuration: counters and the inner state kept, feature sub-states kept where their
  structure is the same."""
  old = find_states(restored)
  fresh = tx.init(params)
  if len(old) != len(find_states(fresh)):
    raise ValueError(
      f"The restored state holds {len(old)} accumulate states and tx.init(params) "
      f"{len(find_states(fresh))}: restore it into the transformation that wrote it."
    )
  if held := _open_window(old):
    raise ValueError(
      f"The restored state's open window holds {held} microbatches of the old "
      "configuration; a state moves to another window length or policy only between "
      "windows. Close the window with the old transformation first (optax_accum.flush(old_tx, "
      "state, params), or flush=True on its last microbatch) or drop it "
      "(optax_accum.discard(state)), then migrate_state(tx, params, state)."
    )
  same = lambda a, b: jax.tree.structure(a) == jax.tree.structure(b)
  kept = ("num_microbatches", "num_updates", "num_skipped", "updated", "window_loss",
          "has_window_loss", "grad_norm", "has_grad_norm")  # fmt: skip
  olds = iter(old)

  def move(new):
    if not _is_state(new):
      return new
    s = next(olds)
    if not same(new.inner_state, s.inner_state):
      raise ValueError(
        "The restored state's inner optimizer state does not have the structure of tx's inner "
        "optimizer: migrate_state keeps the inner state (Adam's moments), so the inner "
        "optimizer must be the same."
      )
    features = {
      f: getattr(s, f) if same(getattr(new, f), getattr(s, f)) else getattr(new, f)
      for f in ("loss_scale", "policy", "observers", "guard", "aggregation")
    }
    return new._replace(**{k: getattr(s, k) for k in kept}, **features, inner_state=s.inner_state)

  return jax.tree.map(move, fresh, is_leaf=_is_state)


def _from_03(tx: optax.GradientTransformation, params: PyTree, restored: PyTree) -> PyTree:
  """A 0.3 state (any tree of arrays with its leaf paths) as a state of ``tx``."""
  got = _leaves_by_path(restored)
  fresh = tx.init(params)
  prefixes = [
    ".".join(_key(e) for e in path)
    for path, x in jax.tree_util.tree_flatten_with_path(fresh, is_leaf=_is_state)[0]
    if _is_state(x)
  ]
  leaves = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(fresh)[0]:
    name = ".".join(_key(e) for e in path)
    prefix = next((p for p in prefixes if name.startswith(p + ".") or p == ""), None)
    old = name
    if prefix is not None:
      inside = name[len(prefix) + 1 :] if prefix else name
      mapped = _migration.state_path_03(inside)
      old = None if mapped is None else (f"{prefix}.{mapped}" if prefix else mapped)
    if old is None:
      leaves.append(leaf)  # a leaf 0.4 added: its fresh value
    elif old in got:
      leaves.append(jnp.asarray(got[old], leaf.dtype).reshape(leaf.shape))
    else:
      raise ValueError(
        f"The 0.3 state has no leaf {old}, which this tx's state needs at {name}: restore the "
        "checkpoint with the configuration that wrote it (the same every_k, token budget, "
        "noise scale, guards and inner optimizer), in their 0.4 spelling."
      )
  return jax.tree.unflatten(jax.tree.structure(fresh), leaves)
