"""Choose the microbatch size from compiled memory, before the first step.

:func:`plan_microbatch` compiles a few sizes (XLA ``memory_analysis()``, nothing run) instead
of retrying on out-of-memory; :meth:`MicrobatchPlan.microbatches_for` turns the plan into
``num_microbatches`` (in-step) or ``every_k`` (across-step) for a global batch.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from optax_accum import _checks

SAFETY_MARGIN = 0.10
"""Fraction of ``bytes_limit`` the default budget leaves free, for what the compiled step does not
count (arrays held outside the step, allocator fragmentation)."""

DEFAULT_SIZES = tuple(2**i for i in range(21))  # 1, 2, 4, ..., 1,048,576 rows

_UNITS = {"": 1, "b": 1}  # IEC 80000-13: kB = 1000 bytes, KiB = 1024 bytes
_UNITS.update({f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")})
_UNITS.update({f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")})


class MicrobatchPlan(NamedTuple):
  """What :func:`plan_microbatch` found.

  Attributes:
    size: the largest candidate size (rows) whose compiled step fits ``budget``.
    peak_bytes: the compiled step's bytes at ``size`` (per device under a mesh).
    budget: the budget in bytes the sizes were held to.
    measured: ``{size: peak bytes}`` of every size looked at (compiled or ``known``), in order.
    num_compilations: how many sizes were compiled (those of ``measured`` not ``known``).
    num_candidates: how many candidate sizes there were.
    fixed_bytes: the two probes' line at size 0 (params, optimizer state, fixed buffers).
    bytes_per_row: its slope, bytes per microbatch row (0.0 with one candidate).
  """

  size: int
  peak_bytes: int
  budget: int
  measured: dict[int, int]
  num_compilations: int
  num_candidates: int
  fixed_bytes: float
  bytes_per_row: float

  def microbatches_for(self, global_batch: int, *, multiple_of: int = 1) -> MicrobatchSplit:
    """Cuts ``global_batch`` rows into the fewest equal microbatches that fit this plan.

    The size is the largest divisor of ``global_batch`` that is <= ``size`` and a multiple
    of ``multiple_of``; every microbatch is full, so the update is one physical batch's.

    Args:
      global_batch: rows per optimizer update (in the units of ``make_args``'s size).
      multiple_of: the microbatch size must be a multiple of this (e.g. the
        data-parallel devices, so each gets whole rows).

    Returns:
      A ``MicrobatchSplit`` (``num_microbatches`` in-step, ``every_k`` across-step).

    Raises:
      TypeError, ValueError: for a non-positive ``global_batch`` or ``multiple_of``,
        or when no multiple of ``multiple_of`` at most ``size`` divides ``global_batch``.

    Examples:
      >>> plan = MicrobatchPlan(48, 0, 0, {}, 0, 0, 0.0, 0.0)  # a plan that found 48 rows
      >>> plan.microbatches_for(256)
      MicrobatchSplit(microbatch_size=32, num_microbatches=8)
      >>> plan.microbatches_for(256, multiple_of=8).every_k
      8
    """
    return _split(self.size, global_batch, multiple_of)


class MicrobatchSplit(NamedTuple):
  """A global batch cut into equal microbatches (see :meth:`MicrobatchPlan.microbatches_for`).

  Attributes:
    microbatch_size: rows per microbatch.
    num_microbatches: microbatches per global batch (in-step; ``every_k`` across-step).
  """

  microbatch_size: int
  num_microbatches: int

  @property
  def every_k(self) -> int:
    """``num_microbatches``, under its across-step name."""
    return self.num_microbatches


def parse_bytes(value: int | str) -> int:
  """Reads a memory size: an int of bytes, or a string like ``"200MB"`` or ``"1.5GiB"``.

  Units (case-insensitive, IEC 80000-13): ``B``, ``kB MB GB TB`` (1000**n), ``KiB MiB GiB TiB``
  (1024**n); none means bytes.

  Returns the size in bytes, an int >= 1 (rounded down).

  Raises:
    TypeError: if ``value`` is neither an int nor a str.
    ValueError: if the string is not a number and a unit above, or the size is < 1 byte.

  Examples:
    >>> parse_bytes("200MB"), parse_bytes("1.5GiB"), parse_bytes(4096)
    (200000000, 1610612736, 4096)
  """
  if isinstance(value, bool) or not isinstance(value, (int, str)):
    raise TypeError(f"A memory size must be an int of bytes or a str like '200MB', got {value!r}.")
  if isinstance(value, int):
    size = value
  else:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
      raise ValueError(
        f"Cannot read the memory size {value!r}: write a number and a unit, like '200MB', "
        "'1.5GiB' or '512KiB' (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)."
      )
    size = int(float(match.group(1)) * _UNITS[unit])
  if size < 1:
    raise ValueError(f"A memory size must be at least 1 byte, got {value!r}.")
  return size


def default_budget(device: Any = None) -> int:
  """The device's ``bytes_limit`` (``memory_stats()``) less :data:`SAFETY_MARGIN`.

  ``device`` defaults to ``jax.devices()[0]``; the result is
  ``floor(bytes_limit * (1 - SAFETY_MARGIN))`` bytes.

  Raises:
    ValueError: where the backend reports no ``bytes_limit`` (CPU); pass ``memory_budget=``.

  Examples:
    >>> default_budget()  # doctest: +SKIP
    128849018880
  """
  device = jax.devices()[0] if device is None else device
  stats = device.memory_stats()
  if not stats or not stats.get("bytes_limit"):
    raise ValueError(
      f"{device} reports no memory limit (memory_stats() gives {stats!r}), so there is no "
      "default budget on this backend. Pass memory_budget=, e.g. memory_budget='2GB'."
    )
  return int(stats["bytes_limit"] * (1 - SAFETY_MARGIN))


def compiled_peak_bytes(step_fn: Callable[..., Any], *args: Any) -> int:
  """Bytes the compiled ``step_fn(*args)`` needs: arguments + outputs + temporaries - aliased.

  From ``jax.jit(step_fn).lower(*args).compile().memory_analysis()``, keeping a jitted step's
  shardings and donation (aliased: outputs in donated buffers); per device if sharded. Nothing runs.

  ``step_fn``: a function or a ``jax.jit`` function; ``args``: ``jax.ShapeDtypeStruct`` leaves
  are enough. Returns the bytes, an int.

  Raises:
    ValueError: if the backend gives no memory analysis.

  Examples:
    >>> x = jax.ShapeDtypeStruct((1000, 10), jnp.float32)
    >>> n = compiled_peak_bytes(lambda x: x.sum(), x)  # 40,000 bytes in, one float32 out
    >>> 40_004 <= n < 40_200  # and a few bytes of temporaries, as the XLA version decides
    True
  """
  lower = getattr(step_fn, "lower", None) or jax.jit(step_fn).lower  # a jit function's own
  stats = lower(*args).compile().memory_analysis()
  if stats is None:
    raise ValueError(
      f"The {jax.default_backend()} backend gives no memory analysis of compiled programs, "
      "so the microbatch size cannot be planned from compiled memory here."
    )
  return int(
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    + stats.temp_size_in_bytes
    - stats.alias_size_in_bytes
  )


def _candidates(sizes: Sequence[int] | None) -> Sequence[int]:
  """The sorted, distinct candidates; a ``range`` stays a ``range`` (never listed)."""
  if sizes is None:
    return DEFAULT_SIZES
  if isinstance(sizes, range):
    if sizes.step < 0:
      sizes = sizes[::-1]
    if len(sizes) and sizes.start < 1:
      raise ValueError(f"sizes must be >= 1 (rows per microbatch), got {sizes}.")
    cands: Sequence[int] = sizes
  else:
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if bad:
      raise ValueError(f"sizes must be ints >= 1 (rows per microbatch); these are not: {bad[:5]}.")
    cands = sorted(set(sizes))
  if not len(cands):
    raise ValueError("sizes is empty: give at least one candidate microbatch size.")
  return cands


def _search(
  cands: Sequence[int], bytes_at: Callable[[int], int], budget: int, known: dict[int, int]
) -> dict[int, int]:
  """Compiles as few candidates as it can; returns ``{size: bytes}`` of those it looked at.

  The probes' line predicts an index; gallop from it, then bisect the fits/does-not-fit bracket.
  """
  measured: dict[int, int] = {}

  def excess(i: int) -> float:
    size = cands[i]
    measured[size] = known[size] if size in known else bytes_at(size)
    return measured[size] - budget

  n = len(cands)
  f_lo = excess(0)
  if f_lo > 0 or n == 1:
    return measured
  f_hi = excess(n - 1)
  if f_hi <= 0:
    return measured
  lo, hi = 0, n - 1
  x = cands[lo] + (cands[hi] - cands[lo]) * (-f_lo) / (f_hi - f_lo)  # the line's crossing
  k = min(max(bisect.bisect_right(cands, x) - 1, lo + 1), hi - 1)
  offset, bisecting = 1, False
  while hi - lo > 1:
    fits = excess(k) <= 0
    lo, hi = (k, hi) if fits else (lo, k)
    if not bisecting and offset <= (hi - lo) // 2:  # gallop on from the side just moved
      k = lo + offset if fits else hi - offset
      offset *= 2
    else:
      bisecting, k = True, (lo + hi) // 2
  return measured


def plan_microbatch(
  step_fn: Callable[..., Any],
  make_args: Callable[[int], tuple[Any, ...]],
  *,
  memory_budget: int | str | None = None,
  sizes: Sequence[int] | None = None,
  known: Mapping[int, int] | None = None,
) -> MicrobatchPlan:
  """The largest microbatch size whose compiled step fits a memory budget.

  Compiles ``step_fn(*make_args(size))`` for a few sizes (``lower(...).compile()`` and XLA's
  ``memory_analysis()``: arguments + outputs + temporaries - aliased; nothing runs): 4
  compilations for linear bytes, at most about ``2 * log2(len(sizes)) + 3``. Assumes bytes
  do not shrink as the size grows. Sharded, in-step and across-step use: ``docs/planning.md``.

  Args:
    step_fn: the train step; pass the ``jax.jit`` function itself to keep its
      ``donate_argnums`` (donated state is counted once, not twice) and shardings.
    make_args: ``make_args(size)`` -> the tuple of ``step_fn``'s positional arguments for
      ``size`` rows; ``jax.ShapeDtypeStruct`` leaves (e.g. ``jax.eval_shape``) are enough.
    memory_budget: bytes, an int or a str such as ``"200MB"`` or ``"1.5GiB"`` (IEC: kB = 1000,
      KiB = 1024). Default: the device's ``bytes_limit`` less 10%; required on CPU.
    sizes: candidate sizes (rows), e.g. divisors of the per-device batch; a ``range`` is not
      listed. Default: powers of two from 1 to 2**20.
    known: ``{size: bytes}`` already measured for this step (e.g. a size just refused);
      looked up instead of compiled.

  Returns:
    A ``MicrobatchPlan``.

  Raises:
    ValueError: if the budget cannot be read or has no default here, ``sizes`` holds no valid
      size, or even the smallest candidate does not fit.
    TypeError: if ``make_args`` does not return a tuple.

  Examples:
    >>> def step(w, x):  # the gradient of a 1000-parameter linear model
    ...   return jax.grad(lambda w: ((x @ w) ** 2).mean())(w)
    >>> def make_args(size):
    ...   return (jax.ShapeDtypeStruct((1000,), jnp.float32),
    ...           jax.ShapeDtypeStruct((size, 1000), jnp.float32))
    >>> plan = plan_microbatch(step, make_args, memory_budget="1MB", sizes=range(1, 1025))
    >>> plan.size, plan.peak_bytes <= 1_000_000 < plan.measured[plan.size + 1]
    (247, True)
    >>> plan.num_compilations, 4_000 <= plan.bytes_per_row < 4_016  # 4,000 bytes of x per row
    (4, True)
  """
  budget = default_budget() if memory_budget is None else parse_bytes(memory_budget)
  cands = _candidates(sizes)

  def bytes_at(size: int) -> int:
    args = make_args(size)
    if not isinstance(args, tuple):
      raise TypeError(
        f"make_args({size}) must return a tuple of step_fn's positional arguments, got "
        f"{type(args).__name__}. For a single argument return (arg,)."
      )
    return compiled_peak_bytes(step_fn, *args)

  known = {int(k): int(v) for k, v in (known or {}).items()}
  measured = _search(cands, bytes_at, budget, known)
  smallest = cands[0]
  if measured[smallest] > budget:
    raise ValueError(
      f"Even the smallest candidate microbatch ({smallest} rows) needs "
      f"{measured[smallest]:,} bytes, over the memory_budget of {budget:,} bytes. Raise "
      "memory_budget, add smaller sizes, shard the step over more devices or shrink the model."
    )
  size = max(s for s, b in measured.items() if b <= budget)
  fixed, per_row = float(measured[smallest]), 0.0
  if len(cands) > 1:
    largest = cands[len(cands) - 1]
    per_row = (measured[largest] - measured[smallest]) / (largest - smallest)
    fixed = measured[smallest] - per_row * smallest
  return MicrobatchPlan(
    size=size,
    peak_bytes=measured[size],
    budget=budget,
    measured=measured,
    num_compilations=len(measured.keys() - known.keys()),
    num_candidates=len(cands),
    fixed_bytes=fixed,
    bytes_per_row=per_row,
  )


def _split(limit: int, global_batch: int, multiple_of: int) -> MicrobatchSplit:
  """:meth:`MicrobatchPlan.microbatches_for` for a planned size ``limit``."""
  global_batch = _checks.positive_int(global_batch, "global_batch", "rows per update")
  multiple_of = _checks.positive_int(multiple_of, "multiple_of", "a factor of the microbatch size")
  best = 0
  for d in range(1, math.isqrt(global_batch) + 1):
    if global_batch % d == 0:
      for size in (d, global_batch // d):
        if size <= limit and size % multiple_of == 0:
          best = max(best, size)
  if best == 0:
    raise ValueError(
      f"No microbatch size divides global_batch={global_batch}, is a multiple of "
      f"multiple_of={multiple_of} and is at most the planned {limit} rows. Choose a "
      "global batch divisible by multiple_of, or raise the memory budget."
    )
  return MicrobatchSplit(microbatch_size=best, num_microbatches=global_batch // best)
