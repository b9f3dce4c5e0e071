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
from optax_accum._vma import varying

PyTree = Any


def options(
  inner: Any,
  every_k_arg: Any,
  clip_norm: Any,
  skip_nonfinite: Any,
  loss_scale: Any,
  accumulator_dtype: Any = None,
  axis_name: Any = None,
) -> Callable[[jax.Array], jax.Array] | int | None:
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
  if accumulator_dtype is not None:
    dtype = jnp.dtype(accumulator_dtype)
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
      raise TypeError(
        f"accumulator_dtype={dtype} needs 64-bit JAX: without jax_enable_x64 every array "
        f"is at most 32-bit, so a {dtype} accumulator would silently be "
        f"{jax.dtypes.canonicalize_dtype(dtype)}. Call "
        "jax.config.update('jax_enable_x64', True) before creating the optimizer, or leave "
        "accumulator_dtype=None (float32 for bf16/fp16/float32 gradients)."
      )
  axis_names(axis_name)
  return every_k(every_k_arg)


def axis_names(axis_name: Any) -> None:
  """Raises unless ``axis_name`` is None, a string or a non-empty tuple of strings."""
  ok = axis_name is None or isinstance(axis_name, str)
  if isinstance(axis_name, tuple):
    ok = bool(axis_name) and all(isinstance(a, str) for a in axis_name)
  if not ok:
    raise TypeError(
      f"axis_name must be None, a mesh axis name (a str) or a non-empty tuple of them, got "
      f"{axis_name!r}. Pass the name used in jax.make_mesh / shard_map, e.g. "
      "axis_name='data' or axis_name=('data', 'fsdp')."
    )


def noise_scale_decay(decay: Any) -> float | None:
  """The validated EMA decay of the gradient noise scale: None (off) or a float in [0, 1)."""
  if decay is None:
    return None
  if isinstance(decay, (bool, str)) or not isinstance(decay, (int, float, np.number)):
    raise TypeError(
      f"noise_scale_decay must be None (no noise scale) or a float in [0, 1) (the EMA decay "
      f"per window, e.g. 0.9), got {decay!r}."
    )
  if not 0 <= float(decay) < 1:
    raise ValueError(
      f"noise_scale_decay must be in [0, 1) (the EMA decay per window; 0 keeps only the last "
      f"window, 0.9 averages about 10 windows), got {decay}. Pass None to turn it off."
    )
  return float(decay)


# Window positions, counters and streaks are int32 in the state.
INT32_MAX = int(np.iinfo(np.int32).max)


def positive_int(value: Any, name: str, meaning: str) -> int:
  """``int(value)`` for an integer in [1, 2**31 - 1] (not a bool); a clear error otherwise."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a positive int ({meaning}), got {value!r}.")
  if value < 1:
    raise ValueError(f"{name} must be >= 1 ({meaning}), got {value}.")
  if value > INT32_MAX:
    raise ValueError(
      f"{name} must be <= 2**31 - 1 = {INT32_MAX} ({meaning}; counted in int32), got "
      f"{value}. Use a smaller {name}."
    )
  return int(value)


def every_k(k: Any) -> Callable[[jax.Array], jax.Array] | int | None:
  """The validated window length: a callable schedule, an int >= 1, or None (no count limit)."""
  if k is None or callable(k):
    return k
  return positive_int(k, "every_k", "microbatches per window, or a callable of num_updates")


def window_length(k: Any) -> jax.Array:
  """An ``every_k`` schedule's value as int32, never wrapped.

  A concrete value above 2**31 - 1 raises; a traced one of a wider integer
  dtype saturates at 2**31 - 1 (a window that does not close by count).
  """
  if not isinstance(k, jax.core.Tracer):
    arr = np.asarray(k)
    if arr.ndim == 0 and np.issubdtype(arr.dtype, np.integer) and int(arr) > INT32_MAX:
      raise ValueError(
        f"every_k schedule returned {int(arr)}, above the int32 limit 2**31 - 1 = "
        f"{INT32_MAX} of the window position. Return a smaller window length."
      )
  k = jnp.asarray(k)
  if k.ndim != 0 or not jnp.issubdtype(k.dtype, jnp.integer):
    raise TypeError(
      f"every_k schedule must return an integer scalar, got {k.dtype}{list(k.shape)}."
    )
  if jnp.iinfo(k.dtype).max > INT32_MAX:
    k = jnp.minimum(k, jnp.asarray(INT32_MAX, k.dtype))
  return k.astype(jnp.int32)


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


def replicated_params(params: PyTree, axis_name: Any) -> None:
  """Raises if ``params`` vary over ``axis_name`` inside ``shard_map`` (check_vma=True).

  Under ``axis_name`` every device applies the same window mean to the same
  params; device-varying params (a ``pcast`` copy) would give device-varying
  updates and inner state that cannot be returned replicated.
  """
  if axis_name is None or params is None:
    return
  axes = {axis_name} if isinstance(axis_name, str) else set(axis_name)
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


def fingerprint(
  state: AccumulationState, every_k_fp: int, scale_kind: int, static_scale: float | None
) -> None:
  """Raises if a concrete state was made by another configuration.

  Compares the ``every_k`` and ``loss_scale_kind`` fingerprints, and for a
  static loss scale (or none) the state's ``loss_scale`` with the configured
  value: a restored state with another loss scale would divide every window
  mean by the wrong factor. Traced states are not checked (free under jit).
  """
  names = ("none", "static_loss_scale", "dynamic_loss_scale")
  fields = (state.every_k, state.loss_scale_kind, state.loss_scale)
  if any(isinstance(x, jax.core.Tracer) for x in fields):
    return
  fp, kind, scale = int(np.asarray(fields[0])), int(np.asarray(fields[1])), fields[2]
  if fp != every_k_fp:
    raise ValueError(
      f"This optimizer state was created with every_k={fp} (-1 means a schedule, 0 none: "
      f"windows closed by window_weight alone) but the "
      f"transformation has every_k={every_k_fp}. Windows would be mixed: restore into an "
      "accumulate() with the same configuration, or start a fresh state with tx.init."
    )
  if kind != scale_kind:
    got = names[kind] if 0 <= kind < len(names) else f"unknown ({kind})"
    raise ValueError(
      f"This optimizer state was created with loss_scale={got} but the transformation has "
      f"loss_scale={names[scale_kind]}: every window mean would be divided by the wrong "
      "scale. Restore into an accumulate() with the same loss_scale, or finish the window "
      "with the old configuration (optax_accum.flush) and start a fresh state with tx.init."
    )
  if static_scale is not None and float(np.asarray(scale)) != np.float32(static_scale):
    raise ValueError(
      f"This optimizer state has loss scale {float(np.asarray(scale))} but the "
      f"transformation's static loss scale is {static_scale}: the open window's gradients "
      "were scaled by the old value. Restore into an accumulate() with the same "
      "static_loss_scale, or flush the window with the old configuration and start a fresh "
      "state with tx.init."
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
    ValueError: if the weight is not a scalar, or is concrete and negative,
      not finite, an integer not exactly representable in the weight-sum
      dtype (above 2**24 and odd, say, for float32), or a float that
      overflows it (1e39 for float32). Nothing is ever wrapped.
    TypeError: if the weight is complex, boolean or not an int, float or array
      (a ``Fraction`` or ``Decimal``: convert it with ``float``).

  Examples:
    >>> import numpy as np
    >>> weight(np.int64(3_000_000_000))  # exact in float32, not wrapped through int32
    Array(3.e+09, dtype=float32)
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
  if not isinstance(weight, (int, float, complex, np.number, np.ndarray, jax.Array)):
    raise TypeError(
      f"{name} must be an int, a float or an array, got {type(weight).__name__} "
      f"{weight!r}. Convert it first, e.g. {name}=float(w) (weights are summed in "
      f"{_numerics.scalar_dtype()})."
    )
  dtype = jnp.result_type(weight)
  if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
    raise TypeError(f"{name} must be a real number, got dtype {dtype}.")
  if isinstance(weight, jax.core.Tracer):
    return jnp.asarray(weight).astype(_numerics.scalar_dtype())
  return jnp.asarray(_concrete_weight(np.asarray(weight), name))


def _concrete_weight(arr: np.ndarray, name: str) -> np.ndarray:
  """A concrete weight as a 0-d array of the weight-sum dtype: never wrapped or overflowed.

  Integers (of any width, signed or not) are converted from their exact value,
  not through JAX's 32-bit integers, and must be exactly representable in the
  weight-sum dtype; floats must stay finite in it.
  """
  out_dtype = _numerics.scalar_dtype()
  if np.issubdtype(arr.dtype, np.integer):
    exact = int(arr)
    if exact < 0:
      raise ValueError(
        f"{name} must be finite and non-negative, got {exact}. A microbatch with no "
        f"real examples has {name}=0; a negative {name} has no meaning."
      )
    out = np.asarray(float(exact) if exact < 2**1000 else np.inf, out_dtype)
    if not np.isfinite(out) or int(out) != exact:
      raise ValueError(
        f"{name}={exact} is not exactly representable in {out_dtype}, the dtype of the "
        f"weight sum (integers up to 2**{np.finfo(out_dtype).nmant + 1} always are). Pass "
        f"{name}=float(w) to accept the rounding, or enable jax_enable_x64 for float64 sums."
      )
    return out
  value = float(arr)
  if not np.isfinite(value) or value < 0:
    raise ValueError(
      f"{name} must be finite and non-negative, got {value}. A microbatch with no "
      f"real examples has {name}=0; a negative {name} has no meaning."
    )
  with np.errstate(over="ignore"):
    out = np.asarray(value, out_dtype)
  if not np.isfinite(out):
    raise ValueError(
      f"{name}={value} overflows {out_dtype}, the dtype of the weight sum (max "
      f"{float(np.finfo(out_dtype).max):.3g}). Rescale the weights (only their ratios "
      "matter), or enable jax_enable_x64 for float64 sums."
    )
  return out


# ------------------------------------------------------------- token-budget windows (issue 15)

_WEIGHT_OF = ("num_updates", "weight_seen")


def window_weight(
  every_k: Any, budget: Any, budget_of: Any
) -> tuple[float | Callable[[jax.Array], Any], str | None] | None:
  """Validates ``accumulate``'s ``window_weight`` and ``window_weight_of``.

  Returns:
    ``(budget, of)``: a float budget with ``of=None``, or a callable ramp with
    ``of`` in ``('num_updates', 'weight_seen')``; None without a budget.

  Raises:
    TypeError, ValueError: naming the argument, the limit and what to do.
  """
  if budget is None:
    if every_k is None:
      raise ValueError(
        "accumulate needs every_k (microbatches per window) or window_weight (the weight, "
        "e.g. tokens, per window), got neither. Pass e.g. every_k=4, or "
        "window_weight=2**20 to close each window at the first microbatch reaching 2**20 "
        "tokens."
      )
    if budget_of is not None:
      raise ValueError(
        f"window_weight_of={budget_of!r} is only meaningful with a callable window_weight "
        "(a ramp); got window_weight=None. Drop window_weight_of, or pass the ramp."
      )
    return None
  if callable(budget):
    if budget_of not in _WEIGHT_OF:
      raise ValueError(
        f"window_weight is a callable (a ramp), so window_weight_of must say what it is "
        f"called with: 'num_updates' (applied windows, int32) or 'weight_seen' (the weight "
        f"of the windows closed so far, a float); got {budget_of!r}."
      )
    return budget, budget_of
  if budget_of is not None:
    raise ValueError(
      f"window_weight_of={budget_of!r} is only meaningful with a callable window_weight (a "
      f"ramp); got the number {budget!r}. Drop window_weight_of, or pass a callable."
    )
  return _budget_number(budget), None


def _budget_number(budget: Any) -> float:
  """A fixed ``window_weight``: finite, > 0 and exactly representable in the weight-sum dtype."""
  if isinstance(budget, (bool, np.bool_)) or not isinstance(
    budget, (int, float, np.integer, np.floating)
  ):
    raise TypeError(
      f"window_weight must be a number (the weight, e.g. tokens, per window) or a callable "
      f"ramp, got {budget!r}."
    )
  dtype = _numerics.scalar_dtype()
  value = float(budget)
  if not (np.isfinite(value) and value > 0):
    raise ValueError(
      f"window_weight must be finite and > 0 (the weight, e.g. tokens, at which a window "
      f"closes), got {budget}. Use every_k for windows of a fixed number of microbatches."
    )
  with np.errstate(over="ignore"):
    rounded = np.asarray(value, dtype)
  exact = bool(np.isfinite(rounded)) and (
    not isinstance(budget, (int, np.integer)) or int(rounded) == int(budget)
  )
  if not exact:
    limit = 2 ** (np.finfo(dtype).nmant + 1)
    raise ValueError(
      f"window_weight={budget} is not exactly representable in {dtype}, the dtype of the "
      f"window's weight sum (integers up to {limit} always are), so windows would close at "
      f"{float(rounded):.17g}. Pass a representable budget (e.g. a multiple of a power of "
      "two), or enable jax_enable_x64 for float64 sums."
    )
  return float(rounded)


def window_weight_value(value: Any) -> jax.Array:
  """A ramp's returned budget as a real scalar of the weight-sum dtype (may be traced)."""
  arr = jnp.asarray(value)
  if arr.ndim != 0 or not (
    jnp.issubdtype(arr.dtype, jnp.integer) or jnp.issubdtype(arr.dtype, jnp.floating)
  ):
    raise TypeError(
      f"the window_weight ramp must return a real scalar (the weight per window), got "
      f"{arr.dtype}{list(arr.shape)}."
    )
  return arr.astype(_numerics.scalar_dtype())


def schedule_like(value: Any, name: str, meaning: str) -> None:
  """Raises unless ``value`` is a callable or a real number (not a bool)."""
  if callable(value):
    return
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (int, float, np.integer, np.floating)
  ):
    raise TypeError(
      f"{name} must be a number or a callable of the step count ({meaning}), got {value!r}."
    )


def positive_number(value: Any, name: str) -> float:
  """``float(value)`` for a finite number > 0; a clear error otherwise."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (int, float, np.integer, np.floating)
  ):
    raise TypeError(f"{name} must be a number, got {value!r}.")
  if not (np.isfinite(float(value)) and float(value) > 0):
    raise ValueError(f"{name} must be finite and > 0, got {value}.")
  return float(value)
