"""How the in-step batch is cut, where the scan's sums live on a mesh, and the one reduction.

With ``axis_name`` every device keeps its partial sums and reduces them once after the
``lax.scan``: in ``jax.shard_map`` by one ``psum`` (:func:`psum_sums`, device-varying params:
:func:`to_varying`); under ``jax.jit`` by summing one lane per device (:func:`split_lanes`).
docs/in_step.md; ``tests/test_microbatch.py`` fails if a reduction moves into the loop.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import _checks
from optax_accum._vma import pcast_varying, varying

PyTree = Any


def split_batch(batch: PyTree, num_microbatches: int, *, strided: bool = True) -> PyTree:
  """Cuts every leaf of ``batch`` on axis 0 into ``num_microbatches`` stacked slices.

  Strided (default): microbatch ``k`` holds rows ``k, k+K, k+2K, ...``: on a batch sharded
  over ``D`` devices with ``B/D`` divisible by ``K``, each device keeps its own rows. With
  ``strided=False``, rows ``k*B/K ... (k+1)*B/K - 1`` (on a subset of the devices).

  Args:
    batch: a pytree whose leaves all have the same leading size ``B``.
    num_microbatches: ``K``, an int >= 1 dividing ``B``.
    strided: the row assignment above.

  Returns:
    The pytree with leaves ``[K, B // K, ...]``; microbatch ``k`` is ``tree.map(lambda x: x[k])``.

  Raises:
    ValueError: if ``K < 1``, the batch has no leaves or a 0-d leaf, the
      leaves' leading sizes differ, or ``B`` is not divisible by ``K``.

  Examples:
    >>> from optax_accum._microbatch_mesh import split_batch
    >>> split_batch(jnp.arange(6), 2)
    Array([[0, 2, 4],
           [1, 3, 5]], dtype=int32)
    >>> split_batch(jnp.arange(6), 2, strided=False)
    Array([[0, 1, 2],
           [3, 4, 5]], dtype=int32)
  """
  k = _checks.positive_int(num_microbatches, "num_microbatches", "slices of the batch")
  paths_leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not paths_leaves:
    raise ValueError("The batch has no array leaves to split into microbatches.")
  sizes = {}
  for path, leaf in paths_leaves:
    if np.ndim(leaf) == 0:
      raise ValueError(
        f"Batch leaf {jax.tree_util.keystr(path)} is a scalar; every batch leaf needs a "
        "leading batch axis to split. Pass per-call constants as extra arguments instead."
      )
    sizes.setdefault(np.shape(leaf)[0], jax.tree_util.keystr(path))
  if len(sizes) != 1:
    raise ValueError(
      f"Batch leaves have different leading (batch) sizes: {sizes}. Every leaf must have "
      "the same number of rows."
    )
  (n,) = sizes
  if n % k:
    raise ValueError(
      f"The batch has {n} rows, which is not divisible by num_microbatches={k}. Use a "
      f"batch size that is a multiple of {k} (pad it with weight-0 rows, e.g. mask=0)."
    )

  def split(x):
    x = jnp.asarray(x)
    if strided:  # [B/K, K, ...]: each device's rows stay in place.
      return jnp.swapaxes(x.reshape((n // k, k) + x.shape[1:]), 0, 1)
    return jax.lax.reshape(x, (k, n // k) + x.shape[1:], out_sharding=_contiguous_sharding(x))

  return jax.tree.map(split, batch)


def _contiguous_sharding(x: jax.Array) -> Any:
  """The out sharding an Explicit-sharded axis 0 needs to be cut into ``[K, B/K]`` (None if not)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if sharding is None or not spec or spec[0] is None:
    return None
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *spec))


def resolve(axis_name: Any, batch: PyTree) -> tuple[str | None, tuple[str, ...], Any]:
  """Which reduction ``axis_name`` asks for: ``(mode, axes, mesh)``.

  ``mode``: ``None`` (no ``axis_name``), ``'shard_map'`` (every axis manual) or ``'jit'``
  (Auto or Explicit axes of the current mesh or of the batch's Explicit sharding). Raises
  ValueError for an axis not in the mesh, no mesh, or manual and other axes mixed.
  """
  if axis_name is None:
    return None, (), None
  axes = _checks.axis_names(axis_name)
  assert axes is not None  # axis_name is not None
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:  # jit without set_mesh: an Explicit-sharded batch still names its mesh
    for leaf in jax.tree.leaves(batch):
      sharding = getattr(jax.typeof(leaf), "sharding", None)
      if isinstance(sharding, NamedSharding) and AxisType.Explicit in sharding.mesh.axis_types:
        mesh = sharding.mesh
        break
  missing = [a for a in axes if mesh.empty or a not in mesh.shape]
  if missing:
    raise ValueError(
      f"axis_name={axis_name!r}: the mesh {dict(mesh.shape)} has no axis {missing}. Call the "
      "function inside jax.shard_map over that axis, or under jax.jit inside "
      "`with jax.set_mesh(mesh):` with the batch sharded over it."
    )
  manual = [a in mesh.manual_axes for a in axes]
  if all(manual):
    return "shard_map", axes, mesh
  if any(manual):
    raise ValueError(
      f"axis_name={axis_name!r} mixes shard_map (manual) axes and jit axes; pass only the "
      f"manual ones {tuple(a for a, m in zip(axes, manual, strict=True) if m)}."
    )
  return "jit", axes, mesh


def check_without_axis_name(params: PyTree, batch: PyTree) -> None:
  """Without ``axis_name``: refuses a batch that varies over a ``shard_map`` axis its params do
  not (JAX would sum each microbatch's gradient over the devices, unweighted)."""
  rows = frozenset().union(*(varying(x) for x in jax.tree.leaves(batch)))
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    if axes := sorted(rows - varying(p)):
      raise ValueError(
        f"microbatched_value_and_grad without axis_name inside shard_map: the batch varies "
        f"over the mesh axes {axes} (each device its own rows) but params"
        f"{jax.tree_util.keystr(path)} does not, so JAX would sum every microbatch's gradient "
        f"over the devices with equal weights. Pass axis_name={axes[0]!r}: the sums are "
        "weighted by the global weight and reduced once, after the scan."
      )


def num_lanes(mesh: Any, axes: tuple[str, ...]) -> int:
  """``D``: the number of devices along ``axes`` (their product)."""
  return math.prod(mesh.shape[a] for a in axes)


def _explicit(mesh: Any, axes: tuple[str, ...]) -> bool:
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  return all(types[a] == AxisType.Explicit for a in axes)


def spmd_axis_name(mesh: Any, axes: tuple[str, ...]) -> tuple[str, ...] | None:
  """The lane ``vmap``'s ``spmd_axis_name``: ``axes``, or None where they are Explicit.

  On Explicit axes the lanes' sharding is in the arrays' types and ``vmap`` takes
  it from there (JAX >= 0.8 drops an equal ``spmd_axis_name``; JAX 0.7 rejects it).
  """
  return None if _explicit(mesh, axes) else axes


def constrain(x: jax.Array, mesh: Any, axes: tuple[str, ...], dim: int) -> jax.Array:
  """``x`` with dimension ``dim`` sharded over ``axes``: resharded (Explicit) or constrained."""
  if _explicit(mesh, axes):
    current = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
    spec = list(current) + [None] * (x.ndim - len(current))
    used = set(axes)
    spec = [None if _names(s) & used else s for s in spec]  # an axis shards one dimension
    spec[dim] = axes if len(axes) > 1 else axes[0]
    return jax.sharding.reshard(x, NamedSharding(mesh, P(*spec)))
  spec: list[Any] = [P.UNCONSTRAINED] * x.ndim
  spec[dim] = axes if len(axes) > 1 else axes[0]
  return jax.lax.with_sharding_constraint(x, P(*spec))


def _names(entry: Any) -> set[str]:
  if entry is None or entry is P.UNCONSTRAINED:
    return set()
  return {entry} if isinstance(entry, str) else set(entry)


def merge_batch(stacked: PyTree, strided: bool) -> PyTree:
  """The inverse of :func:`split_batch`: ``[K, B/K, ...]`` leaves back to ``[B, ...]``."""

  def merge(x):
    x = jnp.swapaxes(x, 0, 1) if strided else x
    return x.reshape((-1,) + x.shape[2:])

  return jax.tree.map(merge, stacked)


def merge_lanes(stacked: PyTree, strided: bool) -> PyTree:
  """The inverse of :func:`split_lanes`: ``[K, D, B/(K*D), ...]`` leaves back to ``[B, ...]``."""

  def merge(x):
    x = jnp.moveaxis(x, 0, 2) if strided else x  # strided: [D, m, K, ...], each lane's block
    return x.reshape((-1,) + x.shape[3:])

  return jax.tree.map(merge, stacked)


def split_lanes(
  batch: PyTree, k: int, lanes: int, mesh: Any, axes: tuple[str, ...], strided: bool
) -> PyTree:
  """Cuts every leaf ``[B, ...]`` into ``[K, D, B/(K*D), ...]``: microbatch, lane, rows.

  Strided: microbatch ``k`` holds rows ``k, k+K, ...`` (as :func:`split_batch`)
  and lane ``d`` holds those of device ``d``'s block ``d*B/D ... (d+1)*B/D - 1``,
  so with the batch sharded over ``axes`` no row moves. Contiguous: microbatch
  ``k`` holds rows ``k*B/K ...`` cut into ``D`` lanes (rows move between devices).

  Raises:
    ValueError: if ``B`` is not divisible by ``K * D``.
  """
  n = jax.tree.leaves(batch)[0].shape[0]
  if n % (k * lanes):
    raise ValueError(
      f"The batch has {n} rows, which is not divisible by num_microbatches * devices = "
      f"{k} * {lanes} along axis_name {axes}. Use a batch of a multiple of {k * lanes} rows "
      "(pad it with weight-0 rows, e.g. mask=0)."
    )
  m = n // (k * lanes)

  def split(x):
    x = jnp.asarray(x)
    if strided:  # [D, m, K, ...] keeps each device's block on its device
      y = jnp.moveaxis(_reshape(x, (lanes, m, k) + x.shape[1:], mesh, axes, 0), 2, 0)
    else:
      y = _reshape(x, (k, lanes, m) + x.shape[1:], mesh, axes, 1)
    return constrain(y, mesh, axes, 1)

  return jax.tree.map(split, batch)


def _reshape(x: jax.Array, shape: tuple[int, ...], mesh: Any, axes: tuple[str, ...], dim: int):
  if not _explicit(mesh, axes):
    return x.reshape(shape)
  spec: list[Any] = [None] * len(shape)
  spec[dim] = axes if len(axes) > 1 else axes[0]
  return jax.lax.reshape(x, shape, out_sharding=NamedSharding(mesh, P(*spec)))


def carry_zeros(struct: Any, dtype: Any, mesh: Any, axes: tuple[str, ...], lanes: int):
  """Zeros like ``struct`` (from ``jax.eval_shape``) in ``dtype``: lane dimension 0 sharded over
  ``axes``, device-varying where ``struct`` is (``lax.scan`` needs equal carry types)."""
  sharding = getattr(struct, "sharding", None)
  typed = isinstance(sharding, NamedSharding) and AxisType.Explicit in sharding.mesh.axis_types
  if typed and (not lanes or _explicit(mesh, axes)):  # the carry's type holds its sharding
    x = jnp.zeros(struct.shape, dtype, out_sharding=sharding)
  elif lanes:
    x = constrain(jnp.zeros(struct.shape, dtype), mesh, axes, 0)
  else:
    x = jnp.zeros(struct.shape, dtype)
  axes_varying = getattr(getattr(struct, "manual_axis_type", None), "varying", None)
  if axes_varying is None:  # JAX < 0.9: the type's `vma`
    axes_varying = getattr(struct, "vma", None)
  return pcast_varying(x, tuple(sorted(axes_varying))) if axes_varying else x


def like_params(grads: PyTree, params: PyTree) -> PyTree:
  """Each gradient leaf resharded like its param where the param has an Explicit sharding."""

  def place(g, p):
    sharding = getattr(jax.typeof(p), "sharding", None)
    if isinstance(sharding, NamedSharding) and getattr(jax.typeof(g), "sharding", None) != sharding:
      if any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
        return jax.sharding.reshard(g, sharding)
    return g

  return jax.tree.map(place, grads, params)


def gather_over(params: PyTree, mesh: Any, axes: tuple[str, ...]) -> PyTree:
  """Params Explicit-sharded over ``axes`` gathered along them once, before the scan (the lane
  dimension is sharded over ``axes``; Auto axes are left to the compiler)."""
  if not _explicit(mesh, axes):
    return params
  used = set(axes)

  def gather(p):
    sharding = getattr(jax.typeof(p), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if sharding is None or not spec or not any(_names(s) & used for s in spec):
      return p
    kept = [None if _names(s) & used else s for s in spec]
    return jax.sharding.reshard(p, NamedSharding(sharding.mesh, P(*kept)))

  return jax.tree.map(gather, params)


def to_varying(params: PyTree, axes: tuple[str, ...]) -> PyTree:
  """Params cast to device-varying over ``axes``, so ``jax.grad`` does not ``psum`` each
  microbatch's gradient under ``check_vma=True`` (leaves that already vary stay)."""

  def cast(x):
    try:
      return pcast_varying(x, axes)
    except ValueError:  # already varying over these axes
      return x

  return jax.tree.map(cast, params)


def psum_sums(sums: PyTree, axes: tuple[str, ...]) -> PyTree:
  """One ``psum`` of all the scan's sums (a single variadic all-reduce)."""
  return jax.lax.psum(sums, axes if len(axes) > 1 else axes[0])


def lane_indices(lanes: int, mesh: Any, axes: tuple[str, ...]) -> jax.Array:
  """``[0, ..., D-1]`` sharded over ``axes`` (folded into ``key``: each lane its own masks)."""
  return constrain(jnp.arange(lanes, dtype=np.int32), mesh, axes, 0)


def lane_mean(aux: PyTree, w: jax.Array) -> PyTree:
  """Per-microbatch weighted mean over the lanes of ``[K, D, ...]`` leaves, weights ``[K, D]``
  (a weight-0 lane adds nothing, even a NaN; integer leaves come back as float32)."""
  wsum = w.sum(1)

  def mean(x):
    dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.float32
    x = x.astype(jnp.promote_types(dtype, jnp.float32))
    ww = w.astype(x.dtype).reshape(w.shape + (1,) * (x.ndim - 2))
    total = jnp.where(ww != 0, ww * x, jnp.zeros((), x.dtype)).sum(1)
    ws = wsum.astype(x.dtype).reshape(wsum.shape + (1,) * (x.ndim - 2))
    return total / jnp.where(ws != 0, ws, jnp.ones_like(ws))

  return jax.tree.map(mean, aux)
