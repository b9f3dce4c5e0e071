"""``update_and_apply``: ``tx.update`` and ``optax.apply_updates`` in one call.

With :func:`optax_accum.accumulate`'s own transformation it takes the fused
path: the params go through ``accumulate``'s ``lax.cond``, so between boundaries
they stay untouched in their (donated) buffer, and at a boundary the inner
optimizer's last pass writes ``params + updates`` with no update tree in
between. Any other ``tx`` (a chain or wrapper around ``accumulate``, whose
members may change the updates) gets exactly ``tx.update`` followed by
``optax.apply_updates``. See docs/design.md and docs/performance.md.
"""

from __future__ import annotations

from typing import Any

import optax

from optax_accum import pitfalls
from optax_accum._accumulate import fused_update
from optax_accum._state import AccumulationState

PyTree = Any


def update_and_apply(
  tx: optax.GradientTransformation,
  grads: PyTree,
  opt_state: PyTree,
  params: PyTree,
  **extra_args: Any,
) -> tuple[PyTree, PyTree]:
  """``tx.update`` then ``optax.apply_updates``, fused when ``tx`` is ``accumulate``'s.

  The recommended train step (donate params and state, so that a microstep
  between boundaries costs what ``acc += weight * grads`` costs):

  .. code-block:: python

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      params, opt_state = optax_accum.update_and_apply(
        tx, grads, opt_state, params, weight=batch_weight)
      return params, opt_state, loss

  When ``tx`` is the transformation :func:`optax_accum.accumulate` returned,
  the params pass through its ``lax.cond`` (no update buffer is written); the
  result equals ``tx.update`` + ``optax.apply_updates`` (the same arithmetic,
  compiled in one program). For any other ``tx``, including an ``optax.chain``
  or a user wrapper containing ``accumulate``, it *is* ``tx.update`` followed by
  ``optax.apply_updates``: correct whatever the other members do to the
  updates, at the cost of re-writing the params with zero updates between
  boundaries (about 2x the fused path's traffic; docs/performance.md).
  Under ``jax.vmap`` over states the ``lax.cond`` becomes a select: still
  exact, only the saving is lost.

  Args:
    tx: any optax transformation; ``accumulate(...)`` itself for the fused path.
    grads: gradient of the microbatch's mean loss, a tree like ``params``.
    opt_state: the state of ``tx``.
    params: the current params (required: they are what is updated).
    **extra_args: forwarded to ``tx.update`` (``weight``, ``flush``, ``value``,
      and extra args of the inner optimizer).

  Returns:
    ``(new_params, new_opt_state)``, each with the structure and dtypes of its
    input (params cast like ``params``, as ``optax.apply_updates`` does).

  Raises:
    ValueError: if ``params`` is None on the fused path; otherwise what
      ``tx.update`` raises.

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
  fused = fused_update(tx)
  if fused is not None:
    return fused(grads, opt_state, params, **extra_args)
  pitfalls.check(tx, opt_state, AccumulationState)  # what sits around accumulate
  updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  return optax.apply_updates(params, updates), opt_state
