"""Flax NNX: :class:`Optimizer` (the fused path) and helpers for a plain ``nnx.Optimizer``.

:class:`Optimizer` is ``nnx.Optimizer`` with the same constructor and
``update(model, grads, **kwargs)``, whose update is
:func:`optax_accum.update_and_apply` (no update buffer; params untouched
between boundaries) and whose ``step`` counts applied updates.

A plain ``nnx.Optimizer(model, optax_accum.accumulate(...), wrt=nnx.Param)``
also gives correct results (its ``update`` is ``tx.update`` +
``optax.apply_updates``, about 2.3x the fused path's memory traffic between
boundaries, docs/performance.md); its ``step`` counts *microbatches*, so read
:func:`num_updates` for schedules, EMA, evaluation and checkpoints, and use
:func:`flush` / :func:`discard` to close or drop its open window in place.

See docs/design.md for the module map.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from optax_accum import pitfalls
from optax_accum._metrics import metrics as _metrics
from optax_accum._state import discard as _discard_state
from optax_accum._state import find_states, flush_with
from optax_accum._train_step import update_and_apply


def _graph(optimizer: nnx.Optimizer) -> bool | None:
  # `graph` exists since Flax 0.12; None means "the current nnx graph mode".
  return getattr(optimizer, "graph", None)


def _arrays(optimizer: nnx.Optimizer, model: Any) -> tuple[Any, Any]:
  """The ``wrt`` params of ``model`` and the optimizer state, as plain arrays."""
  graph = _graph(optimizer)
  return nnx.as_pure(nnx.state(model, optimizer.wrt, graph=graph)), nnx.as_pure(optimizer.opt_state)


def _commit(optimizer: nnx.Optimizer, model: Any, params: Any, opt_state: Any) -> None:
  """Writes new params into ``model`` and the new state into ``optimizer``, in place."""
  nnx.update(model, params)
  nnx.update(optimizer.opt_state, nnx.state(opt_state, graph=_graph(optimizer)))


def num_updates(optimizer: nnx.Optimizer) -> jax.Array:
  """The number of applied updates (closed, finite windows) of an ``nnx.Optimizer``.

  ``optimizer.step`` counts every ``optimizer.update`` call, one per
  microbatch; this counts what a learning-rate schedule, an EMA, evaluation or
  a checkpoint interval should count.

  Args:
    optimizer: an ``nnx.Optimizer`` whose ``tx`` contains exactly one
      :func:`optax_accum.accumulate`.

  Returns:
    An int32 0-d array (works inside ``nnx.jit``).

  Raises:
    ValueError: if the optimizer state holds no or several accumulation states.

  Examples:
    >>> import optax, optax_accum, optax_accum.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax_accum.accumulate(optax.sgd(0.1), every_k=2),
    ...                     wrt=nnx.Param)
    >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
    >>> for _ in range(3):
    ...   _ = opt.update(model, grads, weight=4)
    >>> int(opt.step[...]), int(optax_accum.flax.num_updates(opt))  # microbatches, updates
    (3, 1)
  """
  pitfalls.check_transformation(optimizer.tx)
  return _metrics(optimizer.opt_state).num_updates


def flush(optimizer: nnx.Optimizer, model: Any, **extra_args: Any) -> optax.Updates:
  """Closes the open window of ``optimizer`` and applies it to ``model`` in place.

  Use it after the last microbatch of an epoch or of training: the window mean
  divides by the weight accumulated so far (:func:`optax_accum.flush`). Like
  ``optimizer.update`` it mutates ``model``'s params and ``optimizer.opt_state``
  and works inside ``nnx.jit``. ``optimizer.step`` is not incremented (no
  microbatch was consumed). An empty window is a no-op.

  Args:
    optimizer: an ``nnx.Optimizer`` whose ``tx`` contains one
      :func:`optax_accum.accumulate`.
    model: the model the optimizer was created for.
    **extra_args: forwarded to ``tx.update`` (and to the inner optimizer).

  Returns:
    The applied updates, a ``State`` of arrays like the ``wrt`` params (zeros
    when the window was empty).

  Raises:
    ValueError: if ``optimizer.opt_state`` holds no
      :class:`optax_accum.AccumulationState` (flushing a plain optimizer would
      run a real step on zero gradients); as :func:`optax_accum.flush`.

  Examples:
    >>> import optax, optax_accum, optax_accum.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
    >>> model.kernel[...] = jnp.zeros((1, 1))
    >>> opt = nnx.Optimizer(model, optax_accum.accumulate(optax.sgd(1.0), every_k=4),
    ...                     wrt=nnx.Param)
    >>> grad_fn = nnx.grad(lambda m, g: (m(jnp.ones((1, 1))) * g).sum())  # gradient g
    >>> for g, n in ((1.0, 3), (5.0, 1)):  # 2 of 4 microbatches, then the data ends
    ...   _ = opt.update(model, grad_fn(model, g), weight=n)
    >>> _ = optax_accum.flax.flush(opt, model)
    >>> model.kernel[...]  # -(3 * 1 + 1 * 5) / 4
    Array([[-2.]], dtype=float32)
  """
  params, opt_state = _arrays(optimizer, model)
  updates, new_opt_state = flush_with(
    optimizer.tx.update, opt_state, params, nnx.as_pure(extra_args)
  )
  _commit(optimizer, model, optax.apply_updates(params, updates), new_opt_state)
  return updates


def discard(optimizer: nnx.Optimizer) -> None:
  """Drops the open window of ``optimizer`` in place (:func:`optax_accum.discard`).

  Its gradients, weights and losses are forgotten; params, the inner state,
  counters and the loss scale are unchanged. Works inside ``nnx.jit``.

  Args:
    optimizer: an ``nnx.Optimizer`` whose ``tx`` contains
      :func:`optax_accum.accumulate`.

  Returns:
    None; ``optimizer.opt_state`` is updated in place. It raises nothing: an
    optimizer without an ``accumulate`` state is left unchanged.

  Examples:
    >>> import optax, optax_accum, optax_accum.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax_accum.accumulate(optax.sgd(0.1), every_k=4),
    ...                     wrt=nnx.Param)
    >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
    >>> _ = opt.update(model, grads, weight=3)
    >>> optax_accum.flax.discard(opt)
    >>> m = optax_accum.metrics(opt.opt_state)
    >>> int(m.mini_step), float(m.pending_weight)
    (0, 0.0)
  """
  new_opt_state = _discard_state(nnx.as_pure(optimizer.opt_state))
  nnx.update(optimizer.opt_state, nnx.state(new_opt_state, graph=_graph(optimizer)))


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` on the fused path; ``step`` counts applied updates.

  Same constructor as ``nnx.Optimizer`` (``Optimizer(model, tx, wrt=nnx.Param)``)
  and the same ``update(model, grads, **kwargs)`` signature; ``kwargs`` go to
  ``tx.update`` (``weight``, ``flush``, ``value``, the inner optimizer's extra
  args). With ``tx = optax_accum.accumulate(...)``, ``update`` is
  :func:`optax_accum.update_and_apply`: between boundaries the params are not
  touched and no update tree is written, so a microstep costs what
  ``acc += weight * grads`` costs. With any other ``tx`` (a chain around
  ``accumulate``, a plain optimizer) it is ``tx.update`` +
  ``optax.apply_updates``, as in Flax.

  ``step`` counts *applied updates* (what a schedule counts; skipped and open
  windows are not counted): use it for EMA, evaluation and checkpoint
  intervals. The microbatch count (the data position) is
  ``optax_accum.metrics(opt.opt_state).num_microbatches``. With a ``tx`` that
  holds no ``accumulate``, ``step`` counts calls, as in Flax.

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
    >>> for g, n in ((1.0, 3), (5.0, 1), (7.0, 2)):  # a window of 2, then 1 of the next
    ...   opt.update(model, grad_fn(model, g), weight=n)
    >>> model.kernel[...], int(opt.step[...])  # -(3 * 1 + 1 * 5) / 4; one update
    (Array([[-2.]], dtype=float32), 1)
    >>> opt.flush(model)  # the last, incomplete window: its mean is 7
    >>> model.kernel[...], int(opt.step[...])
    (Array([[-9.]], dtype=float32), 2)
  """

  def update(self, model: Any, grads: Any, /, **kwargs: Any) -> None:
    """Adds one microbatch's gradients; at a boundary updates ``model`` in place.

    Args:
      model: the model the optimizer was created for.
      grads: the gradients from ``nnx.grad`` (of the microbatch's mean loss).
      **kwargs: forwarded to ``tx.update`` (``weight``, ``flush``, ``value``, ...).

    Returns:
      None (``nnx.Optimizer.update`` returns the updates; the fused path writes
      none). The params change in ``model`` at a boundary.

    Raises:
      TypeError, ValueError: from ``tx.update`` (a bad weight, grads that do not
        match the params).
    """
    params, opt_state = _arrays(self, model)
    grads = nnx.as_pure(nnx.state(grads, self.wrt, graph=_graph(self)))
    self._step(
      model, params, update_and_apply(self.tx, grads, opt_state, params, **nnx.as_pure(kwargs))
    )

  def flush(self, model: Any, **kwargs: Any) -> None:
    """Closes and applies the open window to ``model`` (:func:`optax_accum.flush`).

    Args:
      model: the model the optimizer was created for.
      **kwargs: forwarded to ``tx.update`` (the inner optimizer's extra args).

    Raises:
      ValueError: if ``tx`` holds no :func:`optax_accum.accumulate`.
    """
    params, opt_state = _arrays(self, model)
    fused = lambda g, s, p, **kw: update_and_apply(self.tx, g, s, p, **kw)
    self._step(model, params, flush_with(fused, opt_state, params, nnx.as_pure(kwargs)))

  def discard(self) -> None:
    """Drops the open window in place (:func:`optax_accum.discard`)."""
    discard(self)

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
