"""Sharded optimizer states: placement under ``jit`` and per-device windows in ``shard_map``.

Why and when to use each function: docs/scaling.md.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from optax_accum._state import map_per_device, map_states
from optax_accum._zero import UnboundAxisError

PyTree = Any


def _replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
  if sharding.is_fully_replicated:
    return sharding
  raise TypeError(
    f"Cannot derive a replicated sharding from {sharding!r}. Place the params with a "
    "jax.sharding.NamedSharding (or on a single device)."
  )


def state_shardings(tx: optax.GradientTransformation, params: PyTree) -> PyTree:
  """Shardings for ``tx.init(params)``'s state, derived from the params' shardings.

  A subtree shaped like the params (accumulator, Adam's moments) is sharded like
  them; another leaf of a param's shape like that param when all params of that
  shape agree; the rest is replicated on the params' mesh.

  Args:
    tx: any ``optax.GradientTransformation``.
    params: a tree of sharded ``jax.Array`` (or ``ShapeDtypeStruct``), one mesh.

  Returns:
    A tree of ``jax.sharding.Sharding`` like the state (``jax.jit(tx.init)``'s ``out_shardings``).

  Raises:
    TypeError: if a param has no sharding, or one with no replicated counterpart.

  Examples:
    >>> import optax, optax_accum
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> params = jax.device_put({'w': jnp.zeros((8, 2))}, NamedSharding(mesh, P('data')))
    >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4)
    >>> sh = optax_accum.sharding.state_shardings(tx, params)
    >>> [tuple(s.spec) for s in (sh.window.grad_sum['w'], sh.inner_state[0].mu['w'], sh.mini_step)]
    [('data',), ('data',), ()]
  """
  p_leaves, p_def = jax.tree.flatten(params)
  if not p_leaves:
    return jax.tree.map(lambda _: None, jax.eval_shape(tx.init, params))
  p_shardings = []
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    sharding = getattr(p, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
      raise TypeError(
        f"Param {jax.tree_util.keystr(path)} has no sharding ({type(p).__name__}). Place "
        "the params on the mesh first, e.g. jax.device_put(params, shardings)."
      )
    p_shardings.append(sharding)
  p_shapes = [np.shape(p) for p in p_leaves]
  replicated = _replicated(p_shardings[0])
  by_shape: dict[tuple[int, ...], list[jax.sharding.Sharding]] = collections.defaultdict(list)
  for shape, sharding in zip(p_shapes, p_shardings, strict=True):
    by_shape[shape].append(sharding)

  def like_params(x: Any) -> bool:
    leaves, treedef = jax.tree.flatten(x)
    return treedef == p_def and [np.shape(leaf) for leaf in leaves] == p_shapes

  def assign(x: Any) -> Any:
    if like_params(x):
      return jax.tree.unflatten(p_def, p_shardings)
    same_shape = by_shape.get(tuple(x.shape), [])
    if x.ndim and same_shape and all(s == same_shape[0] for s in same_shape):
      return same_shape[0]
    return replicated

  abstract = jax.eval_shape(tx.init, params)
  return jax.tree.map(assign, abstract, is_leaf=like_params)


def init_sharded(
  tx: optax.GradientTransformation, params: PyTree, axis_name: str | tuple[str, ...] | None = None
) -> PyTree:
  """``tx.init(params)`` placed on the params' mesh: like the params, or per device for shard_map.

  Without ``axis_name``: ``tx.init`` jitted with ``out_shardings=state_shardings(tx, params)``
  (the ``jax.jit`` recipe). With ``axis_name`` (``accumulate``'s, the ``shard_map`` recipe):
  ``tx.init`` runs inside ``jax.shard_map`` over that axis of the params' mesh, and each device's
  window (and, with ``shard_optimizer=True``, its ``1/n`` of the inner state: ZeRO-1) is laid out
  on a leading device axis, as :func:`stack_windows` lays a window out; :func:`window_specs`
  gives the step's specs.

  Args:
    tx: any ``optax.GradientTransformation``.
    params: sharded ``jax.Array`` leaves on one mesh (replicated over ``axis_name``).
    axis_name: None, or the ``shard_map`` axis (or axes) of ``accumulate(..., axis_name=...)``.

  Returns:
    The initial state.

  Raises:
    TypeError: as :func:`state_shardings` (a param without sharding); with ``axis_name``, a
      param not placed with a ``NamedSharding`` on a mesh with that axis.

  Examples:
    >>> import optax, optax_accum
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((4, 2), ('data', 'model'))
    >>> params = jax.device_put({'w': jnp.zeros((8, 4))}, NamedSharding(mesh, P('data')))
    >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4)
    >>> state = optax_accum.sharding.init_sharded(tx, params)
    >>> state.window.grad_sum['w'].sharding == params['w'].sharding
    True
  """
  if axis_name is None:
    return jax.jit(tx.init, out_shardings=state_shardings(tx, params))(params)
  mesh = _mesh_of(params, axis_name)
  axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  # Manual over axis_name only: the mesh's other axes (fsdp in HSDP) stay the compiler's.
  manual: dict[str, Any] = {"axis_names": set(axes)} if set(mesh.axis_names) - set(axes) else {}
  replicated = jax.tree.map(lambda _: PartitionSpec(), params)
  # The state's structure (not its shapes) says which leaves are per device.
  shape = jax.eval_shape(
    jax.shard_map(
      tx.init,
      mesh=mesh,
      in_specs=(replicated,),
      out_specs=PartitionSpec(),
      check_vma=False,
      **manual,
    ),  # fmt: skip
    params,
  )
  specs = window_specs(shape, axis_name)
  init = jax.shard_map(
    lambda p: stacked_state(tx.init(p)),
    mesh=mesh,
    in_specs=(replicated,),
    out_specs=specs,
    **manual,
  )
  return jax.jit(init)(params)


def on_mesh(fn, params: PyTree, shapes: bool = False, like: PyTree = None) -> Any:
  """``fn(params)`` (which calls ``tx.init``), or, for a ``tx`` that makes its state inside
  ``shard_map`` (``shard_optimizer=True``), ``fn`` inside ``shard_map`` over the params' mesh
  (each device's block: what one device holds). ``shapes``: ``jax.eval_shape`` of it; ``like``:
  where to read the mesh from when ``params`` are traced (the params themselves by default)."""
  call = (lambda f, *a: jax.eval_shape(f, *a)) if shapes else (lambda f, *a: f(*a))
  like = params if like is None else like
  try:
    return call(fn, params)
  except UnboundAxisError as e:
    mesh = next(
      (p.sharding.mesh for p in jax.tree.leaves(like)
       if isinstance(getattr(p, "sharding", None), NamedSharding)),
      None,
    )  # fmt: skip
    if mesh is None:
      raise ValueError(
        "this tx keeps 1/n of its inner state per device (shard_optimizer=True): pass the "
        "params placed on the mesh (jax.Array or ShapeDtypeStruct with a NamedSharding), so "
        "that the number of devices is known."
      ) from e
    specs = jax.tree.map(lambda p: _spec_on(p, mesh), like)
    body = jax.shard_map(
      fn, mesh=mesh, in_specs=(specs,), out_specs=PartitionSpec(), check_vma=False
    )
    return call(body, params)


def _mesh_of(
  params: PyTree, axis_name: str | tuple[str, ...]
) -> jax.sharding.Mesh | jax.sharding.AbstractMesh:
  """The mesh the params are placed on, which must have ``axis_name``."""
  axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    sharding = getattr(p, "sharding", None)
    if isinstance(sharding, NamedSharding) and all(a in sharding.mesh.shape for a in axes):
      return sharding.mesh
    raise TypeError(
      f"init_sharded(..., axis_name={axis_name!r}): param {jax.tree_util.keystr(path)} is not "
      f"placed with a NamedSharding on a mesh with the axis {axis_name!r}. Place the params "
      "first: jax.device_put(params, NamedSharding(mesh, P()))."
    )
  raise TypeError("init_sharded: params has no leaves.")


def window_specs(opt_state: PyTree, axis_name: str | tuple[str, ...]) -> PyTree:
  """The state's ``in_specs``/``out_specs`` for ``jax.shard_map``: ``P(axis_name)`` for windows.

  ``opt_state`` may be a ``jax.eval_shape``; ``axis_name`` is ``accumulate``'s. Returns a tree
  of ``PartitionSpec`` like ``opt_state``: each ``state.window`` leaf per device (and, with
  ``shard_optimizer=True``, each leaf of the inner state's shards), the rest ``P()``.

  Examples:
    >>> import optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, axis_name='data')
    >>> specs = optax_accum.sharding.window_specs(tx.init({'w': jnp.zeros(3)}), 'data')
    >>> [tuple(s) for s in (specs.window.grad_sum['w'], specs.window.weight_sum, specs.num_updates)]
    [('data',), ('data',), ()]
  """
  per_device, replicated = PartitionSpec(axis_name), PartitionSpec()
  is_spec = lambda x: isinstance(x, PartitionSpec)
  specs = map_states(lambda s: map_per_device(lambda _: per_device, s), opt_state)
  return jax.tree.map(lambda x: x if is_spec(x) else replicated, specs, is_leaf=is_spec)


def _spec_on(x: Any, mesh: jax.sharding.Mesh) -> PartitionSpec:
  """``x``'s ``PartitionSpec`` if it is placed with a ``NamedSharding`` on ``mesh``'s axes."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and dict(sharding.mesh.shape) == dict(mesh.shape):
    return sharding.spec
  return PartitionSpec()


def _place(x: Any, mesh: jax.sharding.Mesh, spec: PartitionSpec, n: int | None) -> jax.Array:
  """``x`` (with ``n`` copies stacked in front, for a window leaf) as a global array on ``mesh``."""
  sharding = NamedSharding(mesh, spec)
  if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding):  # maybe multi-process
    stack = lambda x: x if n is None else jax.numpy.broadcast_to(x, (n, *x.shape))
    return jax.jit(stack, out_shardings=sharding)(x)
  x = np.asarray(x) if n is None else np.broadcast_to(np.asarray(x), (n, *np.shape(x)))
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def stack_windows(
  opt_state: PyTree, mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...]
) -> PyTree:
  """Places a fresh ``tx.init(params)`` state on ``mesh`` for ``shard_map``, one window per device.

  Call it once, outside ``jit`` (every process with the same state). A leaf placed with a
  ``NamedSharding`` on the mesh's axes keeps it (say, the inner optimizer's moments and the
  window sums sharded over an ``fsdp`` axis, from :func:`init_sharded`); window leaves get
  ``axis_name`` in front of it; other leaves are replicated.

  Args:
    opt_state: a state containing ``accumulate`` states, without a device axis.
    mesh: the ``shard_map``'s mesh.
    axis_name: the mesh axis (or axes) of the data-parallel replicas.

  Returns:
    Global arrays: window sums ``[n, *shape]`` with spec ``P(axis_name, *spec)``, ``n`` the
    product of the axes' sizes and ``spec`` the leaf's own (``P()`` if it had none), which
    :func:`window_specs` names for ``shard_map``; the rest as they were.

  Raises:
    KeyError: if an axis of ``axis_name`` is not in ``mesh`` (naming its axes).
    ValueError: if a leaf is already sharded over ``axis_name`` (the replicas' axis cannot
      also shard a leaf: shard it over another mesh axis).

  Examples:
    >>> import optax, optax_accum
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, axis_name='data')
    >>> state = optax_accum.sharding.stack_windows(tx.init({'w': jnp.zeros(3)}), mesh, 'data')
    >>> state.window.grad_sum['w'].shape, state.window.weight_sum.shape, state.mini_step.shape
    ((8, 3), (8,), ())
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 4), ('replica', 'fsdp'))
    >>> params = jax.device_put({'w': jnp.zeros((8, 3))}, NamedSharding(mesh, P('fsdp')))
    >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4, axis_name='replica')
    >>> state = optax_accum.sharding.init_sharded(tx, params)
    >>> state = optax_accum.sharding.stack_windows(state, mesh, 'replica')
    >>> [tuple(x.sharding.spec) for x in (state.window.grad_sum['w'], state.inner_state[0].mu['w'])]
    [('replica', 'fsdp'), ('fsdp',)]
  """
  axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  unknown = [a for a in axes if a not in mesh.shape]
  if unknown or not axes:
    raise KeyError(
      f"stack_windows: axis_name={axis_name!r} names no axis of the mesh (unknown: "
      f"{unknown}); the mesh has axes {tuple(mesh.shape)}. Pass the data-parallel mesh "
      "axis, the same as accumulate(..., axis_name=...)."
    )
  n = int(np.prod([mesh.shape[a] for a in axes]))
  for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
    used = [a for a in jax.tree.leaves(tuple(_spec_on(leaf, mesh))) if a in axes]
    if used:
      raise ValueError(
        f"stack_windows: the state leaf {jax.tree_util.keystr(path)} is sharded over "
        f"{used}, the replicas' axis_name={axis_name!r}. Shard params and state over "
        "another mesh axis (say 'fsdp'); axis_name holds one window per replica."
      )

  def place(x, spec):
    own = _spec_on(x, mesh)
    if spec:  # a window leaf
      return _place(x, mesh, PartitionSpec(axis_name, *own), n)
    return _place(x, mesh, own, None)

  return jax.tree.map(place, opt_state, window_specs(opt_state, axis_name))


def local_state(opt_state: PyTree) -> PyTree:
  """Inside ``shard_map``: drops the window sums' device axis (a block of 1) for ``tx.update``.

  Args:
    opt_state: the body's block of a :func:`stack_windows` state (sums ``[1, *shape]``).

  Returns:
    The same tree with the window sums ``[*shape]``.

  Raises:
    ValueError: if the window sums have no device axis.

  Examples:
    >>> import optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, axis_name='data')
    >>> block = optax_accum.sharding.stacked_state(tx.init({'w': jnp.zeros(3)}))
    >>> local = optax_accum.sharding.local_state(block)
    >>> block.window.grad_sum['w'].shape, local.window.grad_sum['w'].shape
    ((1, 3), (3,))
  """

  def drop(s):
    if np.ndim(s.window.weight_sum) != 1:
      raise ValueError(
        "local_state: the window sums have no device axis (window.weight_sum has shape "
        f"{np.shape(s.window.weight_sum)}, expected [1] inside shard_map). local_state takes the "
        "shard_map block of a state laid out by optax_accum.sharding.stack_windows (with "
        "window_specs as in_specs); a state straight from tx.init needs no local_state."
      )
    return map_per_device(lambda x: x[0], s)

  return map_states(drop, opt_state)


def stacked_state(opt_state: PyTree) -> PyTree:
  """Inside ``shard_map``: the inverse of :func:`local_state`, before the body returns.

  Returns ``opt_state`` with the window sums ``[1, *shape]``; other leaves unchanged.

  Examples:
    >>> import optax, optax_accum
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, axis_name='data')
    >>> state = optax_accum.sharding.stack_windows(tx.init({'w': jnp.zeros(3)}), mesh, 'data')
    >>> specs = optax_accum.sharding.window_specs(state, 'data')
    >>> def body(s):
    ...   s = optax_accum.sharding.local_state(s)  # grad_sum['w']: [3] on each device
    ...   return optax_accum.sharding.stacked_state(s)  # [1, 3] again
    >>> out = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=specs)(state)
    >>> out.window.grad_sum['w'].shape, out.window.weight_sum.shape  # one block per device
    ((8, 3), (8,))
  """
  return map_states(lambda s: map_per_device(lambda x: x[None], s), opt_state)
