"""The gradient noise scale ``B_simple`` from a window's own microbatches (an observer).

McCandlish et al. 2018 (appendix A): the window is ``B_big``, a microbatch ``B_small`` (they
share the params). Per microbatch only the scalar ``n_k |g_k|^2`` (:func:`add`); ``|G_B|^2``
is the boundary's global norm. Both paths use it; when it is valid: docs/noise_scale.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import _checks, _numerics
from optax_accum._protocols import Outcome

PyTree = Any


class NoiseScaleState(NamedTuple):
  """The noise scale's sub-state of :class:`optax_accum.AccumulationState` (changed at boundaries).

  The open window's sums ``(sum_k n_k |g_k|^2, K)`` are in ``state.window.noise``.

  Attributes:
    trace_ema: float, the EMA numerator of ``S_est`` (the estimate of ``tr(Sigma)``).
    signal_ema: float, the EMA numerator of ``G2_est`` (the estimate of ``|G|^2``).
    ema_weight: float, the bias-correction weight ``1 - decay**t`` after ``t``
      windows that counted: 0 means "no estimate yet".
  """

  trace_ema: jax.Array
  signal_ema: jax.Array
  ema_weight: jax.Array

  def metrics(self) -> dict[str, Any]:
    """What :func:`optax_accum.metrics` shows: ``noise_scale``, ``noise_trace``,
    ``noise_signal`` (``B_simple`` and its parts, bias corrected; 0 before an estimate)."""
    b, trace, signal = read(self.trace_ema, self.signal_ema, self.ema_weight)
    return {"noise_scale": b, "noise_trace": trace, "noise_signal": signal}


@dataclasses.dataclass(frozen=True)
class NoiseScale:
  """An observer of the gradient noise scale; made by :func:`optax_accum.noise_scale`.

  Attributes:
    decay: the EMA decay per window, in [0, 1).
  """

  decay: float

  def init(self) -> NoiseScaleState:
    """A fresh sub-state: no estimate yet (fresh buffers each, for donation)."""
    zero = lambda: jnp.zeros((), _numerics.scalar_dtype())
    return NoiseScaleState(zero(), zero(), zero())

  def init_window(self, params: PyTree) -> tuple[jax.Array, jax.Array]:
    del params
    return zeros()

  def add(
    self, window: tuple[jax.Array, jax.Array], weight: jax.Array, grads: PyTree
  ) -> tuple[jax.Array, jax.Array]:
    return add(window, weight, grads)

  def close(
    self, state: NoiseScaleState, window: tuple[jax.Array, jax.Array], outcome: Outcome
  ) -> NoiseScaleState:
    """The window's estimate folded into the EMAs (finite, applied-or-not-spiked, K >= 2)."""
    return self.fold(state, window, outcome)[0]

  def fold(
    self, state: NoiseScaleState, window: tuple[jax.Array, jax.Array], outcome: Outcome
  ) -> tuple[NoiseScaleState, jax.Array]:
    """``(sub-state, counted)``: the sub-state after the window, and whether its estimate
    entered the EMAs (a finite window, not empty nor a spike, with ``K >= 2``)."""
    stats = outcome.stats
    sq_sum, samples = window
    est = estimate(sq_sum, samples, stats.weight, stats.grad_norm, outcome.loss_scale)
    ok = outcome.finite & ~outcome.empty & ~outcome.spike
    return NoiseScaleState(*ema_update(tuple(state), est, self.decay, ok)), est.valid & ok

  def check_aggregation(self, weighted_mean: bool, owner: str = "noise_scale") -> None:
    """Raises unless the window is the weighted mean (the estimate's premise)."""
    if not weighted_mean:
      raise ValueError(
        f"{owner} estimates the noise of a weighted mean: it cannot observe a window with "
        "a fixed denominator, apply_empty or per-leaf rules (optax_accum.aggregate(...), or "
        "Flax FP8 leaves: give them reduce='mean'). Leave one of them out."
      )


def noise_scale(decay: float = 0.9) -> NoiseScale:
  """The gradient noise scale ``B_simple`` of each window, as an EMA (an observer).

  ``accumulate(inner, every_k, observe=(optax_accum.noise_scale(0.9),))`` estimates the
  critical batch size's simple estimate ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al.
  2018, appendix A) from each window's own microbatches, which all see the same params, in the
  units of ``weight`` (tokens, if you pass token counts): ``metrics(state).noise_scale``,
  ``noise_trace`` and ``noise_signal``. A window needs two nonzero-weight microbatches (under
  ``axis_name`` each device's are samples); skipped, spiked and empty windows do not count. It
  costs one reduction per microbatch (``weight * |g|^2``) and a few scalars at the boundary.
  docs/noise_scale.md.

  Args:
    decay: the EMA decay per window, in [0, 1): 0 keeps only the last window, 0.9 averages
      about 10 windows.

  Returns:
    A ``NoiseScale`` observer.

  Raises:
    TypeError: ``decay`` is not a number.
    ValueError: ``decay`` is outside [0, 1); at ``accumulate``, with a fixed denominator or
      per-leaf rules (the estimate needs the weighted mean).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), every_k=2,
    ...                             observe=(optax_accum.noise_scale(0.0),))
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for g, n in (([1., 1.], 1), ([3., 3.], 3)):  # N = 4, |G_B|^2 = 12.5, sum n|g|^2 = 56
    ...   _, state = tx.update({'w': jnp.array(g)}, state, params, weight=n)
    >>> m = optax_accum.metrics(state)  # S = (56 - 50) / 1 = 6; G2 = (25 - 14) / 1 = 11
    >>> float(m.noise_trace), float(m.noise_signal), round(float(m.noise_scale), 4)
    (6.0, 11.0, 0.5455)

  References:
    McCandlish et al. 2018, `An Empirical Model of Large-Batch Training
    <https://arxiv.org/abs/1812.06162>`_, appendix A.
  """
  meaning = "the EMA decay per window, e.g. 0.9"
  value = _checks.real_number(decay, "noise_scale: decay", meaning)
  if not 0 <= value < 1:
    raise ValueError(
      f"noise_scale: decay must be in [0, 1) (the EMA decay per window; 0 keeps only the last "
      f"window, 0.9 averages about 10 windows), got {decay}."
    )
  return NoiseScale(value)


class NoiseEstimate(NamedTuple):
  """One window's (or one in-step batch's) unbiased noise estimates; 0-d arrays.

  Attributes:
    trace: float, ``S_est`` ~ ``tr(Sigma)``, the per-example (or per-token) gradient
      covariance's trace (squared gradient units times ``weight`` units).
    signal: float, ``G2_est`` ~ ``|G|^2`` of the true mean gradient; may be negative by
      chance when the noise dominates.
    num_samples: int32, ``K``: nonzero-weight microbatches (times the devices).
    valid: bool, ``K >= 2``, a positive weight sum and finite values (else both are 0).
  """

  trace: jax.Array
  signal: jax.Array
  num_samples: jax.Array
  valid: jax.Array


def zeros() -> tuple[jax.Array, jax.Array]:
  """A fresh window's noise sums ``(sum_k n_k |g_k|^2, K)``: float zeros (the weight-sum dtype).

  ``K`` is a float too, so that both ride in the boundary's one all-reduce with the
  other float sums (an int32 would be a second all-reduce); it is exact up to 2**24.
  """
  return jnp.zeros((), _numerics.scalar_dtype()), jnp.zeros((), _numerics.scalar_dtype())


def add(
  sums: tuple[jax.Array, jax.Array], weight: jax.Array, grads: PyTree
) -> tuple[jax.Array, jax.Array]:
  """The window's noise sums with one microbatch added: ``n_k |g_k|^2`` and one sample.

  ``|g_k|^2`` is summed over the (scaled) gradient cast to its accumulator dtype (float32 or
  wider), as the window's sum casts it, so both fuse into one read of the gradient. A
  weight-0 microbatch (a flush, all padding) is not a sample and adds nothing, even a NaN.

  Examples:
    >>> s = add(zeros(), jnp.float32(2), {'w': jnp.array([3., 4.])})
    >>> float(s[0]), int(s[1])  # 2 * (9 + 16)
    (50.0, 1)
  """
  sq_sum, samples = sums
  cast = jax.tree.map(lambda g: jnp.asarray(g).astype(_numerics.accumulator_dtype(g.dtype)), grads)
  sq = optax.tree.norm(cast, squared=True).astype(sq_sum.dtype)
  nonzero = weight != 0
  term = jnp.where(nonzero, weight.astype(sq.dtype) * sq, jnp.zeros((), sq.dtype))
  return sq_sum + term, samples + nonzero.astype(samples.dtype)


def estimate(
  sq_sum: jax.Array,
  samples: jax.Array,
  weight_sum: jax.Array,
  mean_norm: jax.Array,
  loss_scale: jax.Array | None = None,
) -> NoiseEstimate:
  """``S_est`` and ``G2_est`` of a closed window (module docstring; McCandlish et al. 2018).

  ``sq_sum = sum_k n_k |g_k|^2`` (divided by ``loss_scale**2``), ``samples = K``,
  ``weight_sum = N``, ``mean_norm = |G_B|`` (unscaled). Zeros and ``valid=False`` for
  ``K < 2``, ``N <= 0`` or a non-finite result.

  Examples:
    >>> # n = (1, 3), g = (1, 3): N = 4, G_B = 2.5, sum n |g|^2 = 28
    >>> e = estimate(jnp.float32(28), jnp.int32(2), jnp.float32(4), jnp.float32(2.5))
    >>> float(e.trace), float(e.signal), bool(e.valid)  # (28 - 25) / 1, (12.5 - 7) / 1
    (3.0, 5.5, True)
  """
  dtype = _numerics.promote_types(_numerics.scalar_dtype(), sq_sum.dtype)
  sq = sq_sum.astype(dtype)
  if loss_scale is not None:
    s = jnp.asarray(loss_scale).astype(dtype)
    sq = sq / s / s
  k = samples.astype(dtype)
  n = weight_sum.astype(dtype)
  g2 = jnp.square(mean_norm.astype(dtype))
  enough = (samples >= 2) & (n > 0)
  one = jnp.ones((), dtype)
  km1 = jnp.where(enough, k - 1, one)
  safe_n = jnp.where(enough, n, one)
  trace = (sq - n * g2) / km1
  signal = (k * g2 - sq / safe_n) / km1
  valid = enough & jnp.isfinite(trace) & jnp.isfinite(signal)
  zero = jnp.zeros((), dtype)
  num = samples.astype(jnp.int32)
  return NoiseEstimate(jnp.where(valid, trace, zero), jnp.where(valid, signal, zero), num, valid)


def ema_update(
  ema: tuple[jax.Array, jax.Array, jax.Array], est: NoiseEstimate, decay: float, ok: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The bias-corrected EMAs after one window: ``(trace_ema, signal_ema, weight)``.

  ``x_ema = decay * x_ema + (1 - decay) * x`` for ``S_est`` and ``G2_est``, and the weight
  ``w = decay * w + (1 - decay)`` (``1 - decay**t``, Adam's bias correction): the estimates
  are ``x_ema / w``. Unchanged unless ``est.valid & ok`` (not skipped, empty or ``K < 2``).

  Examples:
    >>> est = NoiseEstimate(jnp.float32(3), jnp.float32(5.5), jnp.int32(2), jnp.bool_(True))
    >>> ema = ema_update((jnp.float32(0),) * 3, est, 0.9, jnp.bool_(True))
    >>> [round(float(x), 4) for x in ema]  # 0.1 * 3, 0.1 * 5.5, 0.1
    [0.3, 0.55, 0.1]
  """
  use = est.valid & ok

  def step(old, x):
    d = jnp.asarray(decay, old.dtype)
    new = d * old + (1 - d) * x.astype(old.dtype)
    return jnp.where(use, new, old)

  trace_ema, signal_ema, weight = ema
  one = jnp.ones((), weight.dtype)
  return step(trace_ema, est.trace), step(signal_ema, est.signal), step(weight, one)


def read(
  trace_ema: jax.Array, signal_ema: jax.Array, weight: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(B_simple, EMA(S_est), EMA(G2_est))``, bias corrected, from the state's EMA fields.

  All 0 before the first window with ``K >= 2`` closes (``weight == 0``). ``B_simple = trace /
  signal`` where ``signal > 0``, else 0 (the noise dominates: ``B_simple`` is not defined).

  Examples:
    >>> [float(x) for x in read(jnp.float32(0.3), jnp.float32(0.6), jnp.float32(0.1))]
    [0.5, 3.0, 6.0]
  """
  trace = _numerics.guarded_divide(trace_ema, weight)
  signal = _numerics.guarded_divide(signal_ema, weight)
  positive = signal > 0
  b = jnp.where(positive, trace / jnp.where(positive, signal, jnp.ones_like(signal)), 0)
  return b.astype(trace.dtype), trace, signal
