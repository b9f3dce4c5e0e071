"""Device variance under ``shard_map(check_vma=True)``: what varies, and making types agree.

Per-device window sums sit next to a replicated state, and ``lax.cond`` branches must have
equal types: these helpers make that hold with type changes only (``pcast`` moves no data).
"""

from __future__ import annotations

from typing import Any

import jax

from optax_accum._state import AccumulationState, map_per_device

PyTree = Any


def varying(x: Any) -> frozenset:
  """The mesh axes ``x`` (an array, tracer or abstract value) varies over.

  Empty outside ``shard_map`` and under ``check_vma=False``.

  Examples:
    >>> import jax.numpy as jnp
    >>> varying(jnp.zeros(2))
    frozenset()
  """
  t = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
  mat = getattr(t, "manual_axis_type", None)  # JAX >= 0.9
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(t, "vma", ()))


def pcast_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """``jax.lax.pcast(x, axes, to="varying")``; ``jax.lax.pvary`` on JAX < 0.8 (no ``pcast``)."""
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axes, to="varying")
  # pyrefly: ignore[missing-attribute]  # JAX >= 0.8 (which has pcast) removed pvary: not run there
  return jax.lax.pvary(x, axes)


def _axes(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def vary(x: jax.Array, axes: frozenset | tuple[str, ...]) -> jax.Array:
  """``x`` typed varying over ``axes`` too (a no-op where it already is)."""
  missing = tuple(sorted(set(axes) - varying(x)))
  return pcast_varying(x, missing) if missing else x


def per_device_window(
  state: AccumulationState, axis_name: str | tuple[str, ...] | None
) -> AccumulationState:
  """Inside ``shard_map`` over ``axis_name``: the window's sums typed device-varying.

  Each device adds its own microbatches, so a state made by ``tx.init`` inside ``shard_map``
  has from the start the type ``update`` returns (a valid ``lax.scan`` carry). Outside
  ``shard_map`` over these axes (or ``axis_name=None``) ``state`` is returned as it is.
  """
  if axis_name is None or not bound(axis_name):  # not inside shard_map over these axes
    return state
  return map_per_device(lambda x: vary(x, _axes(axis_name)), state)


def bound(axis_name: str | tuple[str, ...]) -> bool:
  """Whether every axis of ``axis_name`` is bound here (``shard_map``, ``vmap``)."""
  try:
    jax.lax.axis_size(_axes(axis_name))
  except NameError:
    return False
  return True


def agree(branches: tuple, operands: PyTree, inputs: PyTree) -> tuple:
  """``lax.cond`` branches made to agree on device variance, leaf by leaf.

  Each output leaf is ``pcast`` to vary over the union of both branches' axes for it.
  ``inputs``: what else the branches close over that may vary; when nothing varies (outside
  ``shard_map``) the branches are returned as they are, without tracing them again.
  """
  if not any(varying(x) for x in jax.tree.leaves((inputs, operands))):
    return branches
  avals = [jax.make_jaxpr(b)(operands).out_avals for b in branches]
  target = [varying(a) | varying(b) for a, b in zip(*avals, strict=True)]

  def wrap(branch):
    def agreed(ops):
      leaves, treedef = jax.tree.flatten(branch(ops))
      out = [vary(x, want) for x, want in zip(leaves, target, strict=True)]
      return jax.tree.unflatten(treedef, out)

    return agreed

  return tuple(wrap(b) for b in branches)


def check_replicated(params: PyTree, axis_name: str | tuple[str, ...] | None) -> None:
  """Raises if ``params`` vary over ``axis_name`` inside ``shard_map`` (check_vma=True).

  Device-varying params (a ``pcast`` copy) would give varying updates and inner state that
  cannot be returned replicated.
  """
  if axis_name is None or params is None:
    return
  axes = set(_axes(axis_name))
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    bad = axes & varying(leaf)
    if bad:
      raise ValueError(
        f"params{jax.tree_util.keystr(path)} varies over the mesh axis {sorted(bad)} but "
        f"accumulate(..., axis_name={axis_name!r}) keeps one replicated copy of the params: "
        "pass tx.update the params as shard_map received them (in_specs P()), and "
        "differentiate with respect to a device-varying copy only: "
        f"jax.grad(loss)(jax.lax.pcast(params, {axis_name!r}, to='varying'), batch)."
      )


def check_grads(grads: PyTree, params: PyTree, acc: PyTree | None, axis_name: Any) -> None:
  """Raises where the gradients' device variance says the window would be summed wrongly.

  ``acc``: the window's sums, or None where none is kept (``every_k=1``: the window is this
  call's, per device like a kept one).

  Under ``accumulate(axis_name=...)`` the axis must be bound (``shard_map``, ``vmap``), and a
  gradient must vary over it wherever the window sums do: one that does not was summed over
  the devices already (the params were not cast to varying), and weighting that sum by the
  device's own weight is not the batch's gradient. Without ``axis_name``, a gradient that
  varies over an axis its param does not (each device its own microbatch) needs one.
  Nothing is checked under ``check_vma=False`` (no variance is typed).
  """
  if axis_name is not None and not bound(axis_name):
    raise ValueError(
      f"accumulate(..., axis_name={axis_name!r}) sums the window over that mesh axis, but "
      "no such axis is bound where tx.update runs. Run the step inside jax.shard_map over "
      "it (axis_names= for a partial-manual shard_map, as in docs/scaling.md's HSDP "
      "section); under plain jax.jit, where the compiler handles every axis, leave "
      "axis_name out."
    )
  paths = jax.tree_util.tree_flatten_with_path(grads)[0]
  if acc is None:  # a window made in this call is typed like a kept one (per_device_window)
    window = varying(vary(jax.numpy.zeros(()), _axes(axis_name))) if axis_name else frozenset()
    window_axes = [window] * len(paths)
  else:
    window_axes = [varying(a) for a in jax.tree.leaves(acc)]
  like = window_axes if params is None else [varying(p) for p in jax.tree.leaves(params)]
  for (path, g), a, other in zip(paths, window_axes, like, strict=True):
    name = f"grads{jax.tree_util.keystr(path)}"
    if axis_name is not None:
      summed = (set(_axes(axis_name)) & a) - varying(g)
      if summed:
        raise ValueError(
          f"{name} is the same on every device of {sorted(summed)} (not device-varying), but "
          f"accumulate(..., axis_name={axis_name!r}) needs each device's own gradient: JAX "
          "summed it over the devices because the params it was taken with are replicated. "
          f"Differentiate with respect to jax.lax.pcast(params, {axis_name!r}, "
          "to='varying') (docs/scaling.md, trap 1)."
        )
    elif local := varying(g) - other:
      raise ValueError(
        f"{name} varies over the mesh axes {sorted(local)} (each device its own microbatch), "
        f"but accumulate has no axis_name: pass accumulate(..., axis_name={sorted(local)[0]!r})"
        " to sum the window over the devices once, at the boundary (docs/scaling.md)."
      )
