"""Applying updates only on the steps that made one.

Between window boundaries :func:`optax_accum.accumulate` emits exact zeros, and
``optax.apply_updates(params, zeros)`` still reads and writes every parameter:
on a memory-bound microstep that is as much traffic as the accumulation
itself. :func:`apply_if_updated` skips it with a ``lax.cond`` on
``metrics(opt_state).updated``. With the params donated to the jitted step
(``donate_argnums``), the untaken branch passes them through in place; without
donation XLA must copy them into a new output buffer anyway (see
docs/performance.md for measurements).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_accum import pitfalls
from optax_accum._accumulate import _APPLY_TO_PARAMS, AccumulationState
from optax_accum._state import metrics

PyTree = Any


def apply_if_updated(params: PyTree, updates: PyTree, opt_state: PyTree) -> PyTree:
  """``optax.apply_updates(params, updates)``, run only when ``tx.update`` applied an update.

  Use it in place of ``optax.apply_updates`` in a jitted train step whose
  params and optimizer state are donated, so that microsteps between window
  boundaries cost no more than accumulating the gradient:

  .. code-block:: python

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params, weight=batch_weight)
      params = optax_accum.apply_if_updated(params, updates, opt_state)
      return params, opt_state, loss

  The result equals ``optax.apply_updates(params, updates)`` whenever the
  updates are zero on calls where ``metrics(opt_state).updated`` is False. That
  holds when :func:`optax_accum.accumulate` is the last transformation of the
  chain (wrappers before it, such as ``optax.clip``, are fine); a transformation
  *after* it that turns zeros into non-zeros (``optax.add_decayed_weights``, say)
  would be skipped between boundaries, so put such transformations inside
  ``accumulate``'s inner optimizer instead.

  Under ``jax.vmap`` over optimizer states the ``lax.cond`` becomes a select and
  both branches run: the result is still exact, only the saving is lost.

  Args:
    params: the current params, a tree of arrays.
    updates: the updates returned by ``tx.update`` (same tree as ``params``).
    opt_state: the optimizer state returned by that same ``tx.update`` call: an
      :class:`optax_accum.AccumulationState` or any state containing exactly one
      (an ``optax.chain``'s, ``nnx.Optimizer.opt_state``).

  Returns:
    The new params: ``params + updates`` (cast like ``params``, as
    ``optax.apply_updates`` does) if the call applied an update, else
    ``params`` unchanged.

  Raises:
    ValueError: if ``opt_state`` holds no or several accumulation states.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> u, state = tx.update({'w': jnp.array([1., 3.])}, state, params)
    >>> params = optax_accum.apply_if_updated(params, u, state)  # skipped
    >>> params['w']
    Array([1., 1.], dtype=float32)
    >>> u, state = tx.update({'w': jnp.array([3., 1.])}, state, params)
    >>> optax_accum.apply_if_updated(params, u, state)['w']  # 1 - mean grad
    Array([-1., -1.], dtype=float32)
  """
  updated = metrics(opt_state).updated
  return jax.lax.cond(
    updated,
    lambda p, u: optax.apply_updates(p, u),
    lambda p, u: p,
    params,
    updates,
  )


def update_and_apply(
  tx: optax.GradientTransformation,
  grads: PyTree,
  opt_state: PyTree,
  params: PyTree,
  **extra_args: Any,
) -> tuple[PyTree, PyTree]:
  """``tx.update`` and ``optax.apply_updates`` in one, with no update buffer at all.

  When ``tx`` is an :func:`optax_accum.accumulate` transformation (its state an
  :class:`optax_accum.AccumulationState`), the params are passed through its
  ``lax.cond``: between boundaries they stay untouched in their (donated)
  buffer, and at a boundary the inner optimizer's last pass writes
  ``params + updates`` directly, without an intermediate updates tree. A
  microstep then costs what ``acc += weight * grads`` costs. For any other
  ``tx`` (an ``optax.chain`` containing ``accumulate``, say) it falls back to
  ``tx.update`` followed by :func:`apply_if_updated`.

  .. code-block:: python

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      params, opt_state = optax_accum.update_and_apply(
        tx, grads, opt_state, params, weight=batch_weight)
      return params, opt_state, loss

  Args:
    tx: the transformation (``accumulate(...)`` for the fused path).
    grads: gradient of the microbatch's mean loss, a tree like ``params``.
    opt_state: the state of ``tx``.
    params: the current params (required: they are what is updated).
    **extra_args: forwarded to ``tx.update`` (``weight``, ``flush``, ``value``,
      and extra args of the inner optimizer).

  Returns:
    ``(new_params, new_opt_state)``: the same values as
    ``u, s = tx.update(grads, opt_state, params, **extra_args)`` followed by
    ``optax.apply_updates(params, u)`` (with :func:`apply_if_updated`'s
    condition that updates are zero between boundaries).

  Raises:
    ValueError: as ``tx.update`` and :func:`apply_if_updated` do.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for g, w in ((jnp.array([1., 3.]), 1), (jnp.array([4., 0.]), 3)):
    ...   params, state = optax_accum.update_and_apply(tx, {'w': g}, state, params, weight=w)
    >>> params['w']  # 1 - (1 * [1, 3] + 3 * [4, 0]) / 4
    Array([-2.25, 0.25], dtype=float32)
  """
  if isinstance(opt_state, AccumulationState):
    return tx.update(grads, opt_state, params, **{_APPLY_TO_PARAMS: True}, **extra_args)
  pitfalls.check_transformation(tx)  # a clip before accumulate; the state is checked by metrics
  updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  return apply_if_updated(params, updates, opt_state), opt_state
