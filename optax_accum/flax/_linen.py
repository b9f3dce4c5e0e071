"""A Linen ``TrainState`` that passes microbatch weights and counts applied updates.

Unlike Flax's, it forwards ``weight`` and ``flush``, advances ``step`` only on applied windows
and takes the fused path (:func:`optax_accum.update_and_apply`); with ``accumulate`` in ``tx`` the
FP8 meta (Flax's ``_overwrite_with_gradient`` collection) goes through the window too, reduced by
``accumulate``'s per-leaf rules. See docs/flax.md and docs/aggregation.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

from optax_accum import _pitfalls
from optax_accum._actions import update_and_apply
from optax_accum._state import AccumulationState, find_states


class TrainState(train_state.TrainState):
  """Flax Linen ``TrainState`` for optimizers wrapped in :func:`optax_accum.accumulate`.

  Created like Flax's. ``step`` counts *applied updates* (``num_updates``, as schedules do): use
  it for EMA, evaluation and checkpoints. Without ``accumulate`` in ``tx`` it counts calls.

  FP8 (``params`` holding Flax's ``_overwrite_with_gradient`` collection, the meta of
  ``flax.linen.fp8_ops``): with ``accumulate`` in ``tx``, ``tx`` sees the whole variables tree,
  so the meta is reduced over the window by ``accumulate``'s rules (amax histories and scales:
  the window's max, the output-gradient history rescaled to the window's weight) and overwritten
  only when a window is applied: every microbatch of a window runs with the same meta, as the
  physical batch does. Without ``accumulate`` this is Flax's behaviour (the meta overwritten on
  every call, ``tx`` sees ``params['params']`` only).

  Attributes:
    step: applied updates since creation (int32 0-d array after the first call).
    apply_fn: usually ``model.apply``.
    params: the parameters.
    tx: the optimizer, typically ``optax_accum.accumulate(inner, every_k)``.
    opt_state: ``tx``'s state (holds the open window between calls).

  Examples:
    >>> import flax.linen as nn, optax, optax_accum, optax_accum.flax
    >>> model = nn.Dense(1)
    >>> x, y = jnp.ones((6, 2)), jnp.zeros((6, 1))
    >>> state = optax_accum.flax.TrainState.create(
    ...   apply_fn=model.apply, params=model.init(jax.random.key(0), x)['params'],
    ...   tx=optax_accum.accumulate(optax.adamw(1e-3), every_k=2))
    >>> loss = lambda p, x, y: ((state.apply_fn({'params': p}, x) - y) ** 2).mean()
    >>> for n in (4, 2, 3):  # microbatches of 4, 2 and 3 examples
    ...   state = state.apply_gradients(grads=jax.grad(loss)(state.params, x[:n], y[:n]),
    ...                                 weight=n)
    >>> int(state.step)  # one window of two microbatches applied, one open
    1
    >>> state = state.apply_gradients(  # the data ends: close the open window
    ...   grads=jax.grad(loss)(state.params, x[:1], y[:1]), weight=1, flush=True)
    >>> int(state.step)
    2
  """

  @classmethod
  def create(
    cls, *, apply_fn: Any, params: Any, tx: optax.GradientTransformation, **kwargs: Any
  ) -> TrainState:
    """Creates a state with ``step`` an int32 0-d zero and ``opt_state = tx.init(params)``.

    Args:
      apply_fn: usually ``model.apply``.
      params: the parameters (a tree of arrays).
      tx: the optimizer.
      **kwargs: other dataclass fields of a subclass.

    Returns:
      The new state; an int32 ``step`` (not Flax's ``0``) keeps a jitted step from recompiling.
      With FP8 meta in ``params`` and ``accumulate`` in ``tx``, ``opt_state = tx.init(params)``
      of the whole tree (Flax: of ``params['params']``).
    """
    step = jnp.zeros((), jnp.int32)
    if _has_owg(params) and find_states(jax.eval_shape(tx.init, params)):
      return cls(
        step=step, apply_fn=apply_fn, params=params, tx=tx, opt_state=tx.init(params), **kwargs
      )
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    return state.replace(step=step)

  def _apply(self, step_fn, grads: Any, **kwargs: Any) -> TrainState:
    # Flax's rule (the FP8 meta overwritten by every call's values) only without accumulate:
    # with it the meta goes through the window, and is overwritten at its boundary.
    owg = _has_owg(grads) and not find_states(self.opt_state)
    params = self.params["params"] if owg else self.params
    grads_opt = None if grads is None else (grads["params"] if owg else grads)
    _pitfalls.check_state(self.opt_state, AccumulationState)
    new_params, new_opt_state = step_fn(grads_opt, params)
    if owg:
      new_params = {"params": new_params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
    states = find_states(new_opt_state)
    if not states:  # a plain optax optimizer: every call is an update, as in Flax
      applied = jnp.ones((), jnp.int32)
    elif len(states) == 1:
      applied = states[0].updated.astype(jnp.int32)
    else:
      raise ValueError(
        f"tx contains {len(states)} optax_accum.accumulate transformations; TrainState "
        "counts the updates of exactly one."
      )
    return self.replace(
      step=self.step + applied, params=new_params, opt_state=new_opt_state, **kwargs
    )

  def apply_gradients(
    self, *, grads: Any, weight: Any = None, flush: Any = None, value: Any = None, **kwargs: Any
  ) -> TrainState:
    """Adds one microbatch's gradients; applies the window at its boundary.

    Args:
      grads: gradient of the microbatch's *mean* loss, a tree like ``params`` (with FP8, the
        gradient of the whole variables tree: its ``_overwrite_with_gradient`` part holds the
        microbatch's new meta).
      weight: examples or unmasked tokens that mean is over (a non-negative
        scalar, may be traced). None (default): not passed, ``accumulate``'s default 1:
        every microbatch weighs the same.
      flush: bool (may be traced); close the window after this microbatch even
        if it is incomplete (the last microbatch of the data). None: not passed (False).
      value: the microbatch's loss (optional): the window's weighted mean is
        ``metrics(state.opt_state).window_loss`` and the inner optimizer's ``value``
        (``optax.contrib.reduce_on_plateau``).
      **kwargs: other dataclass fields to ``.replace()``, as in Flax.

    Returns:
      A new state (params change only at a boundary); ``step`` + 1 if a window was applied.

    Raises:
      TypeError, ValueError: from ``tx.update`` (a bad weight, grads not matching the params).
      ValueError: if ``tx`` contains several ``accumulate`` transformations.
    """
    given = {"weight": weight, "flush": flush, "value": value}
    extra = {k: v for k, v in given.items() if v is not None}  # only what the caller gave
    return self._apply(
      lambda g, p: update_and_apply(self.tx, g, self.opt_state, p, **extra), grads, **kwargs
    )


def _has_owg(tree: Any) -> bool:
  """Whether ``tree`` (params or grads) holds Flax's FP8 ``_overwrite_with_gradient`` collection."""
  return isinstance(tree, Mapping) and OVERWRITE_WITH_GRADIENT in tree
