"""Flax NNX in-step accumulation: :func:`microbatched_value_and_grad` of a module's loss.

The core helper differentiates a function of arrays; an NNX loss takes the module. This splits
the module once into its ``wrt`` params and the rest (RNG counters, BatchNorm statistics),
merges a fresh module per microbatch, threads the rest through the microbatches in order and
writes the last of it back into the module, as ``nnx.value_and_grad`` would for one call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from optax_accum import _microbatch

# copy=True: fresh Variables per trace, so an in-place update (BatchNorm statistics, an RNG
# counter) inside jax.grad does not raise TraceContextError (Flax >= 0.12; older Flax always
# makes fresh Variables and has no `copy`).
_FRESH = {"copy": True} if "copy" in inspect.signature(nnx.merge).parameters else {}


# `nnx.as_pure` exists since Flax 0.12.7; `nnx.pure` before it.
as_pure = getattr(nnx, "as_pure", None) or nnx.pure


def merge_fresh(graphdef: Any, *states: Any) -> Any:
  """``nnx.merge(graphdef, *states)`` with fresh Variables (safe inside ``jax.grad``)."""
  return nnx.merge(graphdef, *states, **_FRESH)


def microbatched_value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  wrt: Any = nnx.Param,
  has_aux: bool = False,
  **options: Any,
) -> Callable[..., tuple[Any, nnx.State]]:
  """``nnx.value_and_grad(loss_fn)`` over a batch, one microbatch at a time (one ``lax.scan``).

  :func:`optax_accum.microbatched_value_and_grad` for a loss of an ``nnx.Module``: the same
  weighting, aux modes, key folding and mesh options (``options``: ``weight_fn``,
  ``aux_mode``, ``strided``, ``axis_name``, ``loss_scale``, ``accumulator_dtype``). The
  module's other state (RNG counters, BatchNorm statistics) is threaded through the microbatches
  in order, and the last of it is written back into the module, as one ``nnx.value_and_grad``
  call would.

  Args:
    loss_fn: ``loss_fn(model, mb, *args, **kwargs)`` -> the MEAN loss of ``mb``, or ``(loss,
      aux)`` with ``has_aux``.
    num_microbatches: ``K`` >= 1, dividing the batch size.
    wrt: the filter of the differentiated Variables, as ``nnx.Optimizer``'s (``nnx.Param``).
    has_aux: as in ``nnx.value_and_grad``.
    **options: the core helper's keyword arguments (not ``has_state``: always on here).

  Returns:
    ``f(model, batch, *args, **kwargs) -> (value, grads)``: ``value`` as from
    ``nnx.value_and_grad(loss_fn, has_aux=has_aux)``, ``grads`` an ``nnx.State`` of the ``wrt``
    Variables for ``nnx.Optimizer.update`` (or :class:`optax_accum.flax.Optimizer`).

  Raises:
    TypeError, ValueError: as the core helper (``has_state`` or ``noise_scale`` passed in
      ``options`` is a TypeError); under ``jax.jit`` with ``axis_name``, a module with state
      beyond ``wrt`` (each device would keep its own): call it inside ``jax.shard_map``.

  Examples:
    >>> import optax_accum.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> def loss_fn(m, batch):  # masked mean squared error
    ...   err = (m(batch['x'])[:, 0] - batch['y']) ** 2
    ...   return (err * batch['mask']).sum() / jnp.maximum(batch['mask'].sum(), 1.0)
    >>> batch = {'x': jnp.ones((8, 2)), 'y': jnp.arange(8.0), 'mask': jnp.ones(8).at[5:].set(0)}
    >>> f = optax_accum.flax.microbatched_value_and_grad(
    ...   loss_fn, 4, weight_fn=lambda mb: mb['mask'].sum())
    >>> loss, grads = nnx.jit(f)(model, batch)
    >>> ref_loss, ref_grads = nnx.value_and_grad(loss_fn)(model, batch)
    >>> bool(jnp.allclose(loss, ref_loss)), bool(jnp.allclose(grads['kernel'], ref_grads['kernel']))
    (True, True)
  """
  k = num_microbatches
  for name in ("has_state", "noise_scale"):
    if name in options:
      raise TypeError(
        f"optax_accum.flax.microbatched_value_and_grad threads the module's state itself and "
        f"takes no {name}=; use optax_accum.microbatched_value_and_grad on arrays for it."
      )

  def f(model: Any, batch: Any, *args: Any, **kwargs: Any) -> tuple[Any, nnx.State]:
    graphdef, params, rest = nnx.split(model, wrt, ...)
    if not jax.tree.leaves(rest):  # nothing to thread: the mesh's lanes path stays open
      pure = lambda params, mb, *a, **kw: loss_fn(merge_fresh(graphdef, params, rest), mb, *a, **kw)
      core = _microbatch.microbatched_value_and_grad(pure, k, has_aux=has_aux, **options)
      return core(params, batch, *args, **kwargs)

    def pure_with_state(params: Any, mb: Any, rest: Any, *a: Any, **kw: Any) -> Any:
      m = merge_fresh(graphdef, params, rest)
      out = loss_fn(m, mb, *a, **kw)
      new_rest = nnx.split(m, wrt, ...)[2]
      return (out[0], (out[1], new_rest)) if has_aux else (out, new_rest)

    core = _microbatch.microbatched_value_and_grad(
      pure_with_state, k, has_aux=has_aux, has_state=True, **options
    )
    (loss, rest_out), grads = core(params, batch, rest, *args, **kwargs)
    aux, new_rest = rest_out if has_aux else (None, rest_out)
    nnx.update(model, new_rest)
    return ((loss, aux) if has_aux else loss), grads

  return f
