"""Pre-flight checks that accumulation reproduces one physical batch, and HLO collective counts.

Run :func:`check_equivalence` before a long run (``check_equivalence(...).assert_passed()`` in
tests): it says PASS or FAIL and why, fits the weights the loss itself gives each microbatch and
names the ``weight`` that reproduces the batch; it catches a loss that is not a mean, a wrong
``weight``, BatchNorm and losses over the whole batch (in-batch negatives). Flax is imported only
when needed.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum._accumulate import accumulate
from optax_accum._collectives import count_collectives
from optax_accum._metrics import metrics
from optax_accum._microbatch import microbatched_value_and_grad, split_batch
from optax_accum.pitfalls import PitfallWarning

__all__ = [
  "Difference",
  "EquivalenceReport",
  "Weighting",
  "check_equivalence",
  "count_collectives",
]

PyTree = Any

# The default tolerances of EquivalenceReport.passed() (float32 rounding only); the inner
# update's per-element allowance is computed at check time from the gradient's at these.
_RTOL, _ATOL = 1e-5, 1e-6
# Where the page that explains losses over the whole batch lives (FAIL messages point to it).
_WHOLE_BATCH_DOCS = "docs/in_step.md, 'Losses over the whole batch'"


class Difference(NamedTuple):
  """How far one quantity is from its physical-batch reference.

  Attributes:
    max_abs: ``max |x - ref|`` over all leaves and elements.
    max_rel: ``max_abs / scale`` (0 when both are 0).
    scale: ``max |ref|``, the reference's largest magnitude.
    beyond_allowance: for the inner-update rows, ``max_i (|x_i - ref_i| - allowance_i)``: the
      largest difference beyond what the gradient's tolerance allows each element (see
      :func:`check_equivalence`); ``None`` for the other rows (no allowance).

  Examples:
    >>> from optax_accum.testing import Difference
    >>> d = Difference(max_abs=0.5, max_rel=0.125, scale=4.0)
    >>> d.ok(rtol=0.125, atol=0.0), d.ok(rtol=0.0, atol=0.25)  # 0.5 <= 0.125 * 4; 0.5 > 0.25
    (True, False)
    >>> d._replace(beyond_allowance=0.0).ok(rtol=0.0, atol=0.0)  # within its allowance
    True
  """

  max_abs: float
  max_rel: float
  scale: float
  beyond_allowance: float | None = None

  def ok(self, rtol: float, atol: float) -> bool:
    """``max_abs <= atol + rtol * scale`` (``numpy.allclose`` with one global scale), a bool;
    ``beyond_allowance`` in place of ``max_abs`` where there is an allowance."""
    excess = self.max_abs if self.beyond_allowance is None else self.beyond_allowance
    return bool(excess <= atol + rtol * self.scale)


class Weighting(NamedTuple):
  """A count per microbatch found in the batch, and how well it reproduces the batch's gradient.

  Attributes:
    name: ``'rows'`` (the leading dimension) or the key path of a mask-like leaf (bool, or
      values 0 and 1 only), e.g. ``"['mask']"``.
    counts: the count of each microbatch (its rows, or the sum of that leaf).
    residual: ``|g_batch - sum_k c_k g_k / sum_k c_k| / |g_batch|`` (Euclidean norms over all
      parameters): 0 up to rounding when the loss averages over exactly these counts.
    leaf: the key path, in the batch, of the leaf counted: for ``'rows'`` the leaf whose leading
      dimension was read (the batch's first leaf, e.g. ``"['inputs']"``; ``''`` when the batch
      is one array), for a mask its own path (``name``).

  Examples:
    >>> from optax_accum.testing import Weighting
    >>> Weighting("rows", (4.0, 4.0), 0.0, leaf="['inputs']").fix()
    "weight=batch['inputs'].shape[0] (the microbatch's rows)"
    >>> Weighting("['loss_masks']", (3.0, 7.0), 0.0, leaf="['loss_masks']").fix()
    "weight=batch['loss_masks'].sum()"
  """

  name: str
  counts: tuple[float, ...]
  residual: float
  leaf: str = ""

  def describe(self) -> str:
    """``'rows (4 each)'`` or ``"unmasked ['mask'] (4, 8, 16, 24)"``."""
    label = "rows" if self.name == "rows" else f"unmasked {self.name}"
    return f"{label} ({_numbers(self.counts)})"

  def fix(self) -> str:
    """The ``weight=`` a training step passes for this count, named by the batch's own leaf
    (``batch`` is the microbatch the step gets)."""
    if self.name == "rows":
      return f"weight=batch{self.leaf}.shape[0] (the microbatch's rows)"
    return f"weight=batch{self.leaf or self.name}.sum()"


def _numbers(xs: tuple[float, ...]) -> str:
  if len(xs) > 1 and all(x == xs[0] for x in xs):
    return f"{xs[0]:.4g} each"
  return ", ".join(f"{x:.4g}" for x in xs)


class EquivalenceReport(NamedTuple):
  """One accumulated window against one physical batch (see :func:`check_equivalence`).

  ``print(report)`` shows the verdict (PASS or FAIL and why), the weights, and a table;
  :meth:`passed` agrees with the verdict; :meth:`assert_passed` raises with the table.

  Attributes:
    loss: in-step weighted-mean loss vs the batch's loss.
    grad_in_step: in-step gradient vs ``jax.grad`` on the whole batch.
    sgd_across_step: the ``optax.sgd(1.0)`` step of the window mean ``accumulate(inner, K)``
      hands its inner optimizer (minus that mean) vs ``optax.sgd(1.0)``'s on the batch.
    update_in_step: ``inner``'s update from the in-step gradient vs from the batch's, with a
      per-element allowance (see :func:`check_equivalence`).
    update_across_step: ``accumulate(inner, K)``'s window update vs ``inner``'s on the batch,
      with the same allowance.
    mean_of_means: the equal-weights gradient (mean of microbatch means) vs the batch's: shown,
      not checked.
    num_updates: updates ``accumulate`` applied in the window (should be 1).
    weights: the weight of each microbatch, as ``weight_fn`` gave it.
    batch_dependent_layers: paths of detected BatchNorm layers or collections.
    loss_weights: the weights the loss itself gives the microbatches, relative (summing to 1):
      the least-squares fit of ``g_batch = sum_k a_k g_k`` over all parameters, ``a / sum(a)``;
      ``None`` when no weighting reproduces the batch (``loss_weights_residual`` above
      ``fit_tolerance``: BatchNorm, in-batch negatives) or the batch's gradient is 0.
    loss_weights_residual: ``|g_batch - sum_k a_k g_k| / |g_batch|`` of that fit.
    loss_weights_sum: ``sum(a)``: 1 for a loss that is a mean over the batch, ``K`` for one
      that adds the microbatches' losses up (a sum).
    weights_residual: the residual of ``weights`` (normalized), as for ``loss_weights``.
    weightings: the counts the batch offers (rows, each mask-like leaf's sums), each with its
      residual, as :class:`Weighting`.
    fit_tolerance: the largest residual that counts as rounding: ``1000 * eps`` of the
      gradient's dtype (1.2e-4 for float32), at most 0.01.

  Examples:
    >>> from optax_accum.testing import Difference, EquivalenceReport
    >>> ok, off = Difference(0.0, 0.0, 1.0), Difference(1e-3, 1e-3, 1.0)
    >>> report = EquivalenceReport(ok, ok, ok, ok, ok, mean_of_means=off, num_updates=1,
    ...                            weights=(3.0, 1.0), batch_dependent_layers=())
    >>> report.passed()  # mean_of_means is shown, not checked
    True
    >>> bad = report._replace(sgd_across_step=off)
    >>> bad.passed(), bad.passed(rtol=1e-2), report._replace(num_updates=0).passed()
    (False, True, False)
    >>> print(bad.verdict())  # the reason with the number
    FAIL: the accumulated gradient differs from the batch's by 0.001 of its largest element
    (tolerance 1e-05)
  """

  loss: Difference
  grad_in_step: Difference
  sgd_across_step: Difference
  update_in_step: Difference
  update_across_step: Difference
  mean_of_means: Difference
  num_updates: int
  weights: tuple[float, ...]
  batch_dependent_layers: tuple[str, ...]
  loss_weights: tuple[float, ...] | None = None
  loss_weights_residual: float = 0.0
  loss_weights_sum: float = 1.0
  weights_residual: float = 0.0
  weightings: tuple[Weighting, ...] = ()
  fit_tolerance: float = 1e-4

  def passed(self, rtol: float = _RTOL, atol: float = _ATOL) -> bool:
    """Whether every checked row is within :meth:`Difference.ok` and one update was applied.

    The checked rows: the loss, the gradient, the ``sgd(1)`` step and the inner updates (each
    element of these within its allowance); not ``mean_of_means``. The default tolerances allow
    float32 rounding only. The same answer as :meth:`verdict` gives.

    Returns:
      A bool.
    """
    return self.num_updates == 1 and all(d.ok(rtol, atol) for _, d, _ in self._checked())

  def assert_passed(self, rtol: float = _RTOL, atol: float = _ATOL) -> None:
    """Raises unless :meth:`passed`, with the verdict and the table.

    Args:
      rtol: relative tolerance, against each reference's largest magnitude.
      atol: absolute tolerance. The float32 defaults allow rounding only.

    Raises:
      AssertionError: with the verdict and the table, if the check fails.

    Examples:
      >>> import optax
      >>> from optax_accum import testing
      >>> def loss_fn(w, batch):  # masked mean of 0.5 * (w - y)**2 over the real rows
      ...   m = batch['mask']
      ...   return (0.5 * (w - batch['y']) ** 2 * m).sum() / jnp.maximum(m.sum(), 1.0)
      >>> batch = {'y': jnp.arange(8.0), 'mask': jnp.array([1., 1, 1, 0, 1, 0, 0, 1])}
      >>> report = testing.check_equivalence(  # weights 2, 1, 1, 1 per microbatch
      ...     loss_fn, jnp.asarray(0.5), batch, optax.sgd(0.1), num_microbatches=4)
      >>> report.assert_passed()
      Traceback (most recent call last):
      ...
      AssertionError: ... FAIL: wrong weights: the loss weighs microbatches by unmasked
      ['mask'] (2, 1, 1, 1); you passed rows (2 each): use weight=batch['mask'].sum()
      ...
    """
    if not self.passed(rtol, atol):
      raise AssertionError(
        f"Accumulation does not reproduce one physical batch (rtol={rtol}, atol={atol}):\n"
        + self._render(rtol, atol)
      )

  def _checked(self) -> list[tuple[str, Difference, bool]]:
    """(label, row, has an allowance) of the rows :meth:`passed` checks, in table order."""
    return [
      ("loss, in-step", self.loss, False),
      ("gradient, in-step", self.grad_in_step, False),
      ("sgd(1) step, across-step", self.sgd_across_step, False),
      ("inner update, in-step", self.update_in_step, True),
      ("inner update, across-step", self.update_across_step, True),
    ]

  def _passed_weighting(self) -> Weighting | None:
    """The batch's count that ``weights`` are proportional to, if any."""
    w = np.asarray(self.weights, np.float64)
    for c in self.weightings:
      counts = np.asarray(c.counts, np.float64)
      if w.sum() > 0 and counts.sum() > 0:
        if np.allclose(w / w.sum(), counts / counts.sum(), rtol=1e-6, atol=1e-9):
          return c
    return None

  def _passed_text(self) -> str:
    named = self._passed_weighting()
    if named is not None and np.allclose(self.weights, named.counts):
      return named.describe()
    text = f"({_numbers(self.weights)})"
    return f"{text}, proportional to {named.describe()}" if named is not None else text

  def _loss_weighting(self) -> Weighting | None:
    """The first of the batch's counts that reproduces the batch (residual within tolerance)."""
    return next((c for c in self.weightings if c.residual <= self.fit_tolerance), None)

  def verdict(self, rtol: float = _RTOL, atol: float = _ATOL) -> str:
    """One line: ``'PASS: ...'`` or ``'FAIL: ...'`` and why, as :meth:`passed` decides.

    A failure names its most likely cause: no update applied; no weighting reproduces the batch
    (the loss is not a weighted mean of microbatch losses: BatchNorm, in-batch negatives);
    a loss that sums instead of averaging; a wrong ``weight`` (and the right one, recognized
    among rows and the batch's mask-like leaves when it is one of them); else which row is off.

    Returns:
      A str.
    """
    grad = max(self.grad_in_step.max_rel, self.sgd_across_step.max_rel)
    if self.passed(rtol, atol):
      return (
        f"PASS: the accumulated window equals one physical batch to float32 rounding "
        f"(gradient {grad:.2g} of its largest element; tolerance {rtol:g})"
      )
    if self.num_updates != 1:
      return (
        f"FAIL: accumulate applied {self.num_updates} updates in one window of "
        f"{len(self.weights)} microbatches (1 expected)"
      )
    grads_ok = self.grad_in_step.ok(rtol, atol) and self.sgd_across_step.ok(rtol, atol)
    if not grads_ok and self.loss_weights is None and self.loss_weights_residual > 0:
      layers = self.batch_dependent_layers
      cause = (
        f"batch-dependent layers ({', '.join(layers)}: BatchNorm in train mode)"
        if layers
        else "e.g. in-batch negatives, or statistics over the batch"
      )
      return (
        f"FAIL: no weighting of the microbatches reproduces the batch (fit residual "
        f"{self.loss_weights_residual:.2g} of |g_batch|): the loss is not a weighted mean of "
        f"microbatch losses ({cause}); see {_WHOLE_BATCH_DOCS}"
      )
    if not grads_ok and self.loss_weights is not None:
      total = self.loss_weights_sum
      if self.weights_residual > self.fit_tolerance:
        target = self._loss_weighting()
        if target is not None:
          return (
            f"FAIL: wrong weights: the loss weighs microbatches by {target.describe()}; "
            f"you passed {self._passed_text()}: use {target.fix()}"
          )
        implied = ", ".join(f"{a:.3g}" for a in self.loss_weights)
        if abs(total - 1) <= 1e-2:
          return (
            f"FAIL: wrong weights: the loss weighs microbatches as ({implied}) of the window; "
            f"you passed {self._passed_text()}: pass weights in those proportions"
          )
      if abs(total - 1) > 1e-2:
        return (
          f"FAIL: the batch's gradient is {total:.3g}x the weighted mean of the microbatches' "
          f"gradients: the loss adds up rather than averages (a sum over the batch, or a mean "
          f"over a fixed count). Make it a mean over what it sums (and pass that count as "
          f"weight), or keep the sum and accumulate with denominator=1"
        )
    if not grads_ok:
      return (
        f"FAIL: the accumulated gradient differs from the batch's by {grad:.2g} of its largest "
        f"element (tolerance {rtol:g})"
      )
    for label, d, _ in self._checked():
      if not d.ok(rtol, atol):
        if label.startswith("inner update"):
          return (
            f"FAIL: the gradients agree but the {label} differs by more than a gradient within "
            f"its tolerance moves it ({d.beyond_allowance:.2g} beyond): the inner optimizer "
            "sees something else (its state, params or extra args)"
          )
        return f"FAIL: the {label} differs from the batch's by {d.max_rel:.2g} (tolerance {rtol:g})"
    raise AssertionError("unreachable: a failed check names its row")  # pragma: no cover

  def _weights_line(self) -> str:
    head = f"weights: you passed {self._passed_text()}"
    if self.loss_weights is None:
      if self.loss_weights_residual == 0:
        return f"{head}; the batch's gradient is 0: no weights to fit"
      return (
        f"{head}; no weighting reproduces the batch (fit residual "
        f"{self.loss_weights_residual:.2g}, tolerance {self.fit_tolerance:.2g})"
      )
    implied = ", ".join(f"{a:.3g}" for a in self.loss_weights)
    fit = f"fit residual {self.loss_weights_residual:.2g}"
    total = self.loss_weights_sum
    scale = f", times {total:.3g} (a sum, not a mean)" if abs(total - 1) > 1e-2 else ""
    if self.weights_residual <= self.fit_tolerance:
      return f"{head}; the loss implies the same: ({implied}) of the window ({fit})"
    target = self._loss_weighting()
    named = f" = {target.describe()}" if target is not None else ""
    return f"{head}; the loss implies ({implied}) of the window{named}{scale} ({fit})"

  def _render(self, rtol: float, atol: float) -> str:
    k = len(self.weights)
    lines = [
      f"optax_accum pre-flight: one window of {k} microbatches vs one physical batch",
      self.verdict(rtol, atol),
      self._weights_line(),
    ]
    if self.batch_dependent_layers:
      layers = ", ".join(self.batch_dependent_layers)
      lines.append(f"batch-dependent layers (BatchNorm in train mode): {layers}")
    lines.append(f"{'vs one physical batch':<34}{'max abs':>11}{'max rel':>11}{'tolerance':>13}")
    for label, d, allowance in self._checked():
      result = "ok" if d.ok(rtol, atol) else "FAIL"
      tol = f"{atol + rtol * d.scale:>13.3g}" if not allowance else f"{'elementwise*':>13}"
      lines.append(f"{label:<34}{d.max_abs:>11.3g}{d.max_rel:>11.3g}{tol}  {result}")
    lines.append(self._mean_of_means_line(rtol, atol))
    lines.append(f"updates applied: {self.num_updates} (1 expected)")
    lines.append(
      "* plus, per element, how far the inner update moves when the gradient moves by its\n"
      "  tolerance (Adam's first step g / (|g| + eps) is steep where |g| is near eps). Over a\n"
      "  run the two paths round differently at every update and the runs can drift apart,\n"
      "  more with 16-bit compute; optax.MultiSteps' run drifts as far (docs/porting.md,\n"
      "  'Comparing with the physical run')"
    )
    return "\n".join(lines)

  def _mean_of_means_line(self, rtol: float, atol: float) -> str:
    """The mean-of-means row: how far equal weights would be off, or that this batch cannot
    tell them from the right ones."""
    m, k = self.mean_of_means, len(self.weights)
    if k == 1:  # nothing to weigh: the mean of one mean is the window's
      return "mean of means: the same as the window (one microbatch, nothing to weigh)"
    tol_m = atol + rtol * m.scale
    if m.max_abs <= tol_m:
      return (
        "mean of means: within the tolerance too (equal weights are also exact for this batch,\n"
        "  so it cannot tell the mean of means from the right weights: check a batch whose\n"
        "  microbatches hold unequal counts)"
      )
    over = f"{m.max_abs / tol_m:,.0f}x the tolerance" if tol_m > 0 else "over a zero tolerance"
    return (
      f"{'mean of means would give (grad)':<34}{m.max_abs:>11.3g}{m.max_rel:>11.3g}"
      f"{tol_m:>13.3g}  not checked: {over}"
    )

  def __str__(self) -> str:
    return self._render(_RTOL, _ATOL)


def _batch_dependent_layers(model: Any) -> tuple[str, ...]:
  """Paths of batch-dependent layers in a Flax model or Linen variables.

  Args:
    model: an ``nnx.Module`` (finds ``nnx.BatchStat`` owners not in ``use_running_average``
      mode) or Linen variables (a ``'batch_stats'`` collection); anything else finds nothing.

  Returns:
    A tuple of paths, e.g. ``('bn',)``; ``()`` if none or for any other input (never raises).

  Examples:
    >>> from optax_accum.testing import _batch_dependent_layers
    >>> _batch_dependent_layers({'params': {}, 'batch_stats': {'BatchNorm_0': {}}})
    ('batch_stats/BatchNorm_0',)
  """
  if isinstance(model, Mapping) and "batch_stats" in model:
    stats = model["batch_stats"]
    keys = list(stats.keys()) if isinstance(stats, Mapping) else []
    return tuple(f"batch_stats/{k}" for k in keys) or ("batch_stats",)
  if "flax" not in sys.modules:
    return ()
  from flax import nnx

  if not isinstance(model, nnx.Module):
    return ()
  found = []
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Module) or getattr(node, "use_running_average", False):
      continue
    if any(isinstance(v, nnx.BatchStat) for v in vars(node).values()):
      found.append("/".join(str(p) for p in path) or type(node).__name__)
  return tuple(found)


def _warn_if_batch_dependent(params: Any, model: Any) -> tuple[str, ...]:
  """The batch-dependent layers of ``params`` and ``model``, with a warning if there are any."""
  layers = _batch_dependent_layers(params) + _batch_dependent_layers(model)
  if layers:
    warnings.warn(
      f"The model has batch-dependent layers ({', '.join(layers)}): BatchNorm in train mode "
      "normalizes each microbatch with its own statistics (and updates running averages "
      "once per microbatch), so gradient accumulation will NOT reproduce one physical batch "
      "for it. Use LayerNorm/GroupNorm/RMSNorm, or accept the difference this check reports.",
      PitfallWarning,
      stacklevel=3,
    )
  return layers


def _functional(loss_fn: Callable, params: Any) -> tuple[Callable, PyTree]:
  """``(f(params, batch), params)``; an ``nnx.Module`` is split into its ``nnx.Param`` state."""
  if "flax" in sys.modules:
    from flax import nnx

    if isinstance(params, nnx.Module):
      from optax_accum.flax._in_step import as_pure, merge_fresh

      graphdef, p, rest = nnx.split(params, nnx.Param, ...)
      return (lambda q, b: loss_fn(merge_fresh(graphdef, q, rest), b)), as_pure(p)
  return loss_fn, params


def _wide(x: jax.Array) -> jax.Array:
  """``x`` in the wider of its dtype and float32 (what the differences are computed in)."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _difference(x: PyTree, ref: PyTree, allowance: PyTree = None) -> jax.Array:
  """``[max |x - ref|, max |ref|, max (|x - ref| - allowance)]`` over all elements (traceable).

  Examples:
    >>> _difference({'a': jnp.array([1.0, 2.5])}, {'a': jnp.array([1.0, 2.0])}).tolist()
    [0.5, 2.0, 0.5]
  """
  xs, rs = jax.tree.leaves(x), jax.tree.leaves(ref)
  allows = jax.tree.leaves(allowance) if allowance is not None else [None] * len(rs)
  zero = jnp.zeros((), jnp.float32)
  max_abs, scale, beyond = zero, zero, zero
  finite = jnp.ones((), jnp.bool_)
  for a, r, allow in zip(xs, rs, allows, strict=True):
    diff = jnp.abs(_wide(a) - _wide(r)).astype(jnp.float32)
    # A NaN difference is counted, not left to max (XLA:CPU's large reduce-max drops NaN).
    finite = finite & jnp.all(jnp.isfinite(diff))
    max_abs = jnp.maximum(max_abs, jnp.max(diff, initial=0.0))
    scale = jnp.maximum(scale, jnp.max(jnp.abs(_wide(r)).astype(jnp.float32), initial=0.0))
    over = diff if allow is None else diff - _wide(allow).astype(jnp.float32)
    beyond = jnp.maximum(beyond, jnp.max(over, initial=0.0))
  out = jnp.stack([max_abs, scale, beyond])
  return jnp.where(finite, out, out.at[jnp.array([0, 2])].set(jnp.nan))


def _as_difference(stats: np.ndarray, allowance: bool = False) -> Difference:
  max_abs, scale, beyond = (float(v) for v in stats)
  rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
  return Difference(max_abs, rel, scale, beyond if allowance else None)


def _signs(x: jax.Array) -> jax.Array:
  """A fixed pseudo-random +-1 per element of ``x``'s shape (float32; a multiplicative hash of
  the element's index: elementwise integer arithmetic, cheaper than ``jax.random``)."""
  index = jnp.zeros(x.shape, jnp.uint32)
  for d in range(x.ndim):
    index = index * jnp.uint32(x.shape[d]) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d)
  hashed = (index + jnp.uint32(1)) * jnp.uint32(0x9E3779B1)
  return jnp.where(hashed >> 31 == 1, 1.0, -1.0).astype(jnp.float32)


def _allowance(inner, g_ref, inner_state, params, u_ref) -> PyTree:
  """Per element, how far ``inner``'s update moves when the gradient moves by its tolerance.

  The gradient's tolerance ``atol + rtol * max |g|`` (the defaults), added with a fixed
  pseudo-random sign per element and subtracted: the larger of the two changes of the update.
  Mixed signs keep a global norm (``clip_by_global_norm``) where rounding would leave it.
  """
  leaves = jax.tree.leaves(g_ref)
  scale = jnp.max(jnp.stack([jnp.max(jnp.abs(_wide(g)), initial=0.0) for g in leaves] + [0.0]))
  tol = _ATOL + _RTOL * scale
  shift = jax.tree.map(lambda g: (_signs(g) * tol).astype(g.dtype), g_ref)
  u_hi = inner.update(jax.tree.map(jnp.add, g_ref, shift), inner_state, params)[0]
  u_lo = inner.update(jax.tree.map(jnp.subtract, g_ref, shift), inner_state, params)[0]
  return jax.tree.map(
    lambda hi, lo, u: jnp.maximum(jnp.abs(_wide(hi) - _wide(u)), jnp.abs(_wide(lo) - _wide(u))),
    u_hi,
    u_lo,
    u_ref,
  )


def _keeping_its_gradient(inner) -> optax.GradientTransformationExtraArgs:
  """``inner``, its state paired with the last gradient it was given (zeros like the params
  until then): under ``accumulate``, the window mean of the last applied window."""
  inner = optax.with_extra_args_support(inner)

  def update(updates, state, params=None, **extra):  # `updates`: the gradient, optax's name
    new_updates, inner_state = inner.update(updates, state[0], params, **extra)
    return new_updates, (inner_state, updates)

  return optax.GradientTransformationExtraArgs(
    lambda params: (inner.init(params), optax.tree.zeros_like(params)), update
  )


def _gram(grads: PyTree, g_ref: PyTree, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``G G^T`` (``[K, K]``), ``G g_ref`` (``[K]``) and ``|g_ref|^2`` of the stacked gradients.

  Products and sums of elements, in float32 (or wider): no matmul (TPUs multiply float32 in
  bfloat16 passes by default) and no reshape (a leaf sharded with explicit axes keeps its
  sharding); XLA fuses each product into its reduction.
  """
  gram, proj, ref_sq = jnp.zeros((k, k)), jnp.zeros((k,)), jnp.zeros(())
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref), strict=True):
    g, r = _wide(g), _wide(r)
    rest = tuple(range(1, g.ndim))
    gram = gram + jnp.sum(g[:, None] * g[None], axis=tuple(a + 1 for a in rest)).astype(gram.dtype)
    proj = proj + jnp.sum(g * r[None], axis=rest).astype(proj.dtype)
    ref_sq = ref_sq + jnp.sum(jnp.square(r)).astype(ref_sq.dtype)
  return gram, proj, ref_sq


@jax.jit
def _residuals(grads: PyTree, g_ref: PyTree, weights: jax.Array) -> jax.Array:
  """``|g_ref - sum_k W[m, k] g_k|`` for each row ``m`` of ``weights`` (``[M, K]``, a few rows):
  one fused reduction per row and leaf, no gradient-sized temporary."""
  sq = jnp.zeros(weights.shape[:1])
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref), strict=True):
    g, r = _wide(g), _wide(r)
    w = weights.astype(g.dtype)
    rows = []
    for m in range(w.shape[0]):
      fit = sum(w[m, k] * g[k] for k in range(w.shape[1]))
      rows.append(jnp.sum(jnp.square(r - fit)))
    sq = sq + jnp.stack(rows).astype(sq.dtype)
  return jnp.sqrt(sq)


def _solve(gram: np.ndarray, proj: np.ndarray) -> tuple[np.ndarray, int]:
  """The least-squares ``a`` of ``g_ref = sum_k a_k g_k`` from the normal equations, in float64,
  and the rank it found.

  The Gram matrix is scaled to unit diagonal first; directions below 1e-6 of its largest
  singular value (float32 Gram entries) and microbatches with a zero gradient get weight 0.

  Examples:
    >>> a, rank = _solve(np.array([[1.0, 0.0], [0.0, 4.0]]), np.array([0.5, 2.0]))
    >>> a.tolist(), rank
    ([0.5, 0.5], 2)
  """
  gram, proj = np.asarray(gram, np.float64), np.asarray(proj, np.float64)
  d = np.sqrt(np.maximum(np.diag(gram), 0.0))
  d = np.where(d > 0, d, 1.0)
  a, _, rank, _ = np.linalg.lstsq(gram / np.outer(d, d), proj / d, rcond=1e-6)
  return a / d, int(rank)


def _fit_tolerance(grads: PyTree) -> float:
  """``1000 * eps`` of the gradient's widest-eps dtype, at most 0.01 (1.2e-4 for float32)."""
  eps = max((float(jnp.finfo(g.dtype).eps) for g in jax.tree.leaves(grads)), default=1e-7)
  return min(1e3 * eps, 1e-2)


def _countable(batch: PyTree) -> list[tuple[int, str]]:
  """(leaf index, key path) of the batch's leaves that may be masks: numeric or bool, not 0-d."""
  found = []
  for i, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(batch)[0]):
    dtype = jnp.result_type(x)
    if np.ndim(x) >= 1 and (jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_):
      found.append((i, jax.tree_util.keystr(path)))
  return found


def _mask_sums(micro: PyTree, leaves: list[int], k: int) -> tuple[jax.Array, jax.Array]:
  """Per-microbatch sums ``[L, K]`` of the given leaves, and whether each holds only 0 and 1."""
  xs = jax.tree.leaves(micro)
  sums, flags = [jnp.zeros((0, k))], [jnp.zeros((0,), bool)]
  for i in leaves:
    x, rest = xs[i], tuple(range(1, xs[i].ndim))
    sums.append(jnp.sum(x.astype(jnp.float32), axis=rest)[None])
    flags.append(jnp.all((x == 0) | (x == 1))[None])
  return jnp.concatenate(sums), jnp.concatenate(flags)


def check_equivalence(
  loss_fn: Callable[[Any, PyTree], jax.Array],
  params: Any,
  batch: PyTree,
  inner: optax.GradientTransformation,
  *,
  num_microbatches: int,
  weight_fn: Callable[[PyTree], Any] | None = None,
  model: Any = None,
  strided: bool = True,
  has_aux: bool = False,
) -> EquivalenceReport:
  """Runs one accumulated window both ways and one physical batch, compares them, fits weights.

  One ``jax.jit`` run: the physical batch, in-step :func:`optax_accum.microbatched_value_and_grad`
  and across-step :func:`optax_accum.accumulate` on ``num_microbatches`` slices, weighted by
  ``weight_fn``. ``optax.sgd(1.0)`` is compared too (Adam's first step hides a wrong divisor).
  Keep dropout off (masks differ between paths).

  The weights the loss implies: with ``g_k`` each microbatch's gradient and ``g_batch`` the
  batch's, the least-squares ``a`` of ``g_batch = sum_k a_k g_k`` over all parameter elements
  (the ``K x K`` normal equations, their Gram matrix computed on the device and solved in
  float64 on the host, then one pass for the residuals). A loss that is a weighted mean of
  microbatch losses has a residual at rounding, and ``a`` is proportional to the counts its
  means are over; the report names them (rows, or a mask-like leaf's sum) and the ``weight``
  to pass. No weighting reproduces BatchNorm or in-batch negatives: ``loss_weights`` is None.

  The inner-update rows allow each element the change of ``inner``'s update when the gradient
  moves by its own tolerance (``1e-6 + 1e-5 * max |g|``, with random signs, both ways): Adam's
  first step ``g / (|g| + eps)`` turns float32 rounding of a gradient near ``eps`` into a
  visible step, which is not an accumulation error. A wrong weight fails the gradient rows.

  Args:
    loss_fn: ``loss_fn(params, batch)`` -> the MEAN loss over examples / unmasked tokens (scalar).
    params: a tree of arrays, or an ``nnx.Module`` (its ``nnx.Param`` state is differentiated,
      the rest held fixed; it is also checked as ``model``).
    batch: a pytree with a leading batch axis divisible by ``num_microbatches``.
    inner: the optimizer to compare (e.g. ``optax.adamw(3e-4)``).
    num_microbatches: ``K``, microbatches per window.
    weight_fn: ``weight_fn(microbatch)`` -> its weight (default: rows), e.g.
      ``lambda mb: mb['mask'].sum()`` for token-mean losses.
    model: an ``nnx.Module`` or Linen variables dict to scan for BatchNorm.
    strided: how the batch is split: microbatch ``k`` takes rows ``k, k+K, ...``; ``False``:
      contiguous (as in :func:`optax_accum.microbatched_value_and_grad`).
    has_aux: ``loss_fn`` returns ``(loss, aux)``, as in ``jax.value_and_grad``; aux is unused.

  Returns:
    An ``EquivalenceReport``; ``print(report)`` shows the verdict and a table.

  Raises:
    ValueError: if the batch cannot be split into ``num_microbatches``.

  Warns:
    PitfallWarning: if ``model`` or ``params`` has BatchNorm or ``batch_stats``.

  Examples:
    >>> import optax
    >>> from optax_accum import testing
    >>> def loss_fn(w, batch):  # mean of 0.5 * (x @ w - y)**2 over the rows
    ...   return jnp.mean(0.5 * (batch['x'] @ w - batch['y']) ** 2)
    >>> batch = {'x': jnp.arange(16.0).reshape(8, 2) / 8, 'y': jnp.arange(8.0)}
    >>> report = testing.check_equivalence(
    ...     loss_fn, jnp.zeros(2), batch, optax.adam(1e-3), num_microbatches=4)
    >>> report.passed(), report.num_updates, report.loss_weights  # rows: 2 of 8 each
    (True, 1, (0.25, 0.25, 0.25, 0.25))
    >>> print(report.verdict())
    PASS: the accumulated window equals one physical batch to float32 rounding (gradient ...
    of its largest element; tolerance 1e-05)
  """
  layers = _warn_if_batch_dependent(params, model)
  f, p = _functional((lambda *a: loss_fn(*a)[0]) if has_aux else loss_fn, params)
  k = num_microbatches
  weigh = weight_fn if weight_fn is not None else (lambda mb: jax.tree.leaves(mb)[0].shape[0])

  acc_inner = accumulate(_keeping_its_gradient(inner), k)

  @jax.jit
  def run(params, batch):
    loss_ref, g_ref = jax.value_and_grad(f)(params, batch)
    mvg = microbatched_value_and_grad(f, k, weight_fn=weight_fn, strided=strided)
    loss_in, g_in = mvg(params, batch)
    inner_state = inner.init(params)
    u_ref = inner.update(g_ref, inner_state, params)[0]
    allowance = _allowance(inner, g_ref, inner_state, params, u_ref)

    def microstep(carry, mb):
      s_inner, sum_inner = carry
      g, w = jax.grad(f)(params, mb), weigh(mb)
      v, s_inner = acc_inner.update(g, s_inner, params, weight=w)
      return (s_inner, optax.tree.add(sum_inner, v)), (g, jnp.asarray(w, jnp.float32))

    carry = (acc_inner.init(params), optax.tree.zeros_like(params))
    micro = split_batch(batch, k, strided=strided)
    (s_inner, sum_inner), (grads, weights) = jax.lax.scan(microstep, carry, micro)
    # optax.sgd(1.0)'s step is minus its gradient, exactly: here the window mean inner got.
    sgd_step = jax.tree.map(jnp.negative, s_inner.inner_state[1])
    stats = {  # max abs, scale, beyond the allowance: per row of the report
      "loss": _difference(loss_in, loss_ref),
      "grad_in_step": _difference(g_in, g_ref),
      "sgd_across_step": _difference(sgd_step, jax.tree.map(jnp.negative, g_ref)),
      "update_in_step": _difference(inner.update(g_in, inner_state, params)[0], u_ref, allowance),
      "update_across_step": _difference(sum_inner, u_ref, allowance),
      "mean_of_means": _difference(jax.tree.map(lambda g: jnp.mean(g, axis=0), grads), g_ref),
    }
    sums = _mask_sums(micro, [i for i, _ in countable], k)
    host = (stats, metrics(s_inner).num_updates, weights, _gram(grads, g_ref, k), sums)
    return host, (grads, g_ref)

  countable = _countable(batch)
  host, (grads, g_ref) = run(p, batch)
  stats, num_updates, weights, (gram, proj, ref_sq), (mask_sums, mask_flags) = jax.device_get(host)
  (first_path, first), *_ = jax.tree_util.tree_flatten_with_path(batch)[0]
  rows, rows_leaf = float(np.shape(first)[0] // k), jax.tree_util.keystr(first_path)
  candidates = [("rows", np.full(k, rows))]
  candidates += [
    (name, s) for (_, name), s, m in zip(countable, mask_sums, mask_flags, strict=True) if m
  ]

  # The fit, then one pass for the residuals of the fit, the weights used and each count.
  a, rank = _solve(gram, proj)
  weights = np.asarray(weights, np.float64)
  unit = lambda w: w / w.sum() if w.sum() != 0 else w
  rows_w = np.stack([a, unit(weights)] + [unit(np.asarray(c, np.float64)) for _, c in candidates])
  norm = float(np.sqrt(ref_sq))
  distinct, which = np.unique(rows_w.astype(np.float32), axis=0, return_inverse=True)
  res = np.asarray(jax.device_get(_residuals(grads, g_ref, jnp.asarray(distinct))))
  res = res[np.reshape(which, -1)]  # one pass per distinct weighting
  rel = (res / norm) if norm > 0 else np.where(res > 0, np.inf, 0.0)
  tol = _fit_tolerance(g_ref)
  fitted = rel[0] <= tol and a.sum() != 0 and norm > 0
  named = [unit(c) for (_, c), r in zip(candidates, rel[2:], strict=True) if r <= tol]
  if fitted and rank < k and named:  # not unique (fewer parameters than microbatches, or a
    a = named[0]  # zero gradient): the batch's count that reproduces it (a mean: sum 1)
  return EquivalenceReport(
    **{name: _as_difference(s, allowance=name.startswith("update")) for name, s in stats.items()},
    num_updates=int(num_updates),
    weights=tuple(float(w) for w in weights),
    batch_dependent_layers=layers,
    loss_weights=tuple(float(x) for x in a / a.sum()) if fitted else None,
    loss_weights_residual=float(rel[0]),
    loss_weights_sum=float(a.sum()),
    weights_residual=float(rel[1]),
    weightings=tuple(
      Weighting(n, tuple(float(x) for x in c), float(r), leaf=n if n != "rows" else rows_leaf)
      for (n, c), r in zip(candidates, rel[2:], strict=True)
    ),
    fit_tolerance=tol,
  )
