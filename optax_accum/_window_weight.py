"""Token-budget windows: the budget, the boundary decision and the exact weight counters.

A window of :func:`optax_accum.accumulate` may close on its weight: at the
first microbatch whose cumulative weight (tokens, examples) reaches
``window_weight``, a number or a ramp (a callable of ``num_updates`` or of the
weight seen so far). :func:`budget` evaluates it, :func:`reached` decides the
boundary (under ``axis_name`` with one scalar all-reduce per microstep), and
:class:`WeightCount` carries ``weight_seen`` (every closed window's weight since
``init``) and ``window_weight`` (the last closed window's) exactly, without
``jax_enable_x64`` (the open window's weight in exact parts, :func:`add_parts`).
:func:`sqrt_scaled_schedule` scales a learning-rate schedule
with the square root of a ramp. See docs/window_weight.md and docs/design.md.
"""

from __future__ import annotations

import fractions
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _checks, _numerics

PyTree = Any

_U32_MAX = int(np.iinfo(np.uint32).max)


class WeightCount(NamedTuple):
  """An exact, non-negative weight total: ``high * 2**32 + low + frac``.

  A float32 counter stops counting single tokens at 2**24 (16.8M) and an int32
  one wraps at 2**31; a training run consumes 1e12 tokens and more. The whole
  part is carried in two uint32 words (exact up to 2**64 - 1, where it
  saturates), the fractional part in a float in [0, 1). It is a pytree (a
  NamedTuple of three 0-d arrays): it works under ``jit``, in ``tree.map``
  and in checkpoints. Outside ``jit``, ``float(count)`` and ``int(count)`` read
  it in Python's exact integers first: ``float`` is exact for integer totals up
  to 2**53 (9.0e15) and within one float64 rounding beyond; ``int`` is the
  whole part, exact up to 2**64 - 1. Under ``jit``, :meth:`approx` gives a
  rounded float array.

  What is exact: every whole weight (any integer a float32 holds), in windows
  of any size: the open window is counted in 12-bit parts
  (:func:`add_parts`, the state's ``window_weight_parts``), all-reduced exactly
  under ``axis_name`` for up to 4096 devices, and added here at its boundary.
  Fractional parts are added in float32 (float64 under x64) and carried into
  the whole part, so a fractional total is within float32 rounding of its
  fraction (about 2**-24 per microbatch), never of its magnitude.

  Attributes:
    high: uint32, the whole part's multiples of 2**32.
    low: uint32, the whole part modulo 2**32.
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

  Args:
    count: the running total.
    weight: a float scalar (cast to ``count.frac``'s dtype). A negative, NaN or
      infinite one adds nothing (only a traced negative microbatch weight can
      make a window's sum negative).

  Returns:
    The new :class:`WeightCount`.
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


def of(weight: jax.Array) -> WeightCount:
  """``weight`` as a :class:`WeightCount` (``add(zeros(), weight)``)."""
  return add(zeros(), weight)


# The open window's exact weight, per device: PARTS 12-bit parts of the whole part (72 bits)
# and the fraction, as floats of the weight-sum dtype. Each part stays below 2**12, so the
# boundary's all-reduce (the same variadic psum as the window's other sums, one dtype) adds
# up to 2**24 / 2**12 = 4096 devices' parts exactly in float32.
PART_BITS, PARTS = 12, 6
MAX_EXACT_DEVICES = 2 ** (24 - PART_BITS)


def zero_parts() -> jax.Array:
  """An empty window's parts: ``[frac, p0, ..., p5]``, zeros of the weight-sum dtype."""
  return jnp.zeros((PARTS + 1,), _numerics.scalar_dtype())


def _clean(w: jax.Array, dt: Any) -> jax.Array:
  """``w`` in ``dt``: 0 for a negative, NaN or infinite value; below 2**64."""
  w = jnp.asarray(w).astype(dt)
  w = jnp.where(jnp.isfinite(w) & (w > 0), w, jnp.zeros((), dt))
  return jnp.minimum(w, jnp.asarray(np.nextafter(np.asarray(2.0**64, dt), np.asarray(0, dt)), dt))


def add_parts(parts: jax.Array, weight: jax.Array) -> jax.Array:
  """``parts + weight`` exactly (a whole ``weight``), each part carried back below 2**12.

  Args:
    parts: ``[frac, p0, ..., p5]`` (:func:`zero_parts`), this device's open window.
    weight: this device's microbatch weight (a negative, NaN or infinite one adds nothing).

  Returns:
    The new parts: ``frac`` in [0, 1), ``p0..p4`` in [0, 2**12), the top part as it grows.
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


class Budget(NamedTuple):
  """A validated ``window_weight`` configuration (it lives in ``accumulate``'s closure).

  Attributes:
    value: the budget, a float (a fixed budget) or a callable (a ramp).
    of: for a ramp, ``'num_updates'`` or ``'weight_seen'``: what it is called with.
  """

  value: float | Callable[[jax.Array], Any]
  of: str | None


def budget(config: Budget, num_updates: jax.Array, weight_seen: WeightCount) -> jax.Array:
  """The open window's budget, a scalar of ``_numerics.scalar_dtype()``.

  A ramp of ``'num_updates'`` is called with the int32 applied-window count; a
  ramp of ``'weight_seen'`` with the weight of every window closed so far, as a
  float array (:meth:`WeightCount.approx`: rounded above 2**24 in float32, a
  relative 6e-8, which a schedule does not notice). Both stay fixed while the
  window is open.
  """
  if not callable(config.value):
    return jnp.asarray(config.value, _numerics.scalar_dtype())
  arg = num_updates if config.of == "num_updates" else weight_seen.approx()
  return _checks.window_weight_value(config.value(arg))


def reached(
  config: Budget | None,
  window_sum: jax.Array,
  num_updates: jax.Array,
  weight_seen: WeightCount,
  axis_name: str | tuple[str, ...] | None,
) -> jax.Array | bool:
  """Whether the open window, with this call's microbatch added, reaches its budget.

  ``~(window_sum < budget)``: the first microbatch whose cumulative weight
  reaches the budget closes the window, keeping its overshoot; a budget of 0,
  a negative one or NaN closes every window at its first microbatch.

  Args:
    config: the budget, or None (never: ``False``, nothing computed).
    window_sum: the window's weight sum including this microbatch (this
      device's under ``axis_name``).
    num_updates: the state's applied-window count.
    weight_seen: the state's weight of the closed windows.
    axis_name: ``accumulate``'s ``axis_name``: the window's weight is global,
      so it is summed over the devices here, the one scalar all-reduce per
      microstep that a budget costs (every device then decides alike).

  Returns:
    A boolean scalar, or ``False`` without a budget.
  """
  if config is None:
    return False
  if axis_name is not None:
    window_sum = jax.lax.psum(window_sum, axis_name)
  return ~(window_sum < budget(config, num_updates, weight_seen).astype(window_sum.dtype))


def sqrt_scaled_schedule(
  schedule: float | Callable[[jax.Array], Any],
  window_weight: float | Callable[[jax.Array], Any],
  reference_weight: float,
) -> Callable[[jax.Array], jax.Array]:
  """A learning rate scaled with the square root of the window's weight (Adam's rule).

  ``lr(count) = schedule(count) * sqrt(window_weight(count) / reference_weight)``:
  when a ramp doubles the tokens per update, Adam's learning rate grows by
  ``sqrt(2)``, as OLMo's batch-size scheduler does. Inside
  :func:`optax_accum.accumulate` the inner optimizer's ``count`` is
  ``num_updates`` (applied windows), so pass the same ramp that was given to
  ``accumulate(..., window_weight=ramp, window_weight_of='num_updates')``. For a
  ramp of ``'weight_seen'``, express it as a function of ``num_updates`` here
  (the tokens per update are the budget it returns), or set the learning rate
  with ``optax.inject_hyperparams`` from ``metrics(state).window_weight``.

  Args:
    schedule: the base learning rate, a number or any optax schedule (a
      callable of the step count): the rate at ``reference_weight`` tokens per
      update.
    window_weight: the window's budget, a number or a callable of the step
      count returning a positive number.
    reference_weight: the window weight at which ``schedule`` applies unscaled;
      a finite number > 0.

  Returns:
    A schedule (a callable of the step count) for any optax optimizer.

  Raises:
    TypeError, ValueError: for a ``reference_weight`` that is not a finite
      number > 0, or a ``schedule`` or ``window_weight`` that is neither a
      number nor a callable.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> ramp = lambda n: jnp.where(n < 100, 1024, 4096)  # 4x the tokens after 100 updates
    >>> lr = optax_accum.sqrt_scaled_schedule(optax.constant_schedule(1e-3), ramp, 1024)
    >>> float(lr(0)), round(float(lr(100)), 6)  # sqrt(4) = 2
    (0.001, 0.002)
    >>> tx = optax_accum.accumulate(
    ...   optax.adam(lr), window_weight=ramp, window_weight_of='num_updates')

  References:
    allenai/OLMo-core, ``src/olmo_core/train/callbacks/batch_size_scheduler.py``
    (``BatchSizeSchedulerCallback``: Adam's base learning rate times
    ``sqrt(new batch size / old batch size)``); Malladi et al., `On the SDEs and
    Scaling Rules for Adaptive Gradient Algorithms <https://arxiv.org/abs/2205.10287>`_
    (2022), the square-root scaling rule for Adam.
  """
  _checks.schedule_like(schedule, "sqrt_scaled_schedule: schedule", "a learning rate")
  _checks.schedule_like(window_weight, "sqrt_scaled_schedule: window_weight", "tokens per update")
  ref = _checks.positive_number(reference_weight, "sqrt_scaled_schedule: reference_weight")

  def scaled(count: jax.Array) -> jax.Array:
    lr = schedule(count) if callable(schedule) else schedule
    weight = window_weight(count) if callable(window_weight) else window_weight
    lr, weight = jnp.asarray(lr), jnp.asarray(weight)
    dt = _numerics.promote_types(lr.dtype, jnp.float32)
    return lr.astype(dt) * jnp.sqrt(weight.astype(dt) / jnp.asarray(ref, dt))

  return scaled
