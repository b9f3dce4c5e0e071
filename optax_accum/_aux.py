"""What the in-step helper's ``loss_fn`` returns besides the loss: aux and threaded state.

Its output is unpacked into ``(loss, aux, state)`` and the value packed back in
``jax.value_and_grad``'s structure. Aux leaves combine over microbatches by ``aux_mode``:
``'mean'`` by the loss's weights, ``'sum'`` plainly, ``'concat'`` back into the batch's rows,
``'stack'`` per microbatch; a mode that would change a leaf's meaning or shape raises.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_accum import _numerics

PyTree = Any

MODES = ("mean", "sum", "concat", "stack")


def carry_dtype(dtype: Any, override: Any = None) -> jnp.dtype:
  """The dtype a sum of ``dtype`` values is carried in (integers and bools become float)."""
  dt = jnp.dtype(dtype)
  dt = dt if jnp.issubdtype(dt, jnp.inexact) else _numerics.scalar_dtype()
  return _numerics.accumulator_dtype(dt, override)


def sum_dtype(dtype: Any) -> jnp.dtype:
  """The dtype ``aux_mode='sum'`` carries a leaf in: integers (and bools) stay exact as int32."""
  integer = jnp.issubdtype(dtype, jnp.integer) or jnp.dtype(dtype) == jnp.bool_
  return jnp.dtype(jnp.int32) if integer else carry_dtype(dtype)


def check_leaves(aux_mode: str, aux_s: PyTree, rows: int, lead: int) -> None:
  """Raises where ``aux_mode`` would silently change an aux leaf's meaning or shape."""
  for path, s in jax.tree_util.tree_flatten_with_path(aux_s)[0]:
    shape, name = tuple(s.shape[lead:]), jax.tree_util.keystr(path)
    per_example = len(shape) >= 1 and shape[0] == rows
    if aux_mode in ("mean", "sum") and per_example and rows > 1:
      raise ValueError(
        f"aux leaf {name} has shape {shape}: one row per example of the {rows}-row microbatch. "
        f"aux_mode={aux_mode!r} would combine the microbatches row by row and return {rows} "
        "rows instead of the batch's. Pass aux_mode='concat' for per-example values (back to "
        "the batch's rows and order) or aux_mode='stack' ([K, ...] per microbatch)."
      )
    if aux_mode == "concat" and not per_example:
      raise ValueError(
        f"aux_mode='concat' joins per-example aux leaves ({rows} rows per microbatch), but "
        f"aux leaf {name} has shape {shape}. Return per-example values, or use aux_mode="
        "'mean' (mean metrics) or 'sum' (count and sum metrics)."
      )


def take_state(has_state: bool, args: tuple) -> tuple[Any, tuple]:
  """``(state, rest)``: with ``has_state`` the first extra argument is the threaded state."""
  if not has_state:
    return None, args
  if not args:
    raise TypeError("has_state=True: call f(params, batch, state, *args, **kwargs).")
  return args[0], args[1:]


def unpack(has_aux: bool, has_state: bool, out: Any) -> tuple[Any, Any, Any]:
  """``loss_fn``'s output as ``(loss, aux, state)``, None for a part it does not return."""
  if has_state:
    loss, rest = out
    aux, state = rest if has_aux else (None, rest)
    return loss, aux, state
  loss, aux = out if has_aux else (out, None)
  return loss, aux, None


def pack(has_aux: bool, has_state: bool, loss: Any, aux: Any, state: Any) -> Any:
  """The value in ``jax.value_and_grad(loss_fn, has_aux=has_aux or has_state)``'s structure."""
  if has_state:
    return (loss, (aux, state)) if has_aux else (loss, state)
  return (loss, aux) if has_aux else loss
