"""One microstep of :func:`optax_accum.accumulate` and the boundary that closes a window.

Read top to bottom, :func:`step` is the life of a microbatch: check the inputs, let the guards
admit it, add ``weight * grads`` to the window, ask the window policy whether this microbatch
closes it, and run ``lax.cond(boundary, close, between)``; :func:`close` is the boundary: one
all-reduce under ``axis_name``, one pass for the global norm and the finite check, then the
inner optimizer once (applied) or not at all (skipped, spiked, empty), the counters, and each
feature's ``close`` with the window's :class:`~optax_accum._protocols.Outcome`.

This module imports no feature module: the features are objects in the configuration, reached
through the protocols of ``_protocols`` (docs/design.md). Where the output lives is one
explicit mode (``_buffers.Output``); the arithmetic is ``_numerics``'s, the device-variance
typing ``_vma``'s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _buffers, _checks, _numerics, _vma
from optax_accum import _state as st
from optax_accum._protocols import Outcome, Position, WindowStats

PyTree = Any


class Config(NamedTuple):
  """``accumulate``'s configuration, validated by its factory; it lives in the closure.

  Attributes:
    inner: the inner optimizer (``optax.with_extra_args_support``).
    policy: the window policy (``_protocols.WindowPolicy``).
    loss_scale: the loss-scale policy (a null object without one).
    guards: ``skip_if``'s guards (``_guard.Guards``).
    aggregation: the window's aggregation (``_aggregation.Aggregation``).
    observers: ``observe``'s observers, a tuple (``_protocols.Observer``).
    axis_name: the ``shard_map`` axis name(s) the window is summed over, or None.
    accumulator_dtype: the accumulator dtype override, or None (the per-leaf rule).
    keeps_window: False when every microbatch closes its window (``every_k=1``): the state
      holds no accumulator.
    placement: where the inner optimizer runs at the boundary (``_zero``): on the whole
      window on every device, or ZeRO-1 on each device's ``1/n`` (``shard_optimizer=True``).
  """

  inner: Any
  policy: Any
  loss_scale: Any
  guards: Any
  aggregation: Any
  observers: tuple[Any, ...]
  axis_name: Any
  accumulator_dtype: Any
  keeps_window: bool
  placement: Any

  def sub_states(self, params: PyTree) -> dict[str, Any]:
    """The features' fresh sub-states, by state field."""
    return {
      "loss_scale": self.loss_scale.init(),
      "policy": self.policy.init(),
      "observers": tuple(o.init() for o in self.observers),
      "guard": self.guards.init(),
    }

  def window_sums(self, params: PyTree) -> dict[str, Any]:
    """The features' fresh per-window sums, by window field."""
    return {
      "policy": self.policy.init_window(),
      "observers": tuple(o.init_window(params) for o in self.observers),
    }


def run(config, output, compiled, grads, state, params, extra):
  """:func:`step`, or, for an eager call, its program compiled once per configuration.

  Under a trace this is :func:`step`. Eagerly, the checks of concrete values (the weight, a
  denominator schedule's value) run here and the step runs as ``compiled[output]``, ``accumulate``'s
  cached ``jax.jit`` of :func:`step`, instead of tracing both ``lax.cond`` branches each call.
  The structural checks (``check_inputs``) run when that program is traced: once per tree
  structure, shapes and dtypes, which is all they read.
  """
  if not _concrete((grads, state, params, extra)):
    return step(config, output, grads, state, params, **extra)
  if not isinstance(state, st.AccumulationState):
    check_inputs(config, grads, state, params)  # its TypeError, before reading state.window
  extra = dict(extra)
  args = [extra.pop("weight", 1), extra.pop("flush", False), extra.pop("value", None)]
  w, flush, value = _check_args(*args)
  config.aggregation.value(state.window.weight_sum, state.num_updates)  # a schedule's, concrete
  return compiled[output](grads, state, params, weight=w, flush=flush, value=value, **extra)


def _check_args(weight, flush, value) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """``tx.update``'s own arguments, validated: the weight, the flush flag, the loss or None."""
  if value is not None:
    value = _checks.scalar(value, "value", "the scalar loss of the microbatch")
  return _checks.weight(weight), _checks.flag(flush, "flush"), value


def _concrete(tree: PyTree) -> bool:
  """Whether every leaf is a concrete array or number: an eager call, not under a trace."""
  kinds = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
  leaves = jax.tree.leaves(tree)
  return all(isinstance(x, kinds) and not isinstance(x, jax.core.Tracer) for x in leaves)


def step(config, output, grads, state, params, *, weight=1, flush=False, value=None, **extra):
  """One microbatch: add it to the window; at a boundary, close the window.

  ``output`` (``_buffers.Output``) says whether to return the updates or the new params;
  the rest is as ``tx.update``.
  """
  check_inputs(config, grads, state, params)
  w, flush, value = _check_args(weight, flush, value)
  config.guards.check_call(value)
  # optax_accum.flush marks the state: this call adds nothing and closes the window.
  flushing = state.flush_pending
  admitted, guard_state = config.guards.admit(state.guard, grads, state.num_updates, params)
  admitted = admitted & ~flushing
  w = jnp.where(admitted, w, jnp.zeros_like(w))
  flush = flush | flushing
  # The sum is added outside the cond: one fused, in-place pass over the donated
  # accumulator, which reads it as zeros if the window was empty (the lazy reset)
  # and which `between` passes through untouched.
  window = add_microbatch(config, state, grads, w, value)
  mini_step = state.mini_step + admitted.astype(state.mini_step.dtype)
  position = Position(mini_step, window.weight_sum, state.num_updates, config.axis_name)
  boundary = config.policy.closes(state.policy, window.policy, position) | flush
  dtypes = Dtypes.of(config, output, grads, state, params, value, extra)
  place = _buffers.placement(output, dtypes.out, window.grad_sum)
  call = Call(config, place, dtypes, params, value, extra)
  # What closing a window changes, besides the window and the inner state.
  header = state._replace(window=None, inner_state=None, guard=guard_state)

  def between(operands):
    grad_sum, inner_state = operands
    # zeros_like keeps the fields' device variance: both branches agree under shard_map.
    unchanged = header._replace(updated=jnp.zeros_like(state.updated))
    return place.between(params, boundary), grad_sum, inner_state, unchanged

  # A flush of a window that holds no microbatch closes nothing, even with apply_empty.
  nothing_to_close = flush & (state.mini_step == 0)

  def boundary_branch(operands):
    return close(call, header, window, operands, nothing_to_close)

  operands = (window.grad_sum, state.inner_state)
  branches = _vma.agree((boundary_branch, between), operands, (grads, state, params, w, extra))
  out, grad_sum, inner_state, closed = jax.lax.cond(boundary, *branches, operands)

  def reset(x):  # the window's sums, zero again after a boundary (the buffer: lazily)
    return jnp.where(boundary, jnp.zeros_like(x), x)

  sums = jax.tree.map(reset, window._replace(grad_sum=None))
  count = state.num_microbatches
  new_state = closed._replace(
    mini_step=reset(mini_step),
    window=sums._replace(grad_sum=grad_sum if config.keeps_window else optax.EmptyState()),
    num_microbatches=jnp.where(flushing, count, optax.safe_increment(count)),  # a flush: no data
    flush_pending=jnp.zeros_like(state.flush_pending),
    inner_state=inner_state,
  )
  return place.result(out, grad_sum, closed.updated), new_state


def add_microbatch(config, state, grads, w, value) -> st.Window:
  """The open window with this microbatch added: ``grad_sum += w * g``, ``weight_sum += w``,
  and each feature's per-window sums. Without a kept window (``every_k=1``) the sum starts
  from zeros."""
  window = state.window
  acc = state.window_sum if config.keeps_window else _zeros_like_acc(config, grads)
  new = window._replace(
    grad_sum=config.aggregation.add(acc, grads, w, window.weight_sum == 0),
    weight_sum=window.weight_sum + w,
    policy=config.policy.add(window.policy, w, grads),
    observers=tuple(
      o.add(s, w, grads) for o, s in zip(config.observers, window.observers, strict=True)
    ),
  )
  if value is not None:
    new = new._replace(
      value_sum=_numerics.weighted_add(window.value_sum, value, w),
      value_weight=window.value_weight + w,
    )
  return new


def _zeros_like_acc(config, grads: PyTree) -> PyTree:
  """Zeros shaped like the accumulator would be (a temporary of the call, never kept)."""
  dtype = lambda g: _numerics.accumulator_dtype(g.dtype, config.accumulator_dtype)
  return jax.tree.map(lambda g: jnp.zeros(jnp.shape(g), dtype(g)), grads)


class Call(NamedTuple):
  """What one ``tx.update`` call brings to its boundary besides the window (trace time).

  Attributes:
    config: the transformation's ``Config``.
    place: where this call's output lives (``_buffers.placement`` of its ``Output``).
    dtypes: the window's ``Dtypes``.
    params: the params of the call (None where ``tx.update`` got none).
    value: the microbatch's loss (``value=``), or None.
    extra: the other keyword arguments, for the inner optimizer.
  """

  config: Config
  place: _buffers.UpdatesOut | _buffers.ParamsOut
  dtypes: Dtypes
  params: PyTree
  value: jax.Array | None
  extra: dict[str, Any]


def close(call: Call, header, window, operands, nothing_to_close):
  """The boundary: one finite check, then apply (inner once), skip or nothing (empty).

  ``operands`` are the accumulator and the inner state, ``header`` the state's other fields;
  ``nothing_to_close``: a flush of a window with no microbatch. Returns ``(output, grad_sum,
  inner_state, header)``, the header being the state's scalars and sub-states after the
  window (``window`` and ``inner_state`` None).
  """
  config, place, dtypes, params, value, extra = call
  grad_sum, inner_state = operands
  agg, placement = config.aggregation, config.placement
  # Under axis_name, the window over the devices: one all-reduce (a pmax first for max/last
  # leaves), or (ZeRO-1) one reduce-scatter: this device's 1/n of each leaf, the scalars summed.
  rest = window._replace(grad_sum=None)
  grads, rest, parts = placement.reduce(agg, grad_sum, rest, config.axis_name)
  sums = rest._replace(grad_sum=grads)
  split = agg.split(sums.grad_sum)
  scale = config.loss_scale.scale(header.loss_scale)
  d = agg.value(sums.weight_sum, header.num_updates)  # the weight sum, or the fixed denominator
  like = placement.like(dtypes.mean)
  norm, norm_finite, fits = placement.norm_and_finite(split, sums.grad_sum, d, scale, like, parts)
  # A schedule's traced value <= 0 or not finite skips; the mean must fit the dtype inner gets.
  finite = norm_finite & agg.usable(d) & fits
  empty = sums.weight_sum == 0
  has_value = sums.value_weight > 0
  loss_sum = _numerics.guarded_divide(sums.value_sum, agg.loss_denominator(sums.value_weight, d))
  loss = jnp.where(has_value, loss_sum, 0)
  fdt = _numerics.scalar_dtype()
  stats = WindowStats(norm.astype(fdt), loss.astype(fdt), has_value, sums.weight_sum,
                      header.num_updates)  # fmt: skip
  # A finite window a guard skips: nothing but num_spikes changes.
  spike = ~empty & finite & config.guards.judge(header.guard, stats)
  runs = ~empty | (agg.apply_empty & ~nothing_to_close)  # DP-SGD applies an empty window
  apply = runs & finite & ~spike
  inner_args = dict(extra)
  if value is not None:
    inner_args["value"] = jnp.where(has_value, loss, jnp.nan)

  def run_inner(ops):
    grad_sum, inner_state = ops
    mean = split.window_values(sums.grad_sum, d, scale, like)
    updates, new_inner, ok = _inner_update(call, mean, inner_state, inner_args)
    updates = split.overwrite_updates(updates, mean, params, empty)  # max/last: value - param
    out, grad_sum = place.applied(updates, params, grad_sum)
    out = place.overwrite(split, out, mean, params, empty)  # exact on the fused path
    return out, grad_sum, new_inner, jnp.ones_like(apply) if ok is None else ok

  def keep_inner(ops):
    grad_sum, inner_state = ops
    out, grad_sum = place.skipped(params, grad_sum, apply)
    return out, grad_sum, inner_state, jnp.zeros_like(apply)

  branches = (run_inner, keep_inner)
  if placement.sharded:  # the shards' scalars (a step count) may come back typed per device
    branches = _vma.agree(branches, operands, (sums, params, extra))
  out, new_sum, inner_state, ok = jax.lax.cond(apply, *branches, operands)
  new_sum = place.after_inner(grad_sum, new_sum, inner_state, out)
  outcome = Outcome(stats, apply & ok, finite & (ok | ~apply), empty, spike, scale)
  header = _counters(header, outcome, norm, norm_finite)
  header = header._replace(
    loss_scale=config.loss_scale.close(header.loss_scale, outcome),
    policy=config.policy.close(header.policy, sums.policy, outcome),
    observers=tuple(
      o.close(s, w, outcome)
      for o, s, w in zip(config.observers, header.observers, sums.observers, strict=True)
    ),
    guard=config.guards.close(header.guard, outcome),
  )
  return out, new_sum, inner_state, header


def _counters(header: st.AccumulationState, outcome: Outcome, norm: jax.Array, norm_finite):
  """The state's counters and last-window values after ``outcome``; nothing non-finite enters
  the state ("no value" is a flag). A window skipped for a 16-bit overflow keeps its norm (a
  NaN/Inf window has none)."""
  stats, empty = outcome.stats, outcome.empty
  skipped = ~empty & ~outcome.finite
  norm = norm.astype(header.grad_norm.dtype)
  has_norm = ~empty & norm_finite & jnp.isfinite(norm)
  has_loss = stats.has_loss & jnp.isfinite(stats.loss)
  count = lambda flag, n: jnp.where(flag, optax.safe_increment(n), n)
  return header._replace(
    updated=outcome.applied,
    num_updates=count(outcome.applied, header.num_updates),
    num_skipped=count(skipped, header.num_skipped),
    window_loss=jnp.where(
      has_loss, stats.loss.astype(header.window_loss.dtype), header.window_loss
    ),
    has_window_loss=jnp.where(stats.has_loss, has_loss, header.has_window_loss),
    grad_norm=jnp.where(has_norm, norm, header.grad_norm),
    has_grad_norm=jnp.where(empty, header.has_grad_norm, has_norm),
  )


def _inner_update(call: Call, mean, inner_state, inner_args):
  """The inner optimizer once, its updates cast like plain ``inner``'s; ``ok`` if they are finite.

  ``ok`` is None where nothing was checked. With a 16-bit dtype (``_numerics.updates_finite``),
  a non-finite update or state skips the window: selected leafwise (XLA fuses the select into
  the inner optimizer's passes; a nested cond would copy the inner state). Under ZeRO-1 the
  inner optimizer runs on this device's shards and the updates are gathered after it.
  """
  config, dtypes, params = call.config, call.dtypes, call.params
  placement = config.placement
  inner = config.aggregation.inner_for(config.inner, mean)
  old = placement.unwrap(inner_state)
  updates, new_inner = placement.update(inner, mean, old, params, inner_args)
  updates = optax.tree.cast_like(updates, placement.like(dtypes.updates))
  new_inner = optax.tree.cast_like(new_inner, old)  # an fp16 moment stays fp16
  like = (placement.like(dtypes.mean), placement.like(dtypes.out))
  ok = _numerics.updates_finite(updates, new_inner, old, like, placement.local(params))
  if ok is not None:  # else True, with the device variance of the other branch's False
    ok = placement.all_true(ok)
    keep = lambda new, old: jnp.where(ok, new, old)
    updates = jax.tree.map(lambda u: keep(u, jnp.zeros((), u.dtype)), updates)
    new_inner = jax.tree.map(keep, new_inner, old)
  return placement.gather(updates, dtypes.updates), placement.wrap(new_inner), ok


class Dtypes(NamedTuple):
  """The window's dtypes (trace time): the ``mean`` handed to ``inner``, the ``updates`` plain
  ``inner.update`` returns, and the ``out`` of this call: the params (``Output.PARAMS``), or
  arrays like the updates built from the params (their sharding and device variance)."""

  mean: PyTree
  updates: PyTree
  out: PyTree

  @classmethod
  def of(cls, config, output, grads, state, params, value, extra) -> Dtypes:
    inner_args = dict(extra)
    if value is not None:
      inner_args["value"] = jnp.zeros((), _numerics.scalar_dtype())
    inner = config.aggregation.inner_for(config.inner, grads)
    plain = jax.eval_shape(
      lambda g, s, p: inner.update(g, s, p, **inner_args)[0],
      grads,
      config.placement.whole(inner, state.inner_state, grads),
      params,
    )
    mean = _numerics.mean_dtypes(grads, params)
    if output is _buffers.Output.PARAMS:
      return cls(mean, plain, params)
    like = grads if params is None else params
    return cls(mean, plain, jax.tree.map(lambda x, u: x.astype(u.dtype), like, plain))


# ------------------------------------------------------------------ input checks (trace time)


def check_inputs(config, grads: PyTree, state: Any, params: PyTree) -> None:
  """Raises unless ``state`` is this configuration's and ``grads``/``params`` match it."""
  if not isinstance(state, st.AccumulationState):
    raise TypeError(
      f"optax_accum.accumulate(...).update needs the state its init made (an "
      f"AccumulationState), got {type(state).__name__}. Pass the state returned by tx.init / "
      "tx.update."
    )
  acc = state.window.grad_sum if config.keeps_window else None
  check_trees(grads, acc, params, config.accumulator_dtype)
  # Structure only: the configuration lives in the closure, the state holds data.
  problems = _sub_state_problems(config, grads, state) or _inner_structure_problems(
    config, grads, state.inner_state
  )
  st.raise_on_problems(problems, "This optimizer state")
  config.placement.check_bound()
  _vma.check_replicated(params, config.axis_name)
  _vma.check_grads(grads, params, acc, config.axis_name)


def _sub_state_problems(config, grads: PyTree, state: st.AccumulationState) -> list[str]:
  """Which sub-states (and per-window sums) of ``state`` do not have the structure this
  configuration's features make."""
  want = jax.eval_shape(lambda: (config.sub_states(grads), config.window_sums(grads)))
  got = ({f: getattr(state, f) for f in want[0]}, {f: getattr(state.window, f) for f in want[1]})
  problems = []
  for where, w, g in (("", want[0], got[0]), ("window.", want[1], got[1])):
    for field in w:
      if jax.tree.structure(w[field]) != jax.tree.structure(g[field]):
        problems.append(
          f"its {where}{field} sub-state is {_kind(g[field])}, this configuration "
          f"({st.ARGUMENTS[field]}) makes {_kind(w[field])}"
        )
  sharded = isinstance(state.inner_state, st.Shards)
  if sharded != config.placement.sharded:
    how = lambda s: "sharded (shard_optimizer=True)" if s else "replicated"
    problems.append(
      f"its inner state is {how(sharded)}, this configuration's is {how(config.placement.sharded)}"
    )
  kept = not isinstance(state.window.grad_sum, optax.EmptyState)
  if kept != config.keeps_window:
    problems.append(
      "it holds "
      + ("an accumulator" if kept else "no accumulator (every_k=1)")
      + ", this configuration "
      + ("keeps one" if config.keeps_window else "keeps none (every_k=1)")
    )
  return problems


def _kind(sub: Any) -> str:
  """A sub-state's type in words (a tuple of several: their types)."""
  if isinstance(sub, tuple) and not hasattr(sub, "_fields"):
    return "(" + ", ".join(_kind(s) for s in sub) + ")" if sub else "()"
  return type(sub).__name__


def _inner_structure_problems(config, grads: PyTree, inner_state: Any) -> list[str]:
  """Whether ``inner_state`` has the structure this configuration's inner optimizer makes
  (``aggregate(reduce=...)`` wraps it in ``optax.masked``)."""
  inner = config.aggregation.inner_for(config.inner, grads)
  want = config.placement.wrap(jax.eval_shape(inner.init, grads))
  if jax.tree.structure(inner_state) == jax.tree.structure(want):
    return []
  sharded = lambda t: isinstance(t, st.Shards)
  if sharded(inner_state) != sharded(want):
    how = lambda t: "sharded (shard_optimizer=True)" if sharded(t) else "replicated"
    return [
      f"its inner state is {how(inner_state)}, this configuration's is {how(want)}: restore "
      "into the configuration that wrote it"
    ]
  return ["its inner state's structure is not this configuration's inner optimizer's"]


def check_trees(grads: PyTree, acc: PyTree | None, params: PyTree, override: Any) -> None:
  """Trace-time checks that grads match the accumulator (None: none is kept) and params."""
  g_struct = jax.tree.structure(grads)
  if acc is not None and g_struct != jax.tree.structure(acc):
    raise ValueError(
      "The gradient tree does not match the tree the optimizer state was initialized "
      f"with.\n  grads: {g_struct}\n  state: {jax.tree.structure(acc)}\nCall tx.init on "
      "params with the same structure as the gradients (e.g. the same nnx.Param filter)."
    )
  if params is not None and jax.tree.structure(params) != g_struct:
    raise ValueError(
      f"grads and params have different tree structures:\n  grads: {g_struct}\n  params: "
      f"{jax.tree.structure(params)}\nPass the params the gradients were taken with."
    )
  others = [t for t in (acc, params) if t is not None]
  if not others:
    return
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
  leaves = [jax.tree.leaves(t) for t in (grads, *others)]
  for name, g, *rest in zip(names, *leaves, strict=True):
    for other in rest:
      if np.shape(g) != np.shape(other):
        stacked = acc is not None and other is rest[0] and np.shape(other)[1:] == np.shape(g)
        raise ValueError(
          f"Gradient leaf {name} has shape {np.shape(g)} but the params/state have "
          f"{np.shape(other)}. "
          + (
            "The state holds a window per device (sharding.stack_windows): inside shard_map, "
            "pass tx.update sharding.local_state(opt_state) and return "
            "sharding.stacked_state(new_state)."
            if stacked
            else "Pass gradients of the same params the state was made for."
          )
        )
    wanted = _numerics.accumulator_dtype(g.dtype, override)  # a non-float gradient raises
    # The accumulator's dtype, or (every_k=1 keeps none) the one init makes from the params.
    a_dtype = (
      rest[0].dtype if acc is not None else _numerics.accumulator_dtype(rest[-1].dtype, override)
    )
    if _numerics.promote_types(a_dtype, wanted) != a_dtype:
      raise TypeError(
        f"Gradient leaf {name} is {g.dtype} but the accumulator is {a_dtype}, which "
        "cannot hold it (a complex gradient of a real param would lose its imaginary part). "
        "Re-initialize the state from params of the gradients' dtype, or set "
        "accumulator_dtype."
      )
