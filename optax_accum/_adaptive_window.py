"""Adaptive windows: the effective batch follows the measured gradient noise scale (issue 40).

``optax_accum.adaptive_window(min_weight, max_weight)`` is a window policy that closes each window
when its weight reaches a budget, and moves the budget after each update toward ``fraction *
B_simple``, the gradient noise scale it measures from the windows' own microbatches (McCandlish et
al. 2018): bounded, changed at most by a factor per update, held at the minimum for a warm-up.
It composes the token budget's exact weight count (``_token_budget``) and the noise scale's
estimator (``_noise_scale``); its learning-rate rule is ``AdaptiveWindow.scale_learning_rate``.
docs/noise_scale.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _checks, _noise_scale, _numerics, _token_budget
from optax_accum._noise_scale import NoiseScale, NoiseScaleState
from optax_accum._protocols import Outcome, Position
from optax_accum._state import find_state
from optax_accum._token_budget import TokenBudget, TokenBudgetState

PyTree = Any

_RULES = {"sqrt": "Adam's square-root rule", "linear": "SGD's linear rule"}


class AdaptiveWindowState(NamedTuple):
  """The adaptive window's sub-state of :class:`optax_accum.AccumulationState`.

  Attributes:
    budget: float32, the open window's budget (weight units: tokens or examples); fixed while
      the window is open, ``min_weight`` until the warm-up ends.
    num_estimates: int32, windows whose noise estimate entered the EMAs (saturating).
    tokens: the exact weight counts (``TokenBudgetState``: ``weight_seen``, ``window_weight``).
    noise: the noise scale's EMAs (``NoiseScaleState``).
  """

  budget: jax.Array
  num_estimates: jax.Array
  tokens: TokenBudgetState
  noise: NoiseScaleState

  def metrics(self) -> dict[str, Any]:
    """What :func:`optax_accum.metrics` shows: ``window_budget``, ``weight_seen``,
    ``window_weight``, ``noise_scale``, ``noise_trace`` and ``noise_signal``."""
    return {"window_budget": self.budget, **self.tokens.metrics(), **self.noise.metrics()}


class WindowSums(NamedTuple):
  """The open window's sums (summed over the devices with the window at the boundary).

  Attributes:
    weight_parts: float ``[7]``, the window's weight in exact parts (``_weight_count``).
    noise: ``(sum_k n_k |g_k|^2, K)``, the noise scale's per-window sums.
  """

  weight_parts: jax.Array
  noise: tuple[jax.Array, jax.Array]


@dataclasses.dataclass(frozen=True)
class AdaptiveWindow:
  """A window policy whose budget follows the measured noise scale; see
  :func:`optax_accum.adaptive_window` (its Args are these attributes).

  Attributes:
    min_weight, max_weight: the budget's bounds (weight units).
    fraction: the budget's target, ``fraction * B_simple``.
    max_factor: the most the budget changes per update (up or down), > 1.
    warmup: windows with a noise estimate before the budget leaves ``min_weight``.
    noise: the noise-scale estimator (its ``decay``).
    max_microbatches: a cap on the microbatches per window, or None.
  """

  min_weight: float
  max_weight: float
  fraction: float
  max_factor: float
  warmup: int
  noise: NoiseScale
  max_microbatches: int | None

  @property
  def _tokens(self) -> TokenBudget:
    """The token budget's exact weight counting (its budget is not used)."""
    return TokenBudget(self.min_weight, None, self.max_microbatches)

  def init(self) -> AdaptiveWindowState:
    """A fresh sub-state: the budget at ``min_weight``, no estimate, nothing counted."""
    return AdaptiveWindowState(
      budget=jnp.asarray(self.min_weight, _numerics.scalar_dtype()),
      num_estimates=jnp.zeros((), jnp.int32),
      tokens=self._tokens.init(),
      noise=self.noise.init(),
    )

  def init_window(self) -> WindowSums:
    return WindowSums(self._tokens.init_window(), _noise_scale.zeros())

  def add(self, window: WindowSums, weight: jax.Array, grads: PyTree) -> WindowSums:
    """The exact weight parts and the noise sums (``n_k |g_k|^2``, one sample) of a microbatch."""
    return WindowSums(
      self._tokens.add(window.weight_parts, weight, grads),
      _noise_scale.add(window.noise, weight, grads),
    )

  def closes(self, state: AdaptiveWindowState, window: WindowSums, position: Position) -> jax.Array:
    """The window reaches ``state.budget`` (the global weight under ``axis_name``: one scalar
    all-reduce per microstep) or the microbatch cap."""
    del window
    return _token_budget.reaches(position, state.budget, self.max_microbatches)

  def close(
    self, state: AdaptiveWindowState, window: WindowSums, outcome: Outcome
  ) -> AdaptiveWindowState:
    """The weight counted, the window's noise estimate folded into the EMAs, and (past the
    warm-up, after a window whose estimate counted) the next window's budget."""
    tokens = self._tokens.close(state.tokens, window.weight_parts, outcome)
    noise, counted = self.noise.fold(state.noise, window.noise, outcome)
    n = jnp.where(counted, optax.safe_increment(state.num_estimates), state.num_estimates)
    adapt = counted & (n >= self.warmup)
    budget = jnp.where(adapt, self.next_budget(state.budget, noise), state.budget)
    return AdaptiveWindowState(budget, n, tokens, noise)

  def next_budget(self, budget: jax.Array, noise: NoiseScaleState) -> jax.Array:
    """The budget after an update: ``fraction * B_simple`` of the EMAs in ``noise``, within
    ``[budget / max_factor, budget * max_factor]`` and ``[min_weight, max_weight]``.

    Where the signal estimate is <= 0 (the noise dominates: no batch is too large) the target
    is ``max_weight``; where the trace estimate is <= 0 too, the budget stays.

    Examples:
      >>> policy = adaptive_window(100, 1000, max_factor=2.0)
      >>> ema = lambda trace, signal: NoiseScaleState(*map(jnp.float32, (trace, signal, 1)))
      >>> b = jnp.float32(300)
      >>> [float(policy.next_budget(b, ema(t, 1.0))) for t in (400, 900, 50, 1e5)]
      [400.0, 600.0, 150.0, 600.0]
      >>> [float(policy.next_budget(b, ema(t, -1.0))) for t in (5.0, -5.0)]
      [600.0, 300.0]
    """
    _, trace, signal = _noise_scale.read(*noise)
    dt = budget.dtype
    positive = signal > 0
    b_simple = trace / jnp.where(positive, signal, jnp.ones_like(signal))
    target = jnp.where(
      positive,
      jnp.asarray(self.fraction, dt) * b_simple.astype(dt),
      jnp.where(trace > 0, jnp.asarray(self.max_weight, dt), budget),
    )
    factor = jnp.asarray(self.max_factor, dt)
    low = jnp.maximum(jnp.asarray(self.min_weight, dt), budget / factor)
    high = jnp.minimum(jnp.asarray(self.max_weight, dt), budget * factor)
    return jnp.minimum(jnp.maximum(target, low), high)

  def check_aggregation(self, weighted_mean: bool) -> None:
    """Raises unless the window is the weighted mean (the noise estimate's premise)."""
    self.noise.check_aggregation(weighted_mean, "adaptive_window")

  def scale_learning_rate(
    self,
    tx: optax.GradientTransformation,
    *,
    reference_weight: float | None = None,
    rule: str = "sqrt",
  ) -> optax.GradientTransformationExtraArgs:
    """``tx`` with each applied update scaled for the weight of the window that made it.

    The update of a window of weight ``w`` is multiplied by ``sqrt(w / reference_weight)``
    (``rule='sqrt'``, Adam's rule: :meth:`TokenBudget.sqrt_scaled_schedule`'s, applied to the
    realized weight read from the state) or ``w / reference_weight`` (``rule='linear'``, SGD's):
    the learning rate follows the window as it grows. ``tx`` must contain the one
    ``accumulate(..., every_k=this policy)``; the result has its state (no state of its own),
    so ``metrics``, ``flush``, checkpoints and ``optax_accum.flax.Optimizer`` work unchanged
    (``update_and_apply`` takes ``tx.update`` + ``optax.apply_updates``: the scaling sits
    outside ``accumulate``).

    Scaling the update is scaling the learning rate for optimizers whose update is the learning
    rate times a direction (``sgd`` with or without momentum, ``adam``, ``adamw`` with its
    decoupled weight decay, ``lion``, ``adafactor``: optax applies the learning rate last). For
    one that keeps its learning rate in its state (schedule-free), scale the rate itself from
    ``metrics(state).window_weight`` with ``optax.inject_hyperparams``.

    Why a wrapper: the budget depends on measured noise, so a schedule of the step count cannot
    recompute it, and setting an ``optax.inject_hyperparams`` rate between calls would need a
    call per step and could only use the budget of the open window, not the weight the window
    reaches; the wrapper reads the weight of the very window it scales, at its boundary.

    Args:
      tx: the transformation holding ``accumulate(inner, every_k=self)`` (it, a chain, ...).
      reference_weight: the window weight at which ``inner``'s learning rate applies unscaled
        (finite, > 0); default ``min_weight``, the windows of the warm-up.
      rule: ``'sqrt'`` (Adam, AdamW, Lion) or ``'linear'`` (SGD).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``tx``'s ``init`` and state.

    Raises:
      ValueError: a bad ``reference_weight`` or ``rule``; at ``init`` or ``update``, a state
        with no or several ``accumulate`` states.
      TypeError: at ``init`` or ``update``, an ``accumulate`` state whose window policy is not an
        adaptive window.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> policy = optax_accum.adaptive_window(8, 8)  # windows of 8 examples
      >>> tx = policy.scale_learning_rate(optax_accum.accumulate(optax.sgd(1.0), policy),
      ...                                 reference_weight=2)
      >>> params = {'w': jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for n in (4, 4):  # one window of weight 8: lr 1.0 * sqrt(8 / 2)
      ...   u, state = tx.update({'w': jnp.ones(2)}, state, params, weight=n)
      >>> u['w']
      Array([-2., -2.], dtype=float32)

    References:
      Malladi et al. 2022, `On the SDEs and Scaling Rules for Adaptive Gradient Algorithms
      <https://arxiv.org/abs/2205.10287>`_ (square root for Adam); Goyal et al. 2017,
      `Accurate, Large Minibatch SGD <https://arxiv.org/abs/1706.02677>`_ (linear for SGD).
    """
    ref = self.min_weight if reference_weight is None else reference_weight
    ref = _checks.real_number(ref, "scale_learning_rate: reference_weight", "> 0")
    _checks.require(
      "scale_learning_rate",
      [
        (np.isfinite(ref) and ref > 0, f"reference_weight must be finite and > 0, got {ref}"),
        (
          rule in _RULES,
          f"rule must be 'sqrt' (Adam's square-root rule) or 'linear' (SGD's), got {rule!r}",
        ),
      ],
    )

    def factor(weight: jax.Array) -> jax.Array:
      if rule == "linear":
        return weight / jnp.asarray(ref, weight.dtype)
      # The token budget's rule, 1.0 * sqrt(weight / ref), at the realized weight.
      return _token_budget.sqrt_scaled_schedule(1.0, lambda w: w, ref)(weight)

    def window_state(state):
      """tx's accumulate state; raises unless tx holds one accumulate with an adaptive window."""
      try:
        acc = find_state(state)
      except ValueError as e:
        raise ValueError(
          "scale_learning_rate(tx) scales by the window weight of the accumulate inside tx: "
          "pass optax_accum.accumulate(inner, every_k=this adaptive_window), not the inner "
          f"optimizer alone ({e})"
        ) from e
      if not isinstance(acc.policy, AdaptiveWindowState):
        raise TypeError(
          "scale_learning_rate scales by the window weight of an adaptive window, but the "
          f"accumulate in tx has the window policy state {type(acc.policy).__name__}. Wrap "
          "the transformation whose accumulate has every_k=this adaptive_window."
        )
      return acc

    def init_fn(params):
      state = tx.init(params)
      window_state(state)  # refused when made, not at the first update
      return state

    def update_fn(updates, state, params=None, **extra_args):
      updates, state = tx.update(updates, state, params, **extra_args)
      acc = window_state(state)
      weight = acc.policy.tokens.window_weight.approx()
      scale = jnp.where(acc.updated, factor(weight), jnp.ones((), weight.dtype))
      return jax.tree.map(lambda u: u * scale.astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adaptive_window(
  min_weight: float,
  max_weight: float,
  *,
  fraction: float = 1.0,
  max_factor: float = 1.1,
  warmup: int = 10,
  decay: float = 0.9,
  max_microbatches: int | None = None,
) -> AdaptiveWindow:
  """Windows whose weight follows the measured critical batch: ``fraction * B_simple``.

  A window policy for ``accumulate(inner, every_k=adaptive_window(...))``. Each window closes
  at the first microbatch whose weight reaches the current budget (as
  :func:`optax_accum.token_budget`: the window mean divides by the weight accumulated, counted
  exactly). The windows' own microbatches give the gradient noise scale ``B_simple = tr(Sigma) /
  |G|^2`` (McCandlish et al. 2018, appendix A; as :func:`optax_accum.noise_scale`, a bias-corrected
  EMA over windows, in ``weight`` units); after each update whose window gave an estimate, the
  next budget moves toward ``fraction * B_simple``, by at most ``max_factor`` (so a noisy
  estimate cannot make the windows oscillate), within ``[min_weight, max_weight]``. The first
  ``warmup`` estimated windows run at ``min_weight``. Under ``axis_name`` the decision is global:
  one scalar all-reduce per microstep, the noise sums in the boundary's one ``psum``; every
  device holds the same budget. The budget is in the state: a run resumed mid-window continues
  the same window sizes. ``metrics(state)`` shows ``window_budget``, ``noise_scale``,
  ``weight_seen`` and ``window_weight``. Scale the learning rate with the window:
  ``AdaptiveWindow.scale_learning_rate``. docs/noise_scale.md.

  A window needs two microbatches of nonzero weight for an estimate (each device's microbatch is
  a sample under ``axis_name``): make ``min_weight`` at least two microbatches' weight, or the
  budget never leaves it.

  Args:
    min_weight: the smallest budget, and the warm-up's (weight units: tokens or examples;
      finite, > 0, exact in the float32 weight sum: integers up to 2**24 are).
    max_weight: the largest budget (as ``min_weight``, >= it; equal: a fixed
      ``token_budget(min_weight)`` that also measures the noise scale).
    fraction: the target as a fraction of ``B_simple`` (finite, > 0). McCandlish et al.'s
      critical batch is near ``B_simple`` for SGD; a batch of ``B_simple`` takes about twice
      the minimal number of steps and twice the minimal data.
    max_factor: the most the budget grows or shrinks per update (finite, > 1).
    warmup: windows with a noise estimate before the budget moves (an int >= 1).
    decay: the noise EMA's decay per window, in [0, 1) (``noise_scale(decay)``).
    max_microbatches: also close a window at this many microbatches (an int >= 1); None: no
      cap.

  Returns:
    An ``AdaptiveWindow``; its ``scale_learning_rate`` scales each update with the window.

  Raises:
    TypeError, ValueError: naming the bad argument and what to pass; at ``accumulate``, with a
      fixed denominator or per-leaf rules (the estimate needs the weighted mean).

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, optax_accum
    >>> # One example per microbatch, gradient w - y with y ~ N(1, 8^2) at w = 0: B_simple = 64.
    >>> policy = optax_accum.adaptive_window(4, 32, max_factor=2.0, warmup=3)
    >>> tx = optax_accum.accumulate(optax.sgd(0.0), every_k=policy)
    >>> params = {'w': jnp.zeros(())}
    >>> step = jax.jit(lambda s, y: tx.update({'w': -y}, s, params, weight=1)[1])
    >>> state = tx.init(params)
    >>> for y in np.random.default_rng(0).normal(1.0, 8.0, size=600).astype(np.float32):
    ...   state = step(state, y)
    >>> m = optax_accum.metrics(state)  # 4 for 3 windows, then up to 2x per update, to 32
    >>> float(m.window_budget), int(m.window_weight), float(m.noise_scale) > 32
    (32.0, 32, True)

  References:
    McCandlish et al. 2018, `An Empirical Model of Large-Batch Training
    <https://arxiv.org/abs/1812.06162>`_; Johnson et al. 2020, `AdaScale SGD
    <https://arxiv.org/abs/2007.05105>`_ (adapting the step to the noise); batch-size warmup
    by hand: OLMo-core's ``BatchSizeSchedulerCallback``, Megatron-LM's ``--rampup-batch-size``.
  """
  owner = "adaptive_window"
  lo = _token_budget.budget_number(min_weight, f"{owner}: min_weight")
  hi = _token_budget.budget_number(max_weight, f"{owner}: max_weight")
  frac = _checks.real_number(fraction, f"{owner}: fraction", "of B_simple, e.g. 1.0")
  factor = _checks.real_number(max_factor, f"{owner}: max_factor", "per update, e.g. 1.1")
  d = _checks.real_number(decay, f"{owner}: decay", "the noise EMA's decay per window, e.g. 0.9")
  _checks.require(
    owner,
    [
      (hi >= lo, f"max_weight={max_weight} is below min_weight={min_weight}; pass max >= min"),
      (np.isfinite(frac) and frac > 0, f"fraction must be finite and > 0, got {fraction}"),
      (
        np.isfinite(factor) and factor > 1,
        f"max_factor must be finite and > 1 (the most the budget changes per update), got "
        f"{max_factor}; for a fixed budget pass min_weight == max_weight",
      ),
      (0 <= d < 1, f"decay must be in [0, 1) (the noise EMA's decay per window), got {decay}"),
    ],
  )
  warmup = _checks.positive_int(warmup, f"{owner}: warmup", "estimated windows at min_weight")
  if max_microbatches is not None:
    max_microbatches = _checks.positive_int(
      max_microbatches, f"{owner}: max_microbatches", "microbatches per window"
    )
  return AdaptiveWindow(lo, hi, frac, factor, warmup, NoiseScale(d), max_microbatches)
