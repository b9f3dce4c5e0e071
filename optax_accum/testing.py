"""Pre-flight checks that accumulation reproduces one physical batch, and HLO collective counts.

Run :func:`check_equivalence` before a long run (:func:`assert_equivalent` in tests): it catches a
loss that is not a mean, a wrong ``weight`` and BatchNorm. Flax is imported only when needed.
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

__all__ = [
  "BatchDependentLayerWarning",
  "Difference",
  "EquivalenceReport",
  "assert_equivalent",
  "batch_dependent_layers",
  "check_equivalence",
  "count_collectives",
]

PyTree = Any


class BatchDependentLayerWarning(UserWarning):
  """A layer whose output depends on the other examples in the batch (BatchNorm in train mode).

  Accumulation cannot reproduce one batch: each microbatch is normalized with its own statistics.
  """


class Difference(NamedTuple):
  """How far one quantity is from its physical-batch reference.

  Attributes:
    max_abs: ``max |x - ref|`` over all leaves and elements.
    max_rel: ``max_abs / scale`` (0 when both are 0).
    scale: ``max |ref|``, the reference's largest magnitude.

  Examples:
    >>> from optax_accum.testing import Difference
    >>> d = Difference(max_abs=0.5, max_rel=0.125, scale=4.0)
    >>> d.ok(rtol=0.125, atol=0.0), d.ok(rtol=0.0, atol=0.25)  # 0.5 <= 0.125 * 4; 0.5 > 0.25
    (True, False)
  """

  max_abs: float
  max_rel: float
  scale: float

  def ok(self, rtol: float, atol: float) -> bool:
    """``max_abs <= atol + rtol * scale`` (``numpy.allclose`` with one global scale), a bool."""
    return bool(self.max_abs <= atol + rtol * self.scale)


def _difference(x: PyTree, ref: PyTree) -> Difference:
  xs = [np.asarray(a, np.float64) for a in jax.tree.leaves(x)]
  rs = [np.asarray(a, np.float64) for a in jax.tree.leaves(ref)]
  max_abs = max(
    (float(np.max(np.abs(a - r), initial=0.0)) for a, r in zip(xs, rs, strict=True)), default=0.0
  )
  scale = max((float(np.max(np.abs(r), initial=0.0)) for r in rs), default=0.0)
  rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
  return Difference(max_abs, rel, scale)


class EquivalenceReport(NamedTuple):
  """Differences of one accumulated window from one physical batch (see :func:`check_equivalence`).

  Attributes:
    loss: in-step weighted-mean loss vs the batch's loss.
    grad_in_step: in-step gradient vs ``jax.grad`` on the whole batch.
    sgd_across_step: ``accumulate(optax.sgd(1.0), K)``'s window update vs ``optax.sgd(1.0)``'s.
    update_in_step: ``inner``'s update from the in-step gradient vs from the batch's.
    update_across_step: ``accumulate(inner, K)``'s window update vs ``inner``'s on the batch.
    mean_of_means: the equal-weights gradient (mean of microbatch means) vs the batch's.
    num_updates: updates ``accumulate`` applied in the window (should be 1).
    weights: the weight of each microbatch.
    batch_dependent_layers: paths of detected BatchNorm layers or collections.

  Examples:
    >>> from optax_accum.testing import Difference, EquivalenceReport
    >>> ok, off = Difference(0.0, 0.0, 1.0), Difference(1e-3, 1e-3, 1.0)
    >>> report = EquivalenceReport(ok, ok, ok, ok, ok, mean_of_means=off, num_updates=1,
    ...                            weights=(3.0, 1.0), batch_dependent_layers=())
    >>> report.passed()  # mean_of_means is shown, not checked
    True
    >>> bad = report._replace(update_across_step=off)
    >>> bad.passed(), bad.passed(rtol=1e-2), report._replace(num_updates=0).passed()
    (False, True, False)
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

  def passed(self, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Whether every row but ``mean_of_means`` is within :meth:`Difference.ok` and one update
    was applied (the float32 default tolerances allow rounding only), a bool."""
    rows = (self.loss, self.grad_in_step, self.sgd_across_step)
    rows += (self.update_in_step, self.update_across_step)
    return self.num_updates == 1 and all(d.ok(rtol, atol) for d in rows)

  def __str__(self) -> str:
    w = ", ".join(f"{x:g}" for x in self.weights)
    lines = [
      f"optax_accum equivalence check: {len(self.weights)} microbatches, weights [{w}] "
      f"(sum {sum(self.weights):g}), updates applied: {self.num_updates}",
      f"{'vs one physical batch':<34}{'max abs':>11}{'max rel':>11}",
    ]
    rows = [
      ("loss, in-step", self.loss),
      ("gradient, in-step", self.grad_in_step),
      ("sgd(1) step, across-step", self.sgd_across_step),
      ("inner update, in-step", self.update_in_step),
      ("inner update, across-step", self.update_across_step),
      ("mean of means would give (grad)", self.mean_of_means),
    ]
    lines += [f"{name:<34}{d.max_abs:>11.3g}{d.max_rel:>11.3g}" for name, d in rows]
    layers = ", ".join(self.batch_dependent_layers) or "none found"
    lines.append(f"batch-dependent layers: {layers}")
    return "\n".join(lines)


def batch_dependent_layers(model: Any) -> tuple[str, ...]:
  """Paths of batch-dependent layers in a Flax model or Linen variables.

  Args:
    model: an ``nnx.Module`` (finds ``nnx.BatchStat`` owners not in ``use_running_average``
      mode) or Linen variables (a ``'batch_stats'`` collection); anything else finds nothing.

  Returns:
    A tuple of paths, e.g. ``('bn',)``; ``()`` if none or for any other input (never raises).

  Examples:
    >>> from optax_accum.testing import batch_dependent_layers
    >>> batch_dependent_layers({'params': {}, 'batch_stats': {'BatchNorm_0': {}}})
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
  layers = batch_dependent_layers(params) + batch_dependent_layers(model)
  if layers:
    warnings.warn(
      f"The model has batch-dependent layers ({', '.join(layers)}): BatchNorm in train mode "
      "normalizes each microbatch with its own statistics (and updates running averages "
      "once per microbatch), so gradient accumulation will NOT reproduce one physical batch "
      "for it. Use LayerNorm/GroupNorm/RMSNorm, or accept the difference this check reports.",
      BatchDependentLayerWarning,
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
  """Runs one accumulated window both ways and one physical batch, and compares them.

  One ``jax.jit`` run: the physical batch, in-step :func:`optax_accum.microbatched_value_and_grad`
  and across-step :func:`optax_accum.accumulate` on ``num_microbatches`` slices, weighted by
  ``weight_fn``. ``optax.sgd(1.0)`` is compared too (Adam's first step hides a wrong divisor).
  Keep dropout off (masks differ between paths).

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
    strided: how the batch is split (see :func:`optax_accum.split_batch`).
    has_aux: ``loss_fn`` returns ``(loss, aux)``, as in ``jax.value_and_grad``; aux is unused.

  Returns:
    An :class:`EquivalenceReport`; ``print(report)`` shows a table.

  Raises:
    ValueError: if the batch cannot be split into ``num_microbatches``.

  Warns:
    BatchDependentLayerWarning: if ``model`` or ``params`` has BatchNorm or ``batch_stats``.

  Examples:
    >>> import optax
    >>> from optax_accum import testing
    >>> def loss_fn(w, batch):  # mean of 0.5 * (x @ w - y)**2 over the rows
    ...   return jnp.mean(0.5 * (batch['x'] @ w - batch['y']) ** 2)
    >>> batch = {'x': jnp.arange(16.0).reshape(8, 2) / 8, 'y': jnp.arange(8.0)}
    >>> report = testing.check_equivalence(
    ...     loss_fn, jnp.zeros(2), batch, optax.adam(1e-3), num_microbatches=4)
    >>> report.passed(), report.num_updates
    (True, 1)
  """
  layers = _warn_if_batch_dependent(params, model)
  f, p = _functional((lambda *a: loss_fn(*a)[0]) if has_aux else loss_fn, params)
  k = num_microbatches
  weigh = weight_fn if weight_fn is not None else (lambda mb: jax.tree.leaves(mb)[0].shape[0])

  sgd1, acc_inner = accumulate(optax.sgd(1.0), k), accumulate(inner, k)

  @jax.jit
  def run(params, batch):
    loss_ref, g_ref = jax.value_and_grad(f)(params, batch)
    mvg = microbatched_value_and_grad(f, k, weight_fn=weight_fn, strided=strided)
    loss_in, g_in = mvg(params, batch)
    inner_state = inner.init(params)
    u_ref = inner.update(g_ref, inner_state, params)[0]

    def microstep(carry, mb):
      s_sgd, s_inner, sum_sgd, sum_inner = carry
      g, w = jax.grad(f)(params, mb), weigh(mb)
      u, s_sgd = sgd1.update(g, s_sgd, params, weight=w)
      v, s_inner = acc_inner.update(g, s_inner, params, weight=w)
      sums = optax.tree.add(sum_sgd, u), optax.tree.add(sum_inner, v)
      return (s_sgd, s_inner, *sums), (g, jnp.asarray(w, jnp.float32))

    zeros = optax.tree.zeros_like(params)
    carry = (sgd1.init(params), acc_inner.init(params), zeros, zeros)
    micro = split_batch(batch, k, strided=strided)
    (_, s_inner, sum_sgd, sum_inner), (grads, weights) = jax.lax.scan(microstep, carry, micro)
    pairs = {  # (value, its physical-batch reference) per row of the report
      "loss": (loss_in, loss_ref),
      "grad_in_step": (g_in, g_ref),
      "sgd_across_step": (sum_sgd, jax.tree.map(jnp.negative, g_ref)),
      "update_in_step": (inner.update(g_in, inner_state, params)[0], u_ref),
      "update_across_step": (sum_inner, u_ref),
      "mean_of_means": (jax.tree.map(lambda g: jnp.mean(g, axis=0), grads), g_ref),
    }
    return pairs, metrics(s_inner).num_updates, weights

  pairs, num_updates, weights = jax.device_get(run(p, batch))
  return EquivalenceReport(
    **{name: _difference(x, ref) for name, (x, ref) in pairs.items()},
    num_updates=int(num_updates),
    weights=tuple(float(w) for w in weights),
    batch_dependent_layers=layers,
  )


def assert_equivalent(
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
  rtol: float = 1e-5,
  atol: float = 1e-6,
) -> EquivalenceReport:
  """:func:`check_equivalence` that raises unless every row is within ``atol + rtol * scale``.

  Args:
    loss_fn, params, batch, inner, num_microbatches, weight_fn, model, strided, has_aux:
      as in :func:`check_equivalence`.
    rtol: relative tolerance, against the reference's largest magnitude.
    atol: absolute tolerance. The float32 defaults allow rounding only.

  Returns:
    The :class:`EquivalenceReport`.

  Raises:
    AssertionError: with the report's table, if the check fails.

  Examples:
    >>> import optax
    >>> from optax_accum import testing
    >>> def loss_fn(w, batch):  # masked mean of 0.5 * (w - y)**2 over the real rows
    ...   m = batch['mask']
    ...   return (0.5 * (w - batch['y']) ** 2 * m).sum() / jnp.maximum(m.sum(), 1.0)
    >>> batch = {'y': jnp.arange(8.0), 'mask': jnp.array([1., 1, 1, 0, 1, 0, 0, 0])}
    >>> report = testing.assert_equivalent(  # weights 2, 1, 1, 0 per microbatch
    ...     loss_fn, jnp.asarray(0.5), batch, optax.sgd(0.1),
    ...     num_microbatches=4, weight_fn=lambda mb: mb['mask'].sum())
    >>> report.weights
    (2.0, 1.0, 1.0, 0.0)
  """
  report = check_equivalence(
    loss_fn,
    params,
    batch,
    inner,
    num_microbatches=num_microbatches,
    weight_fn=weight_fn,
    model=model,
    strided=strided,
    has_aux=has_aux,
  )
  if not report.passed(rtol=rtol, atol=atol):
    raise AssertionError(
      f"Accumulation does not reproduce one physical batch (rtol={rtol}, atol={atol}):\n{report}"
    )
  return report
