"""One microstep of :func:`optax_accum.accumulate` and the boundary that closes a window.

Read top to bottom, :func:`step` is the life of a microbatch: check the
inputs, add ``weight * grads`` to the window, decide whether this microbatch
closes it, and run ``lax.cond(boundary, close, between)``; :func:`close` is the
boundary: one all-reduce under ``axis_name``, one pass for the global norm and
the finite check, then the inner optimizer once (applied) or not at all
(skipped, empty), and the counters and features' sub-states. Where the output
lives is one explicit mode (``_buffers.Output``: the updates for ``tx.update``,
the params for ``update_and_apply``); the arithmetic is ``_numerics``'s, the
device-variance typing ``_vma``'s. docs/design.md maps the modules.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import (
  _aggregation,
  _buffers,
  _checks,
  _guard,
  _loss_scale,
  _noise_scale,
  _numerics,
  _rule_groups,
  _vma,
)
from optax_accum import _state as st
from optax_accum import _weight_count as wc
from optax_accum import _window_weight as ww

PyTree = Any


def run(config, output, compiled, grads, state, params, extra):
  """:func:`step`, or, for an eager call, its program compiled once per configuration.

  Under a trace this is :func:`step`. Eagerly, the checks of concrete values (the state's
  fingerprint, the weight) run here and the step runs as ``compiled[output]``, ``accumulate``'s
  cached ``jax.jit`` of :func:`step`, instead of tracing both ``lax.cond`` branches each call.
  """
  if not _concrete((grads, state, params, extra)):
    return step(config, output, grads, state, params, **extra)
  check_inputs(config, grads, state, params)
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


def _is_traced(tree: PyTree) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


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
  _guard.check_call(config.guard, value)
  # The sum is added outside the cond: one fused, in-place pass over the donated
  # accumulator, which reads it as zeros if the window was empty (the lazy reset)
  # and which `between` passes through untouched.
  window = add_microbatch(config, state, grads, w, value)
  mini_step = state.mini_step + 1
  weight_seen = state.token_budget.weight_seen if config.budget is not None else None
  budget_reached = ww.reached(
    config.budget, window.weight_sum, state.num_updates, weight_seen, config.axis_name
  )
  boundary = (mini_step >= config.window_length(state.num_updates)) | budget_reached | flush
  dtypes = Dtypes.of(config, output, grads, state, params, value, extra)
  place = _buffers.placement(output, dtypes.out, window.grad_sum)
  header = state._replace(window=None, inner_state=None)  # what closing a window changes

  def between(operands):
    grad_sum, inner_state = operands
    # zeros_like keeps the fields' device variance: both branches agree under shard_map.
    unchanged = header._replace(updated=jnp.zeros_like(state.updated))
    return place.between(params, boundary), grad_sum, inner_state, unchanged

  # A flush of a window that holds no microbatch closes nothing, even with apply_empty.
  nothing_to_close = flush & (state.mini_step == 0)

  def boundary_branch(operands):
    return close(
      config, place, dtypes, header, window, operands, params, value, extra, nothing_to_close
    )

  operands = (window.grad_sum, state.inner_state)
  branches = _vma.agree((boundary_branch, between), operands, (grads, state, params, w, extra))
  out, grad_sum, inner_state, closed = jax.lax.cond(boundary, *branches, operands)

  def reset(x):  # the window's sums, zero again after a boundary (the buffer: lazily)
    return jnp.where(boundary, jnp.zeros_like(x), x)

  sums = jax.tree.map(reset, window._replace(grad_sum=None))
  new_state = closed._replace(
    mini_step=reset(mini_step),
    window=sums._replace(grad_sum=grad_sum),
    num_microbatches=optax.safe_increment(state.num_microbatches),
    inner_state=inner_state,
  )
  return place.result(out, grad_sum, closed.updated), new_state


def add_microbatch(config, state, grads, w, value) -> st.Window:
  """The open window with this microbatch added: ``grad_sum += w * g``, ``weight_sum += w``."""
  window = state.window
  rules = config.aggregation.rules(grads)
  new = window._replace(
    grad_sum=_aggregation.add(rules, state.window_sum, grads, w, window.weight_sum == 0),
    weight_sum=window.weight_sum + w,
  )
  if value is not None:
    new = new._replace(
      value_sum=_numerics.weighted_add(window.value_sum, value, w),
      value_weight=window.value_weight + w,
    )
  if config.budget is not None:  # the window's weight, exact
    new = new._replace(weight_parts=wc.add_parts(window.weight_parts, w))
  if config.noise_decay is not None:  # one scalar per microbatch, from the same cast gradient
    new = new._replace(noise=_noise_scale.add(window.noise, window.grad_sum, grads, w))
  return new


def close(config, place, dtypes, header, window, operands, params, value, extra, nothing_to_close):
  """The boundary: one finite check, then apply (inner once), skip or nothing (empty).

  Returns ``(output, grad_sum, inner_state, header)``, the header being the state's scalars
  and sub-states after the window (``window`` and ``inner_state`` None).
  """
  grad_sum, inner_state = operands
  agg = config.aggregation
  split = _rule_groups.Split.of(agg, grad_sum)
  sums = window._replace(grad_sum=grad_sum)
  if config.axis_name is not None:  # the window's all-reduce (a pmax first for max/last leaves)
    sums = _all_reduce(split.rules, sums, config.axis_name)
  scale = header.loss_scale.scale if config.loss_scale is not None else jnp.ones((), jnp.float32)
  d = agg.value(sums.weight_sum, header.num_updates)  # the weight sum, or the fixed denominator
  norm, finite = split.norm_and_finite(sums.grad_sum, d, scale)
  finite = finite & agg.usable(d)  # a schedule's traced value <= 0 or not finite: skipped
  empty = sums.weight_sum == 0
  has_norm = ~empty & finite  # a NaN/Inf mean has no norm (an fp16 overflow has one)
  # The mean goes to the inner optimizer in dtypes.mean: it must fit there too.
  finite = finite & split.fits(sums.grad_sum, d, scale, norm, config.clip_norm, dtypes.mean)
  has_value = sums.value_weight > 0
  value_denom = sums.value_weight if agg.denominator is None else d
  window_value = jnp.where(has_value, _numerics.guarded_divide(sums.value_sum, value_denom), 0)
  fdt = _numerics.scalar_dtype()
  stats = _guard.WindowStats(
    norm.astype(fdt), window_value.astype(fdt), has_value, sums.weight_sum, header.num_updates
  )
  spike = jnp.zeros((), jnp.bool_)
  if config.guard:  # a finite window the guard skips: nothing but num_spikes changes
    spike = ~empty & finite & _guard.judge(config.guard, header.guard, stats)
  runs = ~empty | (agg.apply_empty & ~nothing_to_close)  # DP-SGD applies an empty window
  apply = runs & (finite | (not config.skip_nonfinite)) & ~spike
  inner_args = dict(extra)
  if value is not None:
    inner_args["value"] = jnp.where(has_value, window_value, jnp.nan)

  def run_inner(ops):
    grad_sum, inner_state = ops
    mean = split.window_values(sums.grad_sum, d, scale, norm, config.clip_norm, dtypes.mean)
    updates, new_inner, ok = _inner_update(config, dtypes, mean, inner_state, params, inner_args)
    updates = split.overwrite_updates(updates, mean, params, empty)  # max/last: value - param
    out, grad_sum = place.applied(updates, params, grad_sum)
    out = place.overwrite(split, out, mean, params, empty)  # exact on the fused path
    return out, grad_sum, new_inner, jnp.ones_like(apply) if ok is None else ok

  def keep_inner(ops):
    grad_sum, inner_state = ops
    out, grad_sum = place.skipped(params, grad_sum, apply)
    return out, grad_sum, inner_state, jnp.zeros_like(apply)

  out, new_sum, inner_state, ok = jax.lax.cond(apply, run_inner, keep_inner, operands)
  new_sum = place.after_inner(grad_sum, new_sum, inner_state, out)
  applied = apply & ok
  finite = finite & (ok | ~apply)
  skipped = ~empty & ~finite & config.skip_nonfinite
  # Nothing non-finite enters the state: "no value" is a flag.
  norm = norm.astype(header.grad_norm.dtype)
  has_norm = has_norm & jnp.isfinite(norm)
  has_loss = has_value & jnp.isfinite(window_value)
  count = lambda flag, n: jnp.where(flag, optax.safe_increment(n), n)
  header = header._replace(
    updated=applied,
    num_updates=count(applied, header.num_updates),
    num_skipped=count(skipped, header.num_skipped),
    window_loss=jnp.where(has_loss, window_value, header.window_loss),
    has_window_loss=jnp.where(has_value, has_loss, header.has_window_loss),
    grad_norm=jnp.where(has_norm, norm, header.grad_norm),
    has_grad_norm=jnp.where(empty, header.has_grad_norm, has_norm),
  )
  if config.loss_scale is not None:
    header = header._replace(
      loss_scale=_loss_scale.close(config.loss_scale, header.loss_scale, finite, empty | spike)
    )
  if config.budget is not None:
    header = header._replace(token_budget=ww.close(header.token_budget, sums.weight_parts, empty))
  if config.noise_decay is not None:
    noise = _noise_scale.close(
      header.noise_scale, sums.noise, sums.weight_sum, norm, scale, config.noise_decay,
      finite & ~empty & ~spike,
    )  # fmt: skip
    header = header._replace(noise_scale=noise)
  if config.guard:
    header = header._replace(guard=_guard.close(config.guard, header.guard, stats, applied, spike))
  return out, new_sum, inner_state, header


def _all_reduce(rules: tuple[str, ...], sums: st.Window, axis_name) -> st.Window:
  """The window summed over ``axis_name`` (one variadic ``psum``; max/last leaves: a ``pmax``
  first, ``_aggregation.reduce_devices``)."""
  grads, rest = _aggregation.reduce_devices(
    rules,
    sums.grad_sum,
    sums._replace(grad_sum=None),
    sums.weight_sum > 0,
    jax.lax.axis_index(axis_name),
    lambda t: jax.lax.psum(t, axis_name),
    lambda t: jax.lax.pmax(t, axis_name),
  )
  return rest._replace(grad_sum=grads)


def _inner_update(config, dtypes, mean, inner_state, params, inner_args):
  """The inner optimizer once, its updates cast like plain ``inner``'s; ``ok`` if they are finite.

  ``ok`` is None where nothing was checked. With a 16-bit dtype (``_numerics.updates_finite``),
  a non-finite update or state skips the window: selected leafwise (XLA fuses the select into
  the inner optimizer's passes; a nested cond would copy the inner state).
  """
  inner = config.aggregation.inner_for(config.inner, mean)
  updates, new_inner = inner.update(mean, inner_state, params, **inner_args)
  updates = optax.tree.cast_like(updates, dtypes.updates)
  new_inner = optax.tree.cast_like(new_inner, inner_state)  # an fp16 moment stays fp16
  ok = None
  if config.skip_nonfinite:
    like = (dtypes.mean, dtypes.out)
    ok = _numerics.updates_finite(updates, new_inner, inner_state, like, params)
  if ok is None:  # True, with the device variance of the other branch's False
    return updates, new_inner, None
  keep = lambda new, old: jnp.where(ok, new, old)
  updates = jax.tree.map(lambda u: keep(u, jnp.zeros((), u.dtype)), updates)
  return updates, jax.tree.map(keep, new_inner, inner_state), ok


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
      state.inner_state,
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
      f"accumulate's update needs its AccumulationState, got {type(state).__name__}. "
      "Pass the state returned by tx.init / tx.update."
    )
  check_trees(grads, state.window.grad_sum, params, config.accumulator_dtype)
  features = (
    ("loss_scale", config.loss_scale is not None, "loss_scale"),
    ("token_budget", config.budget is not None, "window_weight"),
    ("noise_scale", config.noise_decay is not None, "noise_scale_decay"),
    ("guard", bool(config.guard), "skip_if"),
    ("aggregation", config.aggregation.active(grads), "denominator=/reduce"),
  )
  problems = []
  for field, on, arg in features:
    if isinstance(getattr(state, field), optax.EmptyState) == on:
      problems.append(f"the state {'lacks' if on else 'has'} the sub-state of {arg}=")
  got = st.fingerprint_of(state.every_k, state.loss_scale)
  if got is not None and not problems and not _is_traced(state.aggregation):
    got = got._replace(aggregation=_aggregation.fingerprint(state.aggregation))
    want = config.fingerprint._replace(aggregation=config.aggregation.fingerprint(grads))
    problems = st.fingerprint_problems(got, want)
  elif not problems:  # traced values (under jit): what can be compared is the structure
    problems = _inner_structure_problems(config, grads, state.inner_state)
  st.raise_on_problems(problems, "This optimizer state")
  _vma.check_replicated(params, config.axis_name)
  _vma.check_grads(grads, params, state.window.grad_sum, config.axis_name)


def _inner_structure_problems(config, grads: PyTree, inner_state: Any) -> list[str]:
  """Whether ``inner_state`` has the structure this configuration's inner optimizer makes
  (``reduce=`` wraps it in ``optax.masked``); the fingerprint's values are traced under jit."""
  inner = config.aggregation.inner_for(config.inner, grads)
  if jax.tree.structure(inner_state) == jax.tree.structure(jax.eval_shape(inner.init, grads)):
    return []
  return ["its inner state's structure is not this configuration's inner optimizer's"]


def check_trees(grads: PyTree, acc: PyTree, params: PyTree, override: Any) -> None:
  """Trace-time checks that grads match the accumulator (and params)."""
  g_struct = jax.tree.structure(grads)
  if g_struct != jax.tree.structure(acc):
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
  others = [acc] if params is None else [acc, params]
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
  leaves = [jax.tree.leaves(t) for t in (grads, *others)]
  for name, g, *rest in zip(names, *leaves, strict=True):
    for other in rest:
      if np.shape(g) != np.shape(other):
        stacked = other is rest[0] and np.shape(other)[1:] == np.shape(g)
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
    a = rest[0]
    if _numerics.promote_types(a.dtype, _numerics.accumulator_dtype(g.dtype, override)) != a.dtype:
      raise TypeError(
        f"Gradient leaf {name} is {g.dtype} but the accumulator is {a.dtype}, which "
        "cannot hold it. Re-initialize the state from params of the gradients' dtype, or "
        "set accumulator_dtype."
      )
