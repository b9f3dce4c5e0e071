"""``accumulate``: weighted gradient accumulation as an Optax transformation.

The factory: its arguments become feature objects (a window policy, a loss scale, guards, an
aggregation, observers) in the validated ``_step.Config`` (kept in the closure, never in the
state); ``init``; and :class:`Accumulation`, whose second entry point ``update_and_apply`` (the
fused step) :func:`optax_accum.update_and_apply` takes. A microstep and a boundary read top to
bottom in ``_step``; docs/design.md maps the modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_accum import (
  _aggregation,
  _buffers,
  _checks,
  _delivery,
  _equinox,
  _every_k,
  _guard,
  _loss_scale,
  _metrics,
  _numerics,
  _pitfalls,
  _step,
  _vma,
  _zero,
)
from optax_accum._protocols import Guard, Observer, WindowPolicy
from optax_accum._state import AccumulationState, Window

PyTree = Any


class Accumulation(optax.GradientTransformationExtraArgs):
  """The transformation :func:`accumulate` returns: optax's ``(init, update)``, and the fused step.

  An ``optax.GradientTransformationExtraArgs`` (``optax.chain``, ``masked`` and Flax take it
  as any other); :func:`optax_accum.update_and_apply` runs its fused ``update_and_apply``.
  ``update(updates, state, params=None, *, weight=1, flush=False, value=None, **extra_args)``
  (its arguments: :func:`accumulate`'s Update args) does:

  ============================  ================================================
  every call (microstep)        ``acc += weight * updates`` (in ``acc``'s dtype);
                                ``weight_sum += weight``; emit exact zeros
  boundary (``every_k`` calls,  ``mean = acc / (weight_sum * loss_scale)``, one
  the window policy's, or       finite check, global norm,
  ``flush=True``)               ``inner.update(mean, ...)`` once;
                                the window is empty again (``mini_step == 0``)
  non-finite window             zeros emitted, inner state untouched,
                                ``num_skipped += 1``, loss scale backs off
  empty window (weight sum 0)   zeros emitted, nothing counted
  ============================  ================================================

  Attributes:
    init: ``init(params) -> AccumulationState``.
    update: ``update(updates, state, params=None, **extra_args) -> (updates, state)``.
    update_and_apply: ``(grads, state, params, **extra_args) -> (new_params, state)``.
  """

  @property
  def update_and_apply(self) -> Callable[..., tuple[PyTree, PyTree]]:
    """The fused step: ``(grads, state, params, **extra_args) -> (new_params, new_state)``."""
    steps = getattr(self.update, "__self__", None)
    if not isinstance(steps, _Steps):
      raise TypeError(
        f"This Accumulation's update is not accumulate's own ({self.update!r}): it has no fused "
        "step. Use tx.update and optax.apply_updates, or make it with optax_accum.accumulate."
      )
    return steps.update_and_apply

  # pyrefly: ignore[bad-override]  # deliberately not an Accumulation (NamedTuple's _replace is)
  def _replace(self, **fields: Any) -> optax.GradientTransformationExtraArgs:
    """A plain ``GradientTransformationExtraArgs``: the fused step would not match a new field."""
    return optax.GradientTransformationExtraArgs(**{**self._asdict(), **fields})


class _Steps:
  """``accumulate``'s two steps; ``Accumulation.update`` is the bound method ``update``.

  A bound method, so that an ``Accumulation`` rebuilt from its two fields (``jax.tree``
  and Flax treat it as a NamedTuple) still reaches the fused step, and ``update`` is
  still a method for ``inspect`` and ``chex.assert_max_traces``.
  """

  def __init__(self, config: _step.Config):
    self.config = config
    # Eager calls run these, compiled once per tree structure (``_step.run``).
    self.compiled = {
      out: jax.jit(functools.partial(_step.step, config, out)) for out in _buffers.Output
    }

  def update(
    self, updates: PyTree, state: PyTree, params: PyTree = None, **extra_args: Any
  ) -> tuple[PyTree, PyTree]:
    # ``updates``: the microbatch's gradients, named as optax's update protocol names them.
    _delivery.received(extra_args)
    return _step.run(self.config, _buffers.Output.UPDATES, self.compiled, updates, state, params,
                     extra_args)  # fmt: skip

  def update_and_apply(
    self, grads: PyTree, state: PyTree, params: PyTree, **extra_args: Any
  ) -> tuple[PyTree, PyTree]:
    if params is None:
      raise ValueError("update_and_apply needs the params: they are what it updates.")
    _delivery.received(extra_args)
    return _step.run(self.config, _buffers.Output.PARAMS, self.compiled, grads, state, params,
                     extra_args)  # fmt: skip


def accumulate(
  inner: optax.GradientTransformation,
  every_k: int | Callable[[jax.Array], Any] | WindowPolicy,
  *,
  loss_scale: _loss_scale.LossScale | None = None,
  skip_if: Guard | Callable[..., Any] | tuple[Any, ...] | None = None,
  aggregate: _aggregation.Aggregation | None = None,
  observe: tuple[Observer, ...] = (),
  axis_name: str | tuple[str, ...] | None = None,
  accumulator_dtype: Any = None,
  shard_optimizer: bool = False,
) -> Accumulation:
  """Accumulates weighted microbatch gradients and runs ``inner`` once per window.

  Each call adds ``weight * grads`` to the window and emits exact zeros; at the window's
  boundary (``every_k`` calls, the window policy's decision, or ``flush=True``) the window mean
  ``sum_i w_i g_i / (sum_i w_i * loss_scale)`` is checked for finiteness once and handed to
  ``inner.update`` once; a non-finite window is skipped whole (``num_skipped``), an empty one
  changes nothing (``update``'s arguments: Update args, below). Each option is an
  object from its own factory, with its own sub-state in the state (``optax.EmptyState()``
  when off): it composes like optax.

  Args:
    inner: the inner optimizer (any ``optax.GradientTransformation``); its schedules, weight
      decay and step counts advance only on applied windows. Clip the window, not each
      microbatch, inside it: ``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))``.
    every_k: the window policy: microbatches per window, an int >= 1 (``1``: every
      microbatch is a window, and no accumulator is kept); a callable of ``num_updates``
      (int32) returning an integer scalar (below 1 acts as 1), like ``optax.MultiSteps``'
      ``every_k_schedule``; or a window policy object: :func:`optax_accum.token_budget`
      (windows counted in tokens) or your own (docs/protocols.md).
    loss_scale: None, :func:`optax_accum.static_loss_scale` or
      :func:`optax_accum.dynamic_loss_scale`; the grads are then gradients of ``loss *
      metrics(state).loss_scale``, unscaled once at the boundary.
    skip_if: guards beyond the non-finite skip: :func:`optax_accum.spike_rule`, a callable of
      the window's statistics (``grad_norm``, ``loss``, ``has_loss``, ``weight``,
      ``num_updates``, 0-d) returning True to skip a finite window (counted in
      ``num_spikes``), an ``optax.MultiSteps`` ``should_skip_update_fn`` such as
      ``optax.skip_not_finite`` (a microbatch it flags is dropped and does not count toward
      ``every_k``, MultiSteps' meaning; counted in ``num_dropped``), a guard object, or a
      tuple of them. docs/guards.md.
    aggregate: :func:`optax_accum.aggregate` (a fixed denominator, per-leaf rules, FP8); None:
      the weighted mean. docs/aggregation.md.
    observe: a tuple of observers, e.g. ``(optax_accum.noise_scale(0.9),)``, read by
      :func:`optax_accum.metrics`. docs/noise_scale.md.
    axis_name: a ``shard_map`` axis name (or tuple): each device sums its own microbatches;
      one ``psum`` at the boundary precedes the single division. docs/scaling.md.
    accumulator_dtype: None (default): ``promote_types(grad.dtype, float32)`` per leaf
      (float32 for bf16/fp16/float32, float64 under x64); or a dtype.
    shard_optimizer: ZeRO-1 at the window boundary (needs ``axis_name``; the state is made and
      updated inside ``shard_map``, ``sharding.init_sharded``): one reduce-scatter of the
      window, the inner optimizer on each device's ``1/n`` of every leaf with ``1/n`` of its
      state, one all-gather of the updates: the bytes of one all-reduce, and ``1/n`` of the
      inner state per device. The inner optimizer must treat elements independently (adam,
      adamw, sgd, lion; global norms are exact); one that reshapes or couples elements
      (factored adafactor, muon) is refused, naming the operation. docs/scaling.md.

  Returns:
    An ``Accumulation``: an ``optax.GradientTransformationExtraArgs`` (its state an
    :class:`AccumulationState`, finite while the gradients are) with the fused step that
    :func:`optax_accum.update_and_apply` takes. ``inner`` sees the mean in the wider of the
    grads' and params' dtypes; the updates have plain ``inner``'s dtypes (optax's
    ``test_multi_steps_mixed_precision`` rule).

  Update args:
    updates: the gradient of this microbatch's *mean* loss, a tree like the params (optax's
      name for the first argument of ``tx.update``).
    state: the state ``tx.init`` made or the last call returned.
    params: the params, a tree (None if ``inner`` needs none).
    weight: the number of examples or unmasked tokens that mean is over (default 1): a
      non-negative scalar, a Python number or an array, may be traced. A traced negative
      weight is not checked: it subtracts that microbatch.
    flush: a bool (may be traced): close the window after this microbatch even if it holds
      fewer than ``every_k`` microbatches.
    value: the microbatch's loss (optional); the inner optimizer receives the window's
      weighted mean as ``value`` (for ``optax.contrib.reduce_on_plateau``).
    **extra_args: forwarded to ``inner.update`` on the boundary call.

  Raises:
    TypeError, ValueError: at construction, naming a bad argument (or two features that show
      the same metric); at trace time for a non-scalar, boolean, concrete negative or
      unrepresentable weight, grads that do not match the state or params, device-varying
      params under ``axis_name``, and a state whose
      sub-states or inner state do not have this configuration's structure (the
      configuration itself lives in the closure, as optax's: ``sharding.check_compatible``).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> params = {'w': jnp.zeros(2)}
    >>> u, state = tx.update({'w': jnp.array([1., 1.])}, tx.init(params), params, weight=3)
    >>> u['w']  # between boundaries: exact zeros
    Array([0., 0.], dtype=float32)
    >>> u, state = tx.update({'w': jnp.array([5., 5.])}, state, params, weight=1)
    >>> u['w']  # -(3 * 1 + 1 * 5) / 4
    Array([-2., -2.], dtype=float32)

  References:
    Hugging Face, `Fixing gradient accumulation
    <https://huggingface.co/blog/gradient_accumulation>`_ (2024); ``optax.MultiSteps``.
  """
  config = _config(inner, every_k, loss_scale, skip_if, aggregate, observe, axis_name,
                   accumulator_dtype, shard_optimizer)  # fmt: skip

  def init_fn(params):
    return init(config, params)

  return Accumulation(init_fn, _Steps(config).update)


def _config(inner, every_k, loss_scale, skip_if, aggregate, observe, axis_name,
            accumulator_dtype, shard_optimizer) -> _step.Config:  # fmt: skip
  """Validates ``accumulate``'s arguments into feature objects, each error naming the argument."""
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(
      f"inner must be an optax.GradientTransformation, got {inner!r}. Call the factory: "
      "accumulate(optax.adam(1e-3), every_k=4), not accumulate(optax.adam, ...)."
    )
  policy = _window_policy(every_k)
  aggregation = _aggregation.aggregate() if aggregate is None else aggregate
  if not isinstance(aggregation, _aggregation.Aggregation):
    raise TypeError(f"aggregate must be optax_accum.aggregate(...) or None, got {aggregate!r}.")
  if isinstance(aggregation.denominator, jax.core.Tracer):
    raise TypeError(
      "accumulate(aggregate=aggregate(denominator=...)) takes a number or a schedule of "
      "num_updates, not an array of this step (that is for microbatched_value_and_grad)."
    )
  observers = _observers(observe)
  _check_aggregation((policy, *observers), aggregation.weighted_mean)
  _checks.axis_names(axis_name)
  always_closes = isinstance(policy, _every_k.CountWindow) and policy.always_closes
  config = _step.Config(
    inner=optax.with_extra_args_support(inner),
    policy=policy,
    loss_scale=_loss_scale.policy(loss_scale),
    guards=_guard.guards(skip_if),
    aggregation=aggregation,
    observers=observers,
    axis_name=axis_name,
    accumulator_dtype=_accumulator_dtype(accumulator_dtype),
    keeps_window=not always_closes,
    placement=_zero.check_config(shard_optimizer, axis_name, aggregation),
  )
  _metrics.check_names(config)
  return config


def _check_aggregation(features: tuple[Any, ...], weighted_mean: bool) -> None:
  """Asks each window policy and observer that defines ``check_aggregation`` (the noise
  scale's estimators need the window to be the weighted mean) whether it can see this window;
  it raises, naming itself, where not."""
  for feature in features:
    check = getattr(feature, "check_aggregation", None)
    if callable(check):
      check(weighted_mean)


def _window_policy(every_k: Any) -> Any:
  """``every_k`` as a window policy: an int or a schedule (``_every_k``), or a policy object."""
  if every_k is None:
    raise TypeError(
      "accumulate: every_k=None is not a window policy; pass microbatches per window "
      "(every_k=4) or a policy, e.g. every_k=optax_accum.token_budget(2**20) for windows of "
      "2**20 tokens."
    )
  methods = ("init", "init_window", "add", "closes", "close")
  if all(callable(getattr(every_k, m, None)) for m in methods):
    if _checks.takes(every_k.add, 3) is False:
      raise TypeError(
        f"the window policy {every_k!r} has an add that cannot take (window, weight, grads): "
        "the microstep passes each microbatch's gradient too; add a grads parameter (a policy "
        "that needs none ignores it)."
      )
    return every_k
  if not callable(every_k) and hasattr(every_k, "closes"):
    missing = [m for m in methods if not callable(getattr(every_k, m, None))]
    raise TypeError(f"the window policy {every_k!r} lacks the methods {missing}.")
  return _every_k.count_window(every_k)


def _observers(observe: Any) -> tuple[Any, ...]:
  """``observe`` as a tuple of observers (each with the observer protocol's methods)."""
  items = tuple(observe) if isinstance(observe, (tuple, list)) else (observe,)
  methods = ("init", "init_window", "add", "close")
  for o in items:
    missing = [m for m in methods if not callable(getattr(o, m, None))]
    if missing:
      raise TypeError(
        f"observe takes a tuple of observers, e.g. (optax_accum.noise_scale(0.9),); {o!r} "
        f"lacks the methods {missing} (docs/protocols.md)."
      )
  return items


def _accumulator_dtype(dtype: Any) -> jnp.dtype | None:
  """A validated ``accumulator_dtype`` (None: the default rule, per leaf)."""
  if dtype is None:
    return None
  dtype = jnp.dtype(dtype)
  if jax.dtypes.canonicalize_dtype(dtype) != dtype:
    raise TypeError(
      f"accumulator_dtype={dtype} needs 64-bit JAX: without jax_enable_x64 every array "
      f"is at most 32-bit, so a {dtype} accumulator would silently be "
      f"{jax.dtypes.canonicalize_dtype(dtype)}. Call "
      "jax.config.update('jax_enable_x64', True) before creating the optimizer, or leave "
      "accumulator_dtype=None (float32 for bf16/fp16/float32 gradients)."
    )
  return dtype


def init(config: _step.Config, params: PyTree) -> AccumulationState:
  """A fresh state: an empty window, zero counters, each feature's sub-state."""
  _pitfalls.check_params(params)
  _equinox.check_params(params)
  agg = config.aggregation
  fp8 = "grad_amax_history" in agg.rules(params)
  if config.placement.sharded and any(agg.overwritten(params)):
    raise ValueError(
      "shard_optimizer=True: these params have leaves the boundary overwrites (Flax FP8 meta, "
      "max/last rules), which are not sharded. Use shard_optimizer=False for them."
    )
  if agg.active(params):  # per-leaf rules on these params: the window is no weighted mean
    _check_aggregation((config.policy, *config.observers), False)
  _pitfalls.check_fp8_scale(fp8, agg.denominator is None, config.keeps_window)
  fdt = _numerics.scalar_dtype()
  # A fresh buffer per field: donating a state whose leaves share a buffer
  # fails ("Attempt to donate the same buffer twice").
  zero_f = lambda: jnp.zeros((), fdt)
  zero_i = lambda: jnp.zeros((), jnp.int32)
  zero_b = lambda: jnp.zeros((), jnp.bool_)
  acc_dtype = lambda p: _numerics.accumulator_dtype(p.dtype, config.accumulator_dtype)
  grad_sum = optax.EmptyState()
  if config.keeps_window:
    grad_sum = jax.tree.map(lambda p: _buffers.zeros_like_placed(p, acc_dtype(p)), params)
  else:
    jax.tree.map(acc_dtype, params)  # a non-float leaf raises as it would with a window
  window = Window(
    grad_sum=grad_sum,
    weight_sum=zero_f(),
    value_sum=zero_f(),
    value_weight=zero_f(),
    **config.window_sums(params),
  )
  state = AccumulationState(
    mini_step=zero_i(),
    window=window,
    num_microbatches=zero_i(),
    num_updates=zero_i(),
    num_skipped=zero_i(),
    updated=zero_b(),
    window_loss=zero_f(),
    has_window_loss=zero_b(),
    grad_norm=zero_f(),
    has_grad_norm=zero_b(),
    flush_pending=zero_b(),
    **config.sub_states(params),
    inner_state=config.placement.wrap(
      _pitfalls.check_inner_state(
        config.placement.init(agg.inner_for(config.inner, params), params), AccumulationState
      )
    ),
  )
  return _vma.per_device_window(state, config.axis_name)
