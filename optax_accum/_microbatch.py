"""In-step accumulation: ``microbatched_value_and_grad`` runs one ``lax.scan`` over microbatches.

Inside one jitted train step the batch is cut into ``K`` microbatches; a
``lax.scan`` adds ``w_k * grad(loss_k)`` to a float32 (or wider) carry and
``w_k`` to a weight sum, and divides once at the end. Only one microbatch's
activations are live at a time, so the step's temporary memory is about ``1/K``
of the physical batch's activations plus one gradient-sized carry.

The sums and the division are :mod:`optax_accum._numerics`'s
(``weighted_add``, ``guarded_divide``, ``accumulator_dtype``, ``check_weight``),
the same code the across-step :func:`optax_accum.accumulate` runs, so both
paths round the same way and an empty (all-padding) batch gives zeros, not NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _checks, _numerics

PyTree = Any

_AUX_MODES = ("mean", "stack")


def split_batch(batch: PyTree, num_microbatches: int, *, strided: bool = True) -> PyTree:
  """Cuts every leaf of ``batch`` on axis 0 into ``num_microbatches`` stacked slices.

  Strided (default): microbatch ``k`` holds rows ``k, k+K, k+2K, ...``. When
  the batch is sharded on axis 0 over ``D`` devices and each device's local
  batch ``B/D`` is divisible by ``K``, every microbatch takes ``B/(D*K)`` rows
  from every device, so each device keeps its own rows and no data moves.
  Contiguous (``strided=False``): microbatch ``k`` holds rows
  ``k*B/K ... (k+1)*B/K - 1``, which lie on a subset of the devices.

  Args:
    batch: a pytree whose leaves all have the same leading size ``B``.
    num_microbatches: ``K``, an int >= 1 dividing ``B``.
    strided: the row assignment described above.

  Returns:
    The same pytree with leaves of shape ``[K, B // K, ...]``; microbatch ``k``
    is ``jax.tree.map(lambda x: x[k], result)``.

  Raises:
    ValueError: if ``K < 1``, the batch has no leaves or a 0-d leaf, the
      leaves' leading sizes differ, or ``B`` is not divisible by ``K``.

  Examples:
    >>> from optax_accum import split_batch
    >>> split_batch(jnp.arange(6), 2)
    Array([[0, 2, 4],
           [1, 3, 5]], dtype=int32)
    >>> split_batch(jnp.arange(6), 2, strided=False)
    Array([[0, 1, 2],
           [3, 4, 5]], dtype=int32)
  """
  k = _checks.positive_int(num_microbatches, "num_microbatches", "slices of the batch")
  paths_leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not paths_leaves:
    raise ValueError("The batch has no array leaves to split into microbatches.")
  sizes = {}
  for path, leaf in paths_leaves:
    if np.ndim(leaf) == 0:
      raise ValueError(
        f"Batch leaf {jax.tree_util.keystr(path)} is a scalar; every batch leaf needs a "
        "leading batch axis to split. Pass per-call constants as extra arguments instead."
      )
    sizes.setdefault(np.shape(leaf)[0], jax.tree_util.keystr(path))
  if len(sizes) != 1:
    raise ValueError(
      f"Batch leaves have different leading (batch) sizes: {sizes}. Every leaf must have "
      "the same number of rows."
    )
  (n,) = sizes
  if n % k:
    raise ValueError(
      f"The batch has {n} rows, which is not divisible by num_microbatches={k}. Use a "
      f"batch size that is a multiple of {k} (pad it with weight-0 rows, e.g. mask=0)."
    )

  def split(x):
    x = jnp.asarray(x)
    if strided:  # [B/K, K, ...]: each device's rows stay in place.
      return jnp.swapaxes(x.reshape((n // k, k) + x.shape[1:]), 0, 1)
    return jax.lax.reshape(x, (k, n // k) + x.shape[1:], out_sharding=_contiguous_sharding(x))

  return jax.tree.map(split, batch)


def _contiguous_sharding(x: jax.Array) -> Any:
  """Output sharding for a contiguous split of a batch with explicit sharding on axis 0.

  Under ``jax.sharding.AxisType.Explicit`` a reshape that cuts the sharded
  axis into ``[K, B/K]`` needs its output sharding spelled out; the rows stay
  sharded within each microbatch (this moves data: use the strided split).
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if not spec or spec[0] is None:
    return None
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *spec))


def _zeros_acc(tree: PyTree, override: Any = None) -> PyTree:
  """Zero sums for ``tree`` in the accumulator dtype (integers and bools become float)."""

  def zeros(x):
    dt = jnp.result_type(x)
    dt = dt if jnp.issubdtype(dt, jnp.inexact) else _numerics.scalar_dtype()
    return jnp.zeros(np.shape(x), _numerics.accumulator_dtype(dt, override))

  return jax.tree.map(zeros, tree)


def microbatched_value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  weight_fn: Callable[[PyTree], Any] | None = None,
  has_aux: bool = False,
  has_state: bool = False,
  aux_mode: str = "mean",
  strided: bool = True,
  loss_scale: Any = None,
  unscale: bool = True,
  accumulator_dtype: Any = None,
) -> Callable[..., tuple[Any, PyTree]]:
  """``jax.value_and_grad(loss_fn)`` over a batch, computed one microbatch at a time.

  The returned ``f(params, batch, *args, **kwargs)`` splits ``batch`` with
  :func:`split_batch`, runs ``jax.lax.scan`` over the ``K`` microbatches and
  returns the value and gradient of the weighted mean loss
  ``sum_k w_k loss_k / sum_k w_k`` with ``w_k = weight_fn(microbatch_k)``. With
  ``loss_fn`` returning the mean over examples (or unmasked tokens) and
  ``w_k`` their count, that is exactly ``jax.value_and_grad(loss_fn)`` on the
  whole batch, whatever the counts per microbatch (the mean-of-means bug is
  avoided). Microbatches of weight 0 add nothing (even a NaN); a total weight
  of 0 gives a zero loss and zero gradients.

  Sums are carried in ``promote_types(dtype, float32)`` (the accumulator rule of
  :func:`optax_accum.accumulate`); gradients are returned in the params'
  dtypes, the loss and mean aux in that accumulator dtype.

  Args:
    loss_fn: ``loss_fn(params, batch, *args, **kwargs)`` (with ``has_state``:
      ``loss_fn(params, batch, state, *args, **kwargs)``) returning the MEAN
      loss over the examples / unmasked tokens of ``batch`` (a scalar), or
      ``(loss, aux)`` with ``has_aux``. With ``has_state`` it returns
      ``(loss, new_state)``, or ``(loss, (aux, new_state))`` with ``has_aux``.
      If the caller passes ``key=`` it is folded with the microbatch index
      (``jax.random.fold_in(key, k)``) for each call, so dropout masks differ
      between microbatches and are reproducible.
    num_microbatches: ``K`` >= 1; the batch size must be divisible by it
      (checked at trace time).
    weight_fn: ``weight_fn(microbatch) -> scalar``, the count the microbatch's
      mean is over (e.g. ``lambda mb: mb['mask'].sum()``). Default: its rows.
    has_aux: as in ``jax.value_and_grad``.
    has_state: thread non-differentiated state (BatchNorm statistics, RNG
      counters of a split ``nnx`` model) through the microbatches in order:
      microbatch ``k`` sees the state microbatch ``k-1`` returned, and ``f``
      returns the last one.
    aux_mode: ``'mean'`` (default): aux leaves are combined by the same
      weighted mean as the loss (so per-microbatch means of a metric combine
      into the batch mean; integer leaves come back as float).
      ``'stack'``: aux leaves are stacked per microbatch, shape ``[K, ...]``.
    strided: microbatch ``k`` takes rows ``k, k+K, ...`` (default; keeps rows
      on their device under data-parallel sharding when the local batch is
      divisible by ``K``); ``False`` takes contiguous slices.
    loss_scale: ``None`` or a positive scalar (may be traced, e.g.
      ``optax_accum.get_loss_scale(opt_state)``). Each microbatch differentiates
      ``loss * loss_scale`` (guards fp16 gradients against underflow); the
      returned loss is unscaled.
    unscale: with ``loss_scale``, divide the gradient by it once at the end
      (default). ``False`` returns the gradient of the scaled mean loss, to be
      handed to ``accumulate(inner, every_k=1, loss_scale=...)``, which divides
      by the scale, skips non-finite steps and adjusts a dynamic scale.
    accumulator_dtype: override of the carry's dtype, as in ``accumulate``.

  Returns:
    ``f(params, batch, *args, **kwargs) -> (value, grads)`` with
    ``jax.value_and_grad(loss_fn, has_aux=has_aux or has_state)``'s output
    structure: ``value`` is ``loss``, ``(loss, aux)``, ``(loss, new_state)`` or
    ``(loss, (aux, new_state))``; ``grads`` is a tree like ``params``.

  Raises:
    TypeError, ValueError: for a bad ``num_microbatches`` or ``aux_mode`` at
      construction; at trace time for an indivisible batch, a non-scalar loss or
      weight, or a boolean weight.

  Examples:
    >>> import optax_accum
    >>> def loss_fn(w, batch):  # masked mean of 0.5 * (w - y)**2
    ...   m = batch['mask']
    ...   return (0.5 * (w - batch['y']) ** 2 * m).sum() / jnp.maximum(m.sum(), 1.0)
    >>> batch = {'y': jnp.array([1., 3., 3., 0.]), 'mask': jnp.array([1., 1., 0., 0.])}
    >>> f = optax_accum.microbatched_value_and_grad(
    ...     loss_fn, 2, weight_fn=lambda mb: mb['mask'].sum(), strided=False)
    >>> loss, g = jax.jit(f)(jnp.asarray(0.0), batch)  # second microbatch is all padding
    >>> float(loss), float(g)  # = jax.value_and_grad(loss_fn)(0.0, batch)
    (2.5, -2.0)

  References:
    Hugging Face, `Fixing gradient accumulation
    <https://huggingface.co/blog/gradient_accumulation>`_ (2024), on weighting
    by token counts.
  """
  k_total = _checks.positive_int(num_microbatches, "num_microbatches", "slices of the batch")
  if aux_mode not in _AUX_MODES:
    raise ValueError(f"aux_mode must be one of {_AUX_MODES}, got {aux_mode!r}.")
  if accumulator_dtype is not None:
    accumulator_dtype = jnp.dtype(accumulator_dtype)

  def scaled_loss(params, mb, scale, extra, kwargs):
    args = (params, mb, *extra)
    out = loss_fn(*args, **kwargs)
    if has_state:
      loss, rest = out
      aux, state = rest if has_aux else (None, rest)
    else:
      loss, aux = out if has_aux else (out, None)
      state = None
    loss = jnp.asarray(loss)
    if loss.ndim != 0:
      raise ValueError(f"loss_fn must return a scalar mean loss, got shape {loss.shape}.")
    loss = loss.astype(_numerics.accumulator_dtype(loss.dtype))
    scaled = loss if scale is None else loss * scale.astype(loss.dtype)
    return scaled, (loss, aux, state)

  grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

  def value_and_grad(params, batch, *args, **kwargs):
    micro = split_batch(batch, k_total, strided=strided)
    if has_state:
      if not args:
        raise TypeError("has_state=True: call f(params, batch, state, *args, **kwargs).")
      state0, args = args[0], args[1:]
    else:
      state0 = None
    key = kwargs.pop("key", None)
    scale = None if loss_scale is None else jnp.asarray(loss_scale, _numerics.scalar_dtype())
    if loss_scale is not None and not isinstance(loss_scale, jax.core.Tracer):
      if not 0 < float(np.asarray(loss_scale)) < float("inf"):
        raise ValueError(
          f"loss_scale must be a finite number > 0, got {loss_scale}. Pass None for no "
          "scaling, or optax_accum.get_loss_scale(opt_state)."
        )
    mb0 = jax.tree.map(lambda x: x[0], micro)

    def grads_of(mb, k, state):
      kw = dict(kwargs)
      if key is not None:
        kw["key"] = jax.random.fold_in(key, k)
      extra = args if state is None else (state, *args)
      (_, (loss, aux, new_state)), g = grad_fn(params, mb, scale, extra, kw)
      if weight_fn is None:
        w = jax.tree.leaves(mb)[0].shape[0]
      else:
        w = weight_fn(mb)
      return loss, aux, new_state, g, _checks.weight(w, "weight_fn(microbatch)")

    # Trace one microbatch abstractly to size the carry (no compute is staged).
    loss_s, aux_s, _, _, _ = jax.eval_shape(grads_of, mb0, 0, state0)
    acc0 = _zeros_acc(params, accumulator_dtype)
    loss0 = jnp.zeros((), loss_s.dtype)
    aux0 = _zeros_acc(aux_s) if (has_aux and aux_mode == "mean") else None
    wsum0 = jnp.zeros((), _numerics.scalar_dtype())

    def body(carry, xs):
      acc, wsum, loss_sum, aux_sum, state = carry
      k, mb = xs
      loss, aux, new_state, g, w = grads_of(mb, k, state)
      acc = _numerics.weighted_add(acc, g, w)
      loss_sum = _numerics.weighted_add(loss_sum, loss, w)
      if aux_sum is not None:
        aux_sum = _numerics.weighted_add(aux_sum, aux, w)
      stacked = aux if (has_aux and aux_mode == "stack") else None
      return (acc, wsum + w, loss_sum, aux_sum, new_state), stacked

    carry0 = (acc0, wsum0, loss0, aux0, state0)
    ks = jnp.arange(k_total, dtype=jnp.int32)
    (acc, wsum, loss_sum, aux_sum, state), stacked = jax.lax.scan(body, carry0, (ks, micro))

    # The one division of the step (by the weight sum, times the scale if unscaling).
    denom = wsum if (scale is None or not unscale) else wsum * scale
    grads = optax.tree.cast_like(_numerics.guarded_divide(acc, denom), params)
    loss = _numerics.guarded_divide(loss_sum, wsum)
    aux = stacked if aux_mode == "stack" else _numerics.guarded_divide(aux_sum, wsum)
    if has_state:
      value = (loss, (aux, state)) if has_aux else (loss, state)
    else:
      value = (loss, aux) if has_aux else loss
    return value, grads

  return value_and_grad
