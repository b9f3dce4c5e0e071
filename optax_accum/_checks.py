"""The shared argument checks: one helper per kind of check, each naming the argument.

Feature-specific checks live beside their feature; what several share is here.
Each raises ``TypeError`` or ``ValueError`` at trace time, free in the compiled step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _numerics

# Window positions, counters and streaks are int32 in the state.
INT32_MAX = int(np.iinfo(np.int32).max)


def real_number(value: Any, name: str, meaning: str) -> float:
  """``float(value)`` for a real Python/NumPy number (not a bool); a ``TypeError`` otherwise.

  Examples:
    >>> real_number(np.float32(0.5), "clip_norm", "a global L2 norm")
    0.5
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (int, float, np.integer, np.floating)
  ):
    raise TypeError(f"{name} must be a number ({meaning}), got {value!r}.")
  return float(value)


def positive_int(value: Any, name: str, meaning: str) -> int:
  """``int(value)`` for an integer in [1, 2**31 - 1] (not a bool); a clear error otherwise."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a positive int ({meaning}), got {value!r}.")
  if value < 1:
    raise ValueError(f"{name} must be >= 1 ({meaning}), got {value}.")
  if value > INT32_MAX:
    raise ValueError(
      f"{name} must be <= 2**31 - 1 = {INT32_MAX} ({meaning}; counted in int32), got "
      f"{value}. Use a smaller {name}."
    )
  return int(value)


def takes(fn: Callable[..., Any], n: int) -> bool | None:
  """Whether ``fn`` can be called with ``n`` positional arguments, read from its signature;
  None where Python cannot read one (some builtins).

  Examples:
    >>> takes(lambda window, weight: window, 3), takes(lambda *args: None, 3)
    (False, True)
  """
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return None
  try:
    sig.bind(*range(n))
  except TypeError:
    return False
  return True


def require(owner: str, checks: list[tuple[bool, str]]) -> None:
  """Raises ``ValueError(f"{owner}: {message}.")`` for the first failed ``(ok, message)``."""
  for ok, message in checks:
    if not ok:
      raise ValueError(f"{owner}: {message}.")


def flag(value: Any, name: str) -> jax.Array:
  """``value`` as a boolean scalar array (may be traced)."""
  value = jnp.asarray(value)
  if value.ndim != 0 or value.dtype != jnp.bool_:
    raise TypeError(f"{name} must be a boolean scalar, got {value.dtype}{list(value.shape)}.")
  return value


def scalar(value: Any, name: str, meaning: str) -> jax.Array:
  """``value`` as a 0-d array; a ``ValueError`` naming ``meaning`` for any other shape."""
  value = jnp.asarray(value)
  if value.ndim != 0:
    raise ValueError(f"{name} must be {meaning}, got shape {value.shape}.")
  return value


def axis_names(axis_name: Any) -> tuple[str, ...] | None:
  """``axis_name`` as a tuple of mesh axis names (None stays None); a clear error otherwise."""
  if axis_name is None:
    return None
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  if not (isinstance(names, tuple) and names and all(isinstance(a, str) for a in names)):
    raise TypeError(
      f"axis_name must be None, a mesh axis name (a str) or a non-empty tuple of them, got "
      f"{axis_name!r}. Pass the name used in jax.make_mesh / shard_map, e.g. "
      "axis_name='data' or axis_name=('data', 'fsdp')."
    )
  return names


def weight(weight: Any, name: str = "weight") -> jax.Array:
  """A microbatch weight (examples or unmasked tokens, traced or not) as a 0-d scalar array.

  Raises:
    ValueError: not a scalar; or concrete and negative, not finite, an integer the weight-sum
      dtype does not hold exactly (above 2**24 and odd for float32), or a float that
      overflows it (1e39) or rounds to 0 in it (1e-46). Nothing is wrapped. (JAX converts a
      NumPy int64 at the user's own ``jax.jit`` boundary, before this check.)
    TypeError: complex, boolean, or not an int, float or array (``Fraction``: use ``float``).

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
  """A concrete weight in the weight-sum dtype, never wrapped (integers from their exact value)."""
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
  if not np.isfinite(out) or (value > 0 and out == 0):
    what = "overflows" if out else "rounds to 0 in"
    raise ValueError(
      f"{name}={value} {what} {out_dtype}, the dtype of the weight sum (max "
      f"{float(np.finfo(out_dtype).max):.3g}, smallest positive "
      f"{float(np.finfo(out_dtype).smallest_subnormal):.3g}). Rescale the weights (only their "
      "ratios matter), or enable jax_enable_x64 for float64 sums."
    )
  return out
