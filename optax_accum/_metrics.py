"""What to log about accumulation: :class:`Metrics` and :func:`metrics`.

Read from any optimizer state holding one ``accumulate`` state; works under ``jit``, never warns.
The core's counters, and what each feature's sub-state shows through its ``metrics()`` method.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum._state import find_state, shown_by_argument

PyTree = Any


class Metrics(NamedTuple):
  """What to log about accumulation; all fields are 0-d arrays.

  Attributes:
    mini_step: int32, microbatches in the current, open window.
    num_microbatches: int32, microbatches consumed since init (resume position).
    num_updates: int32, windows applied: drives per-update work (EMA, eval, checkpoints, logs).
    num_skipped: int32, windows skipped for a NaN or Inf.
    num_spikes: int32, finite windows skipped by ``accumulate(..., skip_if=...)`` (0 without).
    num_dropped: int32, microbatches dropped by an ``optax.MultiSteps``
      ``should_skip_update_fn`` given as ``skip_if`` (0 without).
    pending_weight: float, the weight (examples or tokens) in the open window.
    updated: bool, whether the last call applied an update.
    window_loss: float, weighted mean ``value`` of the last closed window with a finite one
      (0.0 if none: read ``has_window_loss``).
    has_window_loss: bool, False if no window with ``value`` has closed or its mean was NaN/Inf.
    loss_scale: float32, the current window's loss scale (1.0 without ``loss_scale=``).
    grad_norm: float, pre-clip global norm of the last closed window's mean gradient (0.0
      before the first; the last finite norm after a skipped window: read ``has_grad_norm``).
    has_grad_norm: bool, whether ``grad_norm`` is the last closed window's (finite) norm.
    noise_scale: float, ``B_simple = noise_trace / noise_signal``, the gradient noise scale
      (McCandlish et al. 2018) in ``weight`` units: the critical batch size's simple estimate.
      0 until a window with two nonzero-weight microbatches closes, while ``noise_signal <= 0``
      and without ``accumulate(..., observe=(optax_accum.noise_scale(...),))``.
      docs/noise_scale.md.
    noise_trace: float, bias-corrected EMA of ``S_est`` ~ ``tr(Sigma)`` (per-example gradient
      covariance; squared gradient units times ``weight`` units). 0 as ``noise_scale``.
    noise_signal: float, bias-corrected EMA of ``G2_est`` ~ ``|G|^2``. 0 as ``noise_scale``.
    weight_seen: with a token budget, a ``WeightCount`` (three 0-d arrays), the exact
      weight of every window closed since init (where a data loader resumes). ``float()`` /
      ``int()`` read it exactly outside ``jit``, ``.approx()`` under it. None without a budget.
    window_weight: with a token budget, a ``WeightCount``, the weight of the last closed
      non-empty window (the last update's effective batch); None without one.
    window_budget: with ``every_k=optax_accum.adaptive_window(...)``, float, the open window's
      budget (weight units), which follows the noise scale; None without one.
    observers: per observer of ``observe=``, its sub-state's ``metrics()`` dict (or the
      sub-state itself where it has no such method), a tuple.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), every_k=2)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for loss, n in ((1.0, 3), (3.0, 1)):  # one window: losses 1 and 3, weights 3 and 1
    ...   _, state = tx.update({'w': jnp.ones(2)}, state, params, weight=n, value=loss)
    >>> m = optax_accum.metrics(state)
    >>> bool(m.updated), int(m.num_updates), int(m.mini_step), int(m.num_microbatches)
    (True, 1, 0, 2)
    >>> float(m.window_loss), round(float(m.grad_norm), 4)  # (3*1 + 1*3) / 4; |(1, 1)|
    (1.5, 1.4142)
    >>> bool(m.has_window_loss), bool(m.has_grad_norm)
    (True, True)
    >>> m.weight_seen is None  # counted with a token budget (every_k=token_budget(...))
    True
  """

  mini_step: jax.Array
  num_microbatches: jax.Array
  num_updates: jax.Array
  num_skipped: jax.Array
  num_spikes: jax.Array
  num_dropped: jax.Array
  pending_weight: jax.Array
  updated: jax.Array
  window_loss: jax.Array
  loss_scale: jax.Array
  grad_norm: jax.Array
  has_window_loss: jax.Array
  has_grad_norm: jax.Array
  noise_scale: jax.Array
  noise_trace: jax.Array
  noise_signal: jax.Array
  weight_seen: Any  # a WeightCount, or None without a token budget
  window_weight: Any  # a WeightCount, or None without a token budget
  window_budget: Any  # a float array, or None without an adaptive window
  observers: tuple[Any, ...]


def metrics(opt_state: PyTree) -> Metrics:
  """Accumulation metrics from any optimizer state that contains one ``accumulate``.

  Args:
    opt_state: the state of :func:`optax_accum.accumulate`, of a wrapper containing it, or
      Flax's ``nnx.Optimizer.opt_state``.

  Returns:
    A ``Metrics`` of 0-d arrays (works under ``jit``).

  Raises:
    ValueError: if ``opt_state`` holds no or several accumulation states.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax.chain(optax.clip(1.0), optax_accum.accumulate(optax.adam(1e-3), every_k=4))
    >>> params = {'w': jnp.zeros(3)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({'w': jnp.ones(3)}, state, params, weight=7)
    >>> m = optax_accum.metrics(state)
    >>> int(m.mini_step), int(m.num_updates), float(m.pending_weight)
    (1, 0, 7.0)
  """
  s = find_state(opt_state)
  shown: dict[str, Any] = {}
  for read in _shown(s.sub_states).values():
    shown.update(read)
  zero_f, zero_i = jnp.zeros_like(s.grad_norm), jnp.zeros_like(s.num_skipped)
  return Metrics(
    mini_step=s.mini_step,
    num_microbatches=s.num_microbatches,
    num_updates=s.num_updates,
    num_skipped=s.num_skipped,
    num_spikes=_metric(s.guard, "num_spikes", zero_i),
    num_dropped=_metric(s.guard, "num_dropped", zero_i),
    pending_weight=s.window.weight_sum,
    updated=s.updated,
    window_loss=s.window_loss,
    loss_scale=_loss_scale_of(s),
    grad_norm=s.grad_norm,
    has_window_loss=s.has_window_loss,
    has_grad_norm=s.has_grad_norm,
    noise_scale=shown.get("noise_scale", zero_f),
    noise_trace=shown.get("noise_trace", zero_f),
    noise_signal=shown.get("noise_signal", zero_f),
    weight_seen=_metric(s.policy, "weight_seen", None),
    window_weight=_metric(s.policy, "window_weight", None),
    window_budget=_metric(s.policy, "window_budget", None),
    observers=tuple(_read(o) for o in s.observers),
  )


def check_names(config: Any) -> None:
  """Raises unless each metric name is shown by one feature (``metrics()`` reads them flat).

  Args:
    config: ``accumulate``'s configuration (``_step.Config``): its features' fresh sub-states
      (``config.sub_states``) are traced, not run.

  Raises:
    ValueError: naming the metric and the two arguments whose features show it (an adaptive
      window estimates the noise scale itself; ``observe=(noise_scale(),)`` beside it would
      show a second ``noise_scale``, and ``Metrics.noise_scale`` could hold only one of them).
  """
  shown = jax.eval_shape(lambda: _shown(config.sub_states(None)))
  shown_by: dict[str, str] = {}
  for where, read in shown.items():
    for name in read:
      if name in shown_by:
        raise ValueError(
          f"{shown_by[name]} and {where} both show the metric {name!r}, and "
          f"optax_accum.metrics() has one {name} field. Keep one of them (an "
          "every_k=adaptive_window(...) already estimates the noise scale: drop a "
          "noise_scale() observer beside it; observe one noise_scale)."
        )
      shown_by[name] = where


def _shown(sub_states: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """Each flat-shown sub-state's ``metrics()`` dict, by the argument that configured it
  (sub-states without one are left out)."""
  reads = {w: _read(sub) for w, sub in shown_by_argument(sub_states).items()}
  return {w: read for w, read in reads.items() if isinstance(read, dict)}


def _read(sub: Any) -> Any:
  """A sub-state's ``metrics()`` dict, or the sub-state where it defines none."""
  return sub.metrics() if callable(getattr(sub, "metrics", None)) else sub


def _metric(sub: Any, name: str, default: Any) -> Any:
  """The value ``name`` of a sub-state's ``metrics()``, or ``default``."""
  read = _read(sub)
  return read.get(name, default) if isinstance(read, dict) else default


def _loss_scale_of(s) -> jax.Array:
  if isinstance(s.loss_scale, optax.EmptyState):
    return jnp.ones((), jnp.float32)
  return s.loss_scale.scale
