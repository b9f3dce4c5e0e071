"""Resuming from a checkpoint: restore targets and a compatibility check.

A checkpoint of the whole state resumes bitwise, mid-window included; what can
go wrong is a transformation configured differently (Orbax casts restored leaves
to the target's dtypes without a word). :func:`check_compatible` says what differs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_accum._sharding import on_mesh, state_shardings
from optax_accum._state import (
  FEATURE_FIELDS,
  _is_state,
  find_states,
  map_per_device,
  map_states,
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
  """``restored`` (another configuration, or without ``accumulate``) as a state of ``tx``.

  A state of another ``accumulate`` configuration whose sub-states differ (a token budget, a
  loss scale, guards or observers added or removed) moves to ``tx``'s once its window is
  empty (after a boundary or a flush): the inner optimizer's state (Adam's moments and count)
  and the counters are kept, and so is every feature sub-state of the same structure (the loss
  scale, a spike rule's history); the others start fresh. Another ``every_k`` needs no move:
  the window length lives in ``tx`` (optax's way), so the state continues as it is, its open
  window counted toward the new length. A run started without accumulation continues with it:
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
      gives, or holds an open window (flush it, or :func:`optax_accum.discard` it, first).

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
    >>> budget = optax_accum.accumulate(optax.adam(1e-3), optax_accum.token_budget(4096))
    >>> moved = optax_accum.sharding.migrate_state(budget, params, state)  # windows in tokens
    >>> type(moved.policy).__name__, int(moved.num_updates)
    ('TokenBudgetState', 0)
  """
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
  and dtypes, so each feature's sub-state (a loss scale, a token budget, guards, observers),
  the accumulator dtype and the inner optimizer's state must be ``tx``'s. The configuration
  itself lives in ``tx``'s closure, as optax's transformations keep it, and is not stored:
  a state made with another ``every_k``, loss-scale policy or aggregation rule but the same
  leaves is accepted and continues under ``tx``'s (the open window's sums are data: the loss
  scale they were scaled by is in the state, so they are unscaled correctly).

  Orbax casts leaves to the restore target's dtypes, so check the checkpoint's metadata
  before restoring::

    meta = checkpointer.metadata(path).item_metadata.tree
    optax_accum.sharding.check_compatible(tx, params, meta)
    state = checkpointer.restore(path, optax_accum.sharding.abstract_state(tx, params))

  Args:
    tx: the transformation to resume with.
    params: the params (arrays or ``jax.ShapeDtypeStruct``) it was initialized with.
    state: the restored state, or any tree of leaves with ``shape`` and ``dtype`` (Orbax
      ``ArrayMetadata``; dicts and lists match NamedTuples and tuples by field and index).
    stacked: True for a :func:`optax_accum.sharding.stack_windows` state (a device axis).

  Returns:
    ``state``, unchanged.

  Raises:
    ValueError: listing every differing leaf, with what to do; for a state written with
      accumulation restored without it (or the reverse), naming ``migrate_state``.

  Examples:
    >>> import optax, optax_accum
    >>> params = {'w': jnp.zeros(3)}
    >>> saved = optax_accum.accumulate(optax.sgd(1.0), every_k=4).init(params)
    >>> scaled = optax_accum.accumulate(
    ...     optax.sgd(1.0), every_k=4, loss_scale=optax_accum.dynamic_loss_scale())
    >>> optax_accum.sharding.check_compatible(scaled, params, saved)
    Traceback (most recent call last):
    ...
    ValueError: The restored optimizer state does not match this transformation:
      loss_scale.growth_streak: missing from the restored state
    ...
  """
  expected = on_mesh(tx.init, params, shapes=True)
  if stacked:
    expected = _stacked_shapes(expected)
  want, got = _leaves_by_path(expected), _leaves_by_path(state)
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
      for f in FEATURE_FIELDS
    }
    return new._replace(**{k: getattr(s, k) for k in kept}, **features, inner_state=s.inner_state)

  return jax.tree.map(move, fresh, is_leaf=_is_state)
