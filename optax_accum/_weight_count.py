"""Exact weight totals: :class:`WeightCount` and the open window's weight in exact parts.

The open window's weight is kept in 12-bit parts (:func:`add_parts`) that ride in the
boundary's one all-reduce and are added to a count there (:func:`count_parts`). Used by the
token budget (``optax_accum.token_budget``, docs/token_budget.md).
"""

from __future__ import annotations

import fractions
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _numerics

PyTree = Any

_U32_MAX = int(np.iinfo(np.uint32).max)


class WeightCount(NamedTuple):
  """An exact, non-negative weight total: ``high * 2**32 + low + frac``.

  A float32 counter stops counting tokens at 2**24 and an int32 one wraps at 2**31; runs see
  1e12 tokens. Exact for every whole weight in windows of any size (all-reduced exactly for
  up to 4096 devices); saturates at 2**64 - 1. Fractions are carried in float32: within about
  2**-24 per microbatch of the fraction. Outside ``jit`` ``int(count)`` is exact and
  ``float(count)`` exact up to 2**53; under ``jit``, :meth:`approx` rounds to a float array.

  Attributes:
    high, low: uint32, the whole part's multiples of 2**32 and its remainder.
    frac: float32 (float64 under x64), the fractional part, in [0, 1).

  Examples:
    >>> import jax.numpy as jnp
    >>> c = add(zeros(), jnp.float32(2.0**31))
    >>> c = add(add(c, jnp.float32(2.0**31)), jnp.float32(1.0))
    >>> int(c), float(c)  # 2**32 + 1: past float32's and int32's range, exact
    (4294967297, 4294967297.0)
  """

  high: jax.Array
  low: jax.Array
  frac: jax.Array

  def _exact(self) -> fractions.Fraction:
    whole = (int(np.asarray(self.high)) << 32) | int(np.asarray(self.low))
    return whole + fractions.Fraction(float(np.asarray(self.frac)))

  def __float__(self) -> float:
    return float(self._exact())

  def __int__(self) -> int:
    return (int(np.asarray(self.high)) << 32) | int(np.asarray(self.low))

  def item(self) -> int | float:
    """The total as a Python ``int`` when it is whole, else a ``float`` (outside ``jit``)."""
    return int(self) if float(np.asarray(self.frac)) == 0 else float(self)

  def __str__(self) -> str:
    if any(isinstance(x, jax.core.Tracer) for x in self):
      return f"WeightCount(high={self.high}, low={self.low}, frac={self.frac})"
    return str(self.item())

  def approx(self) -> jax.Array:
    """The total as a float array of ``frac``'s dtype, rounded (works under ``jit``)."""
    dt = self.frac.dtype
    return self.high.astype(dt) * jnp.asarray(2.0**32, dt) + self.low.astype(dt) + self.frac


def zeros() -> WeightCount:
  """A zero :class:`WeightCount` (fresh buffers: a donated state must not share them)."""
  zero = lambda: jnp.zeros((), jnp.uint32)
  return WeightCount(zero(), zero(), jnp.zeros((), _numerics.scalar_dtype()))


def add(count: WeightCount, weight: jax.Array) -> WeightCount:
  """``count + weight``, exactly for a whole ``weight``; saturates at 2**64 - 1.

  A negative, NaN or infinite ``weight`` adds nothing (a traced negative microbatch weight).
  """
  dt = count.frac.dtype
  w = _clean(weight, dt)
  whole = jnp.floor(w)
  frac = count.frac + (w - whole)  # w - floor(w) is exact
  carry = frac >= 1
  frac = jnp.where(carry, frac - jnp.ones((), dt), frac)  # exact in [1, 2)
  w_high = jnp.floor(whole * jnp.asarray(2.0**-32, dt))  # power-of-two scaling: exact
  w_low = whole - w_high * jnp.asarray(2.0**32, dt)  # in [0, 2**32): exact
  w_high, w_low = w_high.astype(jnp.uint32), w_low.astype(jnp.uint32)
  low1 = count.low + w_low
  low2 = low1 + carry.astype(jnp.uint32)
  carry_low = (low1 < w_low) | (low2 < low1)
  room = jnp.asarray(_U32_MAX, jnp.uint32) - count.high
  over = (w_high > room) | ((w_high == room) & carry_low)
  high = count.high + w_high + carry_low.astype(jnp.uint32)
  top = jnp.asarray(_U32_MAX, jnp.uint32)
  return WeightCount(
    high=jnp.where(over, top, high),
    low=jnp.where(over, top, low2),
    frac=jnp.where(over, count.frac, frac),
  )


# The open window's exact weight, per device: PARTS 12-bit parts of the whole part (72 bits)
# and the fraction, as floats of the weight-sum dtype. Each part stays below 2**12, so the
# boundary's all-reduce (the same variadic psum as the window's other sums, one dtype) adds
# up to 2**24 / 2**12 = 4096 devices' parts exactly in float32.
PART_BITS, PARTS = 12, 6


def zero_parts() -> jax.Array:
  """An empty window's parts: ``[frac, p0, ..., p5]``, zeros of the weight-sum dtype."""
  return jnp.zeros((PARTS + 1,), _numerics.scalar_dtype())


def _clean(w: jax.Array, dt: Any) -> jax.Array:
  """``w`` in ``dt``: 0 for a negative, NaN or infinite value; below 2**64."""
  w = jnp.asarray(w).astype(dt)
  w = jnp.where(jnp.isfinite(w) & (w > 0), w, jnp.zeros((), dt))
  return jnp.minimum(w, jnp.asarray(np.nextafter(np.asarray(2.0**64, dt), np.asarray(0, dt)), dt))


def add_parts(parts: jax.Array, weight: jax.Array) -> jax.Array:
  """``parts + weight`` exactly (a whole ``weight``; a negative, NaN or Inf adds nothing).

  ``parts = [frac, p0, ..., p5]`` (:func:`zero_parts`): ``frac`` in [0, 1), ``p0..p4`` in
  [0, 2**12), the top part as it grows.
  """
  dt = parts.dtype
  w = _clean(weight, dt)
  whole = jnp.floor(w)
  pieces, rest = [], whole
  for k in reversed(range(PARTS)):  # power-of-two scalings and exact remainders
    scale = jnp.asarray(2.0 ** (PART_BITS * k), dt)
    piece = jnp.floor(rest * jnp.asarray(2.0 ** (-PART_BITS * k), dt))
    rest = rest - piece * scale
    pieces.append(piece)
  new = parts + jnp.stack([w - whole, *reversed(pieces)])
  frac = new[0]
  carry = (frac >= 1).astype(dt)
  out = [frac - carry]
  base = jnp.asarray(2.0**PART_BITS, dt)
  for k in range(PARTS):
    v = new[k + 1] + carry
    if k == PARTS - 1:  # the top part keeps what it holds (2**72 is never reached)
      out.append(v)
      break
    carry = jnp.floor(v / base)
    out.append(v - carry * base)
  return jnp.stack(out)


def count_parts(count: WeightCount, parts: jax.Array) -> WeightCount:
  """``count`` plus the (all-reduced) parts of a window, exactly: each term is a whole float."""
  count = add(count, parts[0])  # the fractions' sum (its whole part too)
  for k in range(PARTS):
    count = add(count, parts[k + 1] * jnp.asarray(2.0 ** (PART_BITS * k), parts.dtype))
  return count
