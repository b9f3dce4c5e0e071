"""The boundary of a window: close it (apply, skip or nothing), and the buffers it uses.

:func:`close` is the boundary branch of ``accumulate``'s ``lax.cond`` (the life of
a window is in docs/design.md, step 5): one all-reduce under ``axis_name``, one
pass for the global norm and the finite check, then the inner optimizer once
(applied), or zeros (skipped, empty). On the default path the updates travel in
the accumulator's buffer (:func:`stash_fits`, :func:`own_buffers`,
:func:`unstash`: the lazy reset, ``_buffers.stash``); on the fused path the
params are the output.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import _buffers, _noise_scale, _numerics, _vma, _window_weight

PyTree = Any


class Closed(NamedTuple):
  """What closing a window changes besides the output and the inner state."""

  updated: jax.Array
  num_updates: jax.Array
  num_skipped: jax.Array
  window_loss: jax.Array
  has_window_loss: jax.Array
  grad_norm: jax.Array
  has_grad_norm: jax.Array
  loss_scale: jax.Array
  growth_streak: jax.Array
  noise_trace_ema: jax.Array
  noise_signal_ema: jax.Array
  noise_ema_weight: jax.Array
  weight_seen: _window_weight.WeightCount
  window_weight: _window_weight.WeightCount


class Like(NamedTuple):
  """The dtypes of a window: the mean handed to ``inner`` and the updates it returns."""

  mean: PyTree  # _numerics.mean_dtypes: the wider of the grads' and params' dtypes
  updates: PyTree  # what plain inner.update returns for these grads (eval_shape)
  out: PyTree  # what this call returns: the params (fused) or ``updates``


def likes(config, grads, state, params, fused, value, extra_args) -> Like:
  """The window's dtypes (trace time, nothing computed): see :class:`Like`."""
  inner_args = dict(extra_args)
  if value is not None:
    inner_args["value"] = jnp.zeros((), _numerics.scalar_dtype())
  plain = jax.eval_shape(
    lambda g, s, p: config.inner.update(g, s, p, **inner_args)[0], grads, state.inner_state, params
  )
  # Zeros of the updates are built like the params (their sharding and device
  # variance); the cast is dead code XLA drops.
  like_out = grads if params is None else params
  zeros_like = jax.tree.map(lambda x, u: x.astype(u.dtype), like_out, plain)
  return Like(_numerics.mean_dtypes(grads, params), plain, params if fused else zeros_like)


def close(config, state, acc, window, inner_state, params, like, fits, value, extra_args):
  """The boundary: one finite check, then apply (inner once), skip or nothing (empty).

  ``fits`` is None on the fused path (the params are the output); else which
  update leaves go into the accumulator's buffer (``_buffers.stash``).
  """
  fused = fits is None
  sums = (acc, *window)
  if config.axis_name is not None:  # the window's one all-reduce
    sums = jax.lax.psum(sums, config.axis_name)
  g_sum, w_sum, v_sum, v_weight, w_parts, noise = sums
  denom = w_sum * state.loss_scale.astype(w_sum.dtype)
  norm, finite = _numerics.norm_and_finite(g_sum, denom)
  empty = w_sum == 0
  has_norm = ~empty & finite  # a NaN/Inf mean has no norm (an fp16 overflow has one)
  # The mean goes to the inner optimizer in the wider of the grads' and params' dtypes:
  # it must fit there too.
  finite = finite & _numerics.fits(g_sum, denom, norm, config.clip_norm, like.mean)
  apply = ~empty & (finite | (not config.skip_nonfinite))
  window_value = jnp.where(v_weight > 0, _numerics.guarded_divide(v_sum, v_weight), jnp.nan)
  inner_args = dict(extra_args)
  if value is not None:
    inner_args["value"] = window_value

  def run_inner(operands):
    acc, inner_state = operands
    mean = _numerics.window_mean(g_sum, denom, norm, config.clip_norm, like.mean)
    updates, new_inner = config.inner.update(mean, inner_state, params, **inner_args)
    updates = optax.tree.cast_like(updates, like.updates)
    # The inner state keeps its dtypes (an fp16 param's Adam moments stay fp16).
    new_inner = optax.tree.cast_like(new_inner, inner_state)
    ok = None
    if config.skip_nonfinite:
      ok = _numerics.updates_finite(updates, new_inner, inner_state, (like.mean, like.out))
    if ok is not None:  # narrow dtypes: a non-finite update or state skips the window
      # Selected leafwise (XLA fuses the select into the inner optimizer's passes; a
      # nested cond would copy the inner state).
      keep = lambda new, old: jnp.where(ok, new, old)
      updates = jax.tree.map(lambda u: keep(u, jnp.zeros((), u.dtype)), updates)
      new_inner = jax.tree.map(keep, new_inner, inner_state)
    else:
      ok = jnp.ones_like(apply)
    if fused:  # params + updates, written by the inner optimizer's last pass
      return optax.apply_updates(params, updates), None, new_inner, ok
    # The updates go into the accumulator's buffer: the window's sum is dead now.
    return own_buffers(updates, fits), _buffers.stash(updates, acc, fits), new_inner, ok

  def keep_inner(operands):
    acc, inner_state = operands
    if fused:
      return params, None, inner_state, jnp.zeros_like(apply)
    # A skipped window's sum is zeroed: nothing of it stays in the state. (This write
    # makes XLA copy the updates into the accumulator at every boundary, one pass.)
    out = own_zeros(like.out, fits, apply)
    return out, _buffers.distinct_zeros(acc, apply), inner_state, jnp.zeros_like(apply)

  out, acc_out, inner_state, ok = jax.lax.cond(apply, run_inner, keep_inner, (acc, inner_state))
  if fused:  # the sum is reset to zeros, written once the inner optimizer has read it
    # (they wait for a token read from its output), so into the accumulator's own buffer
    acc_out = _buffers.distinct_zeros(acc, _buffers.read_token((inner_state, out)))
  applied = apply & ok
  finite = finite & (ok | ~apply)
  skipped = ~empty & ~finite & config.skip_nonfinite
  scale, streak = state.loss_scale, state.growth_streak
  if config.loss_scale is not None:
    new_scale, new_streak = config.loss_scale.adjust(scale, streak, finite)
    scale, streak = jnp.where(empty, scale, new_scale), jnp.where(empty, streak, new_streak)
  # Nothing non-finite enters the state: "no value" is a flag (issue 11, item 1).
  norm = norm.astype(state.grad_norm.dtype)
  has_norm = has_norm & jnp.isfinite(norm)
  has_loss = (v_weight > 0) & jnp.isfinite(window_value)
  closed = Closed(
    updated=applied,
    num_updates=jnp.where(applied, optax.safe_increment(state.num_updates), state.num_updates),
    num_skipped=jnp.where(skipped, optax.safe_increment(state.num_skipped), state.num_skipped),
    window_loss=jnp.where(has_loss, window_value, state.window_loss),
    has_window_loss=jnp.where(v_weight > 0, has_loss, state.has_window_loss),
    grad_norm=jnp.where(has_norm, norm, state.grad_norm),
    has_grad_norm=jnp.where(empty, state.has_grad_norm, has_norm),
    loss_scale=scale,
    growth_streak=streak,
    **close_noise(config, state, noise, w_sum, norm, finite & ~empty),
    # The window's (global) weight, counted exactly; an empty window changes nothing.
    weight_seen=_window_weight.count_parts(state.weight_seen, w_parts),
    window_weight=jax.tree.map(
      lambda new, old: jnp.where(empty, old, new),
      _window_weight.count_parts(_window_weight.zeros(), w_parts),
      state.window_weight,
    ),
  )
  return out, acc_out, inner_state, closed


def stash_fits(like_out: PyTree, acc: PyTree) -> PyTree:
  """Which update leaves the accumulator's buffer holds: dtype and device variance allow.

  Under ``shard_map`` with ``axis_name`` the accumulator is per device while the
  updates are replicated; those leaves get a buffer of their own.
  """
  fits = _buffers.stash_fits(like_out, acc)
  same = lambda f, u, a: f and _vma.varying(u) == _vma.varying(a)
  return jax.tree.map(same, fits, like_out, acc)


def own_buffers(updates: PyTree, fits: PyTree) -> PyTree:
  """The update leaves that travel in a buffer of their own (None where acc holds them)."""
  return jax.tree.map(lambda f, u: None if f else u, fits, updates)


def own_zeros(like_out: PyTree, fits: PyTree, flag: jax.Array) -> PyTree:
  """Exact zero updates for the leaves with a buffer of their own (None where acc holds them)."""
  return own_buffers(_buffers.distinct_zeros(like_out, flag), fits)


def unstash(own: PyTree, acc: PyTree, fits: PyTree, like: PyTree, updated: jax.Array) -> PyTree:
  """The updates: read from ``acc`` (selected by ``updated``, else exact zeros) or ``own``."""

  def leaf(f, o, a, u):
    if not f:
      return o
    return jnp.where(updated, a.astype(u.dtype), jnp.zeros((), u.dtype))

  return jax.tree.map(leaf, fits, own, acc, like, is_leaf=lambda x: x is None)


def close_noise(config, state, noise, w_sum, norm, ok) -> dict[str, jax.Array]:
  """The noise scale's EMA fields after the window (unchanged when it is off or not ``ok``)."""
  ema = tuple(getattr(state, f) for f in _noise_scale.EMA)
  if noise:
    est = _noise_scale.estimate(*noise, w_sum, norm, state.loss_scale)
    ema = _noise_scale.ema_update(ema, est, config.noise_decay, ok)
  return dict(zip(_noise_scale.EMA, ema, strict=True))
