"""0.3's ``scaled_value_and_grad``, kept for one release (``optax_accum._migration``).

Its 0.4 spelling is ``microbatched_value_and_grad(loss_fn, 1, loss_scale=metrics(opt_state)
.loss_scale)``: one helper takes the loss scale's value, in-step with any number of microbatches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optax_accum._metrics import get_loss_scale

PyTree = Any


def scaled_value_and_grad(
  loss_fn: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, PyTree]]:
  """``jax.value_and_grad`` of ``loss_fn`` times the loss scale found in an optimizer state.

  For ``accumulate(..., loss_scale=...)``: the scale is read from the state on every call (it
  cannot be stale), and the state divides by it once at the boundary (PyTorch AMP's
  ``scaler.scale(loss).backward()``). The library's one convention: ``accumulate`` takes the
  *policy* and keeps the scale in its state; a gradient helper takes that *value*, returns
  the unscaled loss and the gradient of ``loss * scale``, and never divides (as
  ``microbatched_value_and_grad(..., loss_scale=metrics(opt_state).loss_scale)``).

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)`` returning a scalar loss (or ``(loss,
      aux)`` with ``has_aux``), cast to float32 before it is scaled. Reduce it in float32
      too: an fp16 loss's cotangent is the scale in fp16, inf for a scale >= 2**16 (the
      first windows are skipped until the scale has backed off).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

  Returns:
    ``f(opt_state, params, *args, **kwargs) -> (loss, grads)`` (or
    ``((loss, aux), grads)``): ``loss`` is the *unscaled* float32 loss; ``grads``
    is the gradient of ``loss * scale`` with respect to ``params``, in the
    params' dtypes.

  Raises:
    ValueError: if ``opt_state`` holds no or several accumulation states.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2,
    ...                             loss_scale=optax_accum.static_loss_scale(8.0))
    >>> params = jnp.asarray(3.0)
    >>> state = tx.init(params)
    >>> loss, g = scaled_value_and_grad(lambda p: 0.5 * p**2)(state, params)
    >>> float(loss), float(g)  # unscaled loss, gradient of 8 * loss
    (4.5, 24.0)
  """

  def scaled_loss(params, scale, *args, **kwargs):
    out = loss_fn(params, *args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    loss = jnp.asarray(loss).astype(jnp.float32)
    return loss * scale, (loss, aux)

  grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

  def value_and_grad(opt_state, params, *args, **kwargs):
    scale = get_loss_scale(opt_state)
    (_, (loss, aux)), grads = grad_fn(params, scale, *args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return value_and_grad
