"""Every argument and trace-time input check, with a message that says what to do.

The checks of :func:`optax_accum.accumulate`'s configuration and of each
``update`` call's inputs, microbatch weights (shared with the in-step path),
and the number checks of the loss-scale classes. Each raises ``TypeError`` or
``ValueError`` naming the argument; none costs anything in the compiled step.
See docs/design.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _numerics
from optax_accum._state import AccumulationState

PyTree = Any


def options(
  inner: Any, every_k_arg: Any, clip_norm: Any, skip_nonfinite: Any, loss_scale: Any
) -> Callable[[jax.Array], jax.Array] | int:
  """Validates ``accumulate``'s configuration; returns the validated ``every_k``."""
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(
      f"inner must be an optax.GradientTransformation, got {inner!r}. Call the factory: "
      "accumulate(optax.adam(1e-3), every_k=4), not accumulate(optax.adam, ...)."
    )
  if clip_norm is not None:
    if isinstance(clip_norm, (bool, str)) or not isinstance(clip_norm, (int, float, np.number)):
      raise TypeError(f"clip_norm must be a number (a global L2 norm) or None, got {clip_norm!r}.")
    if not 0 < float(clip_norm) < float("inf"):
      raise ValueError(f"clip_norm must be finite and > 0 (a global L2 norm), got {clip_norm}.")
  if not isinstance(skip_nonfinite, (bool, np.bool_)):
    raise TypeError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}.")
  if loss_scale is not None and not (
    callable(getattr(loss_scale, "initial_scale", None))
    and callable(getattr(loss_scale, "adjust", None))
  ):
    raise TypeError(
      "loss_scale must be None, optax_accum.static_loss_scale(...) or "
      f"optax_accum.dynamic_loss_scale(...), got {loss_scale!r}."
    )
  return every_k(every_k_arg)


def positive_int(value: Any, name: str, meaning: str) -> int:
  """``int(value)`` for an integer >= 1 (not a bool); a clear TypeError or ValueError otherwise."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a positive int ({meaning}), got {value!r}.")
  if value < 1:
    raise ValueError(f"{name} must be >= 1 ({meaning}), got {value}.")
  return int(value)


def every_k(k: Any) -> Callable[[jax.Array], jax.Array] | int:
  """The validated window length: a callable schedule, or an int >= 1."""
  if callable(k):
    return k
  return positive_int(k, "every_k", "microbatches per window, or a callable of num_updates")


def trees(grads: PyTree, acc: PyTree, params: PyTree, override: Any) -> None:
  """Trace-time checks that grads match the accumulator (and params)."""
  g_struct = jax.tree.structure(grads)
  if g_struct != jax.tree.structure(acc):
    raise ValueError(
      "The gradient tree does not match the tree the optimizer state was initialized "
      f"with.\n  grads: {g_struct}\n  state: {jax.tree.structure(acc)}\nCall tx.init on "
      "params with the same structure as the gradients (e.g. the same nnx.Param filter)."
    )
  if params is not None and jax.tree.structure(params) != g_struct:
    raise ValueError(
      f"grads and params have different tree structures:\n  grads: {g_struct}\n  params: "
      f"{jax.tree.structure(params)}\nPass the params the gradients were taken with."
    )
  trees = [acc] if params is None else [acc, params]
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
  leaves = [jax.tree.leaves(t) for t in (grads, *trees)]
  for name, g, *others in zip(names, *leaves, strict=True):
    for other in others:
      if np.shape(g) != np.shape(other):
        raise ValueError(
          f"Gradient leaf {name} has shape {np.shape(g)} but the params/state have "
          f"{np.shape(other)}. Pass gradients of the same params the state was made for."
        )
    a = others[0]
    if _numerics.promote_types(a.dtype, _numerics.accumulator_dtype(g.dtype, override)) != a.dtype:
      raise TypeError(
        f"Gradient leaf {name} is {g.dtype} but the accumulator is {a.dtype}, which "
        "cannot hold it. Re-initialize the state from params of the gradients' dtype, or "
        "set accumulator_dtype."
      )


def fingerprint(fp: Any, every_k_fp: int) -> None:
  """Raises if a concrete state fingerprint ``fp`` differs from the configuration's."""
  if isinstance(fp, jax.core.Tracer):
    return
  fp = int(np.asarray(fp))
  if fp != every_k_fp:
    raise ValueError(
      f"This optimizer state was created with every_k={fp} (-1 means a schedule) but the "
      f"transformation has every_k={every_k_fp}. Windows would be mixed: restore into an "
      "accumulate() with the same configuration, or start a fresh state with tx.init."
    )


def state(x: Any) -> None:
  """Raises unless ``x`` is an :class:`AccumulationState` (``accumulate``'s own state)."""
  if not isinstance(x, AccumulationState):
    raise TypeError(
      f"accumulate's update needs its AccumulationState, got {type(x).__name__}. "
      "Pass the state returned by tx.init / tx.update."
    )


def flush_flag(flush: Any) -> jax.Array:
  """``flush`` as a boolean scalar array (may be traced)."""
  flush = jnp.asarray(flush)
  if flush.ndim != 0 or flush.dtype != jnp.bool_:
    raise TypeError(f"flush must be a boolean scalar, got {flush.dtype}{list(flush.shape)}.")
  return flush


def value(v: Any) -> jax.Array:
  """The ``value`` extra arg (a microbatch's scalar loss) as an array."""
  v = jnp.asarray(v)
  if v.ndim != 0:
    raise ValueError(f"value must be the scalar loss of the microbatch, got shape {v.shape}.")
  return v


def number(owner: str, name: str, x: object) -> float:
  """``float(x)`` for a real Python/NumPy number; a clear TypeError otherwise."""
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
    raise TypeError(f"{owner}: {name} must be a number, got {x!r}.")
  return float(x)


def require(owner: str, checks: list[tuple[bool, str]]) -> None:
  """Raises ``ValueError(f"{owner}: {message}.")`` for the first failed ``(ok, message)``."""
  for ok, message in checks:
    if not ok:
      raise ValueError(f"{owner}: {message}.")


def weight(weight: Any, name: str = "weight") -> jax.Array:
  """Validates a microbatch weight and returns it as a scalar array.

  Args:
    weight: a non-negative scalar (Python number, NumPy or JAX array, traced or
      not): the number of examples or unmasked tokens the microbatch's mean
      loss averages over.
    name: the argument's name for error messages.

  Returns:
    A 0-d array of ``_numerics.scalar_dtype()``.

  Raises:
    ValueError: if the weight is not a scalar, or is concrete and negative or
      not finite.
    TypeError: if the weight is complex or not numeric.
  """
  if weight is None or isinstance(weight, (str, bytes)):
    raise TypeError(
      f"{name} must be a number (examples or unmasked tokens), got {weight!r}. "
      f"Pass e.g. {name}=mask.sum() or {name}=x.shape[0]."
    )
  if isinstance(weight, bool) or (
    hasattr(weight, "dtype") and jnp.dtype(weight.dtype) == jnp.bool_
  ):
    raise TypeError(
      f"{name} must be a number (examples or unmasked tokens), got a boolean. "
      f"Pass e.g. {name}=mask.sum()."
    )
  if np.ndim(weight) != 0:
    raise ValueError(
      f"{name} must be a scalar (the number of examples or unmasked tokens in this "
      f"microbatch), got shape {np.shape(weight)}. Sum it first, e.g. {name}=mask.sum()."
    )
  dtype = jnp.result_type(weight)
  if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
    raise TypeError(f"{name} must be a real number, got dtype {dtype}.")
  if not isinstance(weight, jax.core.Tracer):
    value = float(np.asarray(weight))
    if not np.isfinite(value) or value < 0:
      raise ValueError(
        f"{name} must be finite and non-negative, got {value}. A microbatch with no "
        f"real examples has {name}=0; a negative {name} has no meaning."
      )
  return jnp.asarray(weight).astype(_numerics.scalar_dtype())
