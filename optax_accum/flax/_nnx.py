"""Helpers for Flax NNX's ``nnx.Optimizer`` wrapping :func:`optax_accum.accumulate`.

``nnx.Optimizer(model, optax_accum.accumulate(...), wrt=nnx.Param)`` works as
is: ``optimizer.update(model, grads, weight=n_tokens)`` forwards ``weight`` (and
``flush``) to ``tx.update`` (Flax's ``Optimizer.update`` passes ``**kwargs``
through), and :func:`optax_accum.metrics` reads ``optimizer.opt_state``
directly. Two things differ from a plain optimizer:

* ``optimizer.step`` counts *calls* to ``update``, i.e. microbatches. The
  number of applied updates is :func:`num_updates` (``metrics(...).num_updates``);
  drive EMA, evaluation, checkpoints and per-update logging from it.
* The open window lives inside ``OptArray`` variables. :func:`flush` and
  :func:`discard` close or drop it in place, like ``optimizer.update`` does.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from optax_accum import pitfalls
from optax_accum._accumulate import flush as _flush_state
from optax_accum._state import discard as _discard_state
from optax_accum._state import metrics as _metrics


def _graph(optimizer: nnx.Optimizer) -> bool | None:
  # `graph` exists since Flax 0.12; None means "the current nnx graph mode".
  return getattr(optimizer, "graph", None)


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
  graph = _graph(optimizer)
  params = nnx.as_pure(nnx.state(model, optimizer.wrt, graph=graph))
  opt_state = nnx.as_pure(optimizer.opt_state)
  pitfalls.check(optimizer.tx, opt_state)
  updates, new_opt_state = _flush_state(optimizer.tx, opt_state, params, **nnx.as_pure(extra_args))
  nnx.update(model, optax.apply_updates(params, updates))
  nnx.update(optimizer.opt_state, nnx.state(new_opt_state, graph=graph))
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
