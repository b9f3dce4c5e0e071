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
