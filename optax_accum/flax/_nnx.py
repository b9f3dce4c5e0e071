"""Flax NNX: :class:`Optimizer`, ``nnx.Optimizer`` on the fused path with ``step`` counting updates.

A plain ``nnx.Optimizer(model, optax_accum.accumulate(...), wrt=nnx.Param)`` is
also correct, but its ``step`` counts microbatches: read
``optax_accum.metrics(opt.opt_state).num_updates`` instead (docs/flax.md).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from optax_accum import _pitfalls
from optax_accum._actions import update_and_apply
from optax_accum._state import find_states
from optax_accum.flax._in_step import as_pure as _as_pure


def _state(optimizer: nnx.Optimizer, node: Any, *filters: Any) -> Any:
  """``nnx.state(node, *filters)`` in the optimizer's graph mode, where Flax has one (>= 0.12)."""
  graph = getattr(optimizer, "graph", None)
  if graph is None:
    return nnx.state(node, *filters)
  # pyrefly: ignore[no-matching-overload]  # Flax < 0.12's nnx.state has no graph= (not run there)
  return nnx.state(node, *filters, graph=graph)


def _arrays(optimizer: nnx.Optimizer, model: Any) -> tuple[Any, Any]:
  """The ``wrt`` params of ``model`` and the optimizer state, as plain arrays."""
  return _as_pure(_state(optimizer, model, optimizer.wrt)), _as_pure(optimizer.opt_state)


def _commit(optimizer: nnx.Optimizer, model: Any, params: Any, opt_state: Any) -> None:
  """Writes new params into ``model`` and the new state into ``optimizer``, in place."""
  nnx.update(model, params)
  nnx.update(optimizer.opt_state, _state(optimizer, opt_state))


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` on the fused path; ``step`` counts applied updates.

  Same constructor and ``update(model, grads, **kwargs)`` as ``nnx.Optimizer``; ``kwargs`` go to
  ``tx.update`` (``weight``, ``flush``, ``value``, ...). ``update`` is
  :func:`optax_accum.update_and_apply` (see it). Close the last window with ``flush=True``, or
  drop it with ``opt.opt_state = optax_accum.discard(opt.opt_state)``.

  ``step`` counts *applied updates* (as a schedule does): use it for EMA, evaluation and
  checkpoints; the data position is ``metrics(opt.opt_state).num_microbatches``. With a ``tx``
  holding no ``accumulate``, ``step`` counts calls, as in Flax.

  Attributes:
    step: ``OptState`` uint32, applied updates since creation.
    tx: the optimizer, typically ``optax_accum.accumulate(inner, every_k)``.
    opt_state: ``tx``'s state (holds the open window between calls).

  Examples:
    >>> import optax, optax_accum, optax_accum.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
    >>> model.kernel[...] = jnp.zeros((1, 1))
    >>> opt = optax_accum.flax.Optimizer(
    ...   model, optax_accum.accumulate(optax.sgd(1.0), every_k=2), wrt=nnx.Param)
    >>> grad_fn = nnx.grad(lambda m, g: (m(jnp.ones((1, 1))) * g).sum())  # gradient g
    >>> for g, n in ((1.0, 3), (5.0, 1)):  # one window of 2
    ...   opt.update(model, grad_fn(model, g), weight=n)
    >>> model.kernel[...], int(opt.step[...])  # -(3 * 1 + 1 * 5) / 4; one update
    (Array([[-2.]], dtype=float32), 1)
    >>> opt.update(model, grad_fn(model, 7.0), weight=2, flush=True)  # the data ends
    >>> model.kernel[...], int(opt.step[...])  # the incomplete window's mean is 7
    (Array([[-9.]], dtype=float32), 2)
  """

  def __init__(self, model: Any, tx: Any, *args: Any, **kwargs: Any):
    with _pitfalls.counting_updates():  # this `step` counts applied updates: nothing to warn
      super().__init__(model, tx, *args, **kwargs)

  # pyrefly: ignore[bad-override]  # returns None, not Flax's updates: the fused step makes none
  def update(self, model: Any, grads: Any, /, **kwargs: Any) -> None:
    """Adds one microbatch's gradients; at a boundary updates ``model`` in place.

    Args:
      model: the model the optimizer was created for.
      grads: the gradients from ``nnx.grad`` (of the microbatch's mean loss).
      **kwargs: forwarded to ``tx.update`` (``weight``, ``flush``, ``value``, ...).

    Returns:
      None (the fused path writes no updates); ``model`` changes at a boundary.

    Raises:
      TypeError, ValueError: from ``tx.update`` (a bad weight, grads not matching the params).
      ValueError: if ``tx`` contains several ``accumulate`` transformations.
    """
    params, opt_state = _arrays(self, model)
    grads = _as_pure(_state(self, grads, self.wrt))
    self._step(
      model, params, update_and_apply(self.tx, grads, opt_state, params, **_as_pure(kwargs))
    )

  def _step(self, model: Any, params: Any, result: tuple[Any, Any]) -> None:
    new_params, new_opt_state = result
    _commit(self, model, new_params, new_opt_state)
    states = find_states(new_opt_state)
    if len(states) > 1:
      raise ValueError(
        f"tx contains {len(states)} optax_accum.accumulate transformations; Optimizer "
        "counts the updates of exactly one."
      )
    applied = states[0].updated if states else True
    self.step[...] += jax.numpy.asarray(applied).astype(self.step[...].dtype)
