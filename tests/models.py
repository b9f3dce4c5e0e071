"""Small deterministic models and data for the tests (``import models`` from ``tests/``).

Fixed seeds, small sizes, but each standard tree (:func:`mlp_params`, :func:`token_params`,
:func:`nnx_mlp`) has one leaf of 65,536 elements: XLA generates other code for large leaves than
for 3-element toys (issue 46: XLA:CPU's large reduce-max drops NaN), so every test that uses
them runs the size-dependent paths. Flax is imported only inside the functions that need it.
Not shipped with the package: a user's own tests bring their own model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def linear_regression_data(
  num_examples: int = 26, dim: int = 3, *, seed: int = 0, dtype: Any = jnp.float32
) -> dict[str, jax.Array]:
  """Model M2's data (``y = x @ theta + b + noise``) from a fixed seed.

  ``theta = (1, 2, ..., dim)``, ``b = -0.5``, ``x`` standard normal, noise
  normal with standard deviation 0.1.

  Args:
    num_examples: rows ``N`` (>= 0).
    dim: features (>= 0).
    seed: NumPy seed (>= 0).
    dtype: float dtype of the arrays.

  Returns:
    ``{'x': [N, dim], 'y': [N]}`` in ``dtype``.

  Raises:
    ValueError: from NumPy, if ``num_examples``, ``dim`` or ``seed`` is negative.

  Examples:
    >>> linear_regression_data(5)['x'].shape
    (5, 3)
  """
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(num_examples, dim))
  y = x @ np.arange(1.0, dim + 1) - 0.5 + 0.1 * rng.normal(size=num_examples)
  return {"x": jnp.asarray(x, dtype), "y": jnp.asarray(y, dtype)}


def linear_regression_params(dim: int = 3, dtype: Any = jnp.float32) -> dict[str, jax.Array]:
  """M2's params ``{'theta': [dim], 'b': []}``, away from the optimum (so gradients are non-zero).

  Args:
    dim: features, as in :func:`linear_regression_data`.
    dtype: float dtype of the arrays.

  Returns:
    ``{'theta': [dim], 'b': []}`` in ``dtype``: ``theta = 0.1 * (1, -2, 3, ...)``,
    ``b = 0.25``.

  Examples:
    >>> linear_regression_params()['theta']
    Array([ 0.1, -0.2,  0.3], dtype=float32)
  """
  theta = 0.1 * np.arange(1, dim + 1) * (-1.0) ** np.arange(dim)
  return {"theta": jnp.asarray(theta, dtype), "b": jnp.asarray(0.25, dtype)}


def _masked_mean(per_example: jax.Array, batch: Mapping[str, jax.Array]) -> jax.Array:
  """Mean over ``batch['mask']`` (1 = real) if present, else over everything; 0 if empty."""
  if "mask" not in batch:
    return jnp.mean(per_example)
  mask = batch["mask"].astype(per_example.dtype)
  total = mask.sum()
  return jnp.where(total > 0, (per_example * mask).sum() / jnp.maximum(total, 1), 0)


def linear_regression_loss(params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]):
  """Mean of ``0.5 * (x @ theta + b - y)**2`` over the rows (or the rows where ``mask`` is 1).

  Args:
    params: ``{'theta': [dim], 'b': []}`` (:func:`linear_regression_params`).
    batch: ``{'x': [N, dim], 'y': [N]}`` and optionally ``'mask': [N]`` (1 = a
      real row, 0 = padding), as from :func:`linear_regression_data`.

  Returns:
    A 0-d array in the params' and data's dtype; 0 when ``mask`` is all 0.

  Examples:
    >>> p = {'theta': jnp.zeros(3), 'b': jnp.asarray(0.0)}
    >>> float(linear_regression_loss(p, {'x': jnp.ones((2, 3)), 'y': jnp.array([1., 3.])}))
    2.5
  """
  pred = batch["x"] @ params["theta"] + params["b"]
  return _masked_mean(0.5 * (pred - batch["y"]) ** 2, batch)


def mlp_params(
  sizes: tuple[int, ...] = (3, 256, 256, 1), *, seed: int = 0
) -> list[dict[str, jax.Array]]:
  """Float32 params of a tanh MLP: a list of ``{'w': [m, n], 'b': [n]}`` (LeCun normal init).

  Args:
    sizes: layer widths, input first: ``(3, 256, 256, 1)`` is 3 features, two hidden
      layers of 256 (a ``[256, 256]`` leaf: 65,536 elements), one output (:func:`mlp_loss`
      reads output 0).
    seed: NumPy seed.

  Returns:
    ``len(sizes) - 1`` layers; ``w`` is ``normal / sqrt(m)``, ``b`` zeros.

  Examples:
    >>> [p['w'].shape for p in mlp_params((3, 4, 1))]
    [(3, 4), (4, 1)]
  """
  rng = np.random.default_rng(seed)
  return [
    {"w": jnp.asarray(rng.normal(size=(m, n)) / np.sqrt(m), jnp.float32), "b": jnp.zeros(n)}
    for m, n in zip(sizes[:-1], sizes[1:], strict=True)
  ]


def mlp_loss(
  params: list[dict[str, jax.Array]],
  batch: Mapping[str, jax.Array],
  *,
  key: jax.Array | None = None,
  dropout_rate: float = 0.5,
) -> jax.Array:
  """Mean squared error of the MLP on ``batch['x']``/``batch['y']`` (masked mean with ``mask``).

  With ``key``, inverted dropout of ``dropout_rate`` on the hidden layers.

  Args:
    params: the layers of :func:`mlp_params`.
    batch: ``{'x': [N, sizes[0]], 'y': [N]}``, optionally ``'mask': [N]``.
    key: a PRNG key for dropout; None (the default) for none.
    dropout_rate: the probability of dropping a hidden unit, in ``[0, 1)``.

  Returns:
    A 0-d float32 array: the mean of ``0.5 * (out - y)**2``; 0 when ``mask``
    is all 0.

  Examples:
    >>> float(mlp_loss(mlp_params(), linear_regression_data())) > 0
    True
  """
  h = batch["x"]
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      h = jnp.tanh(h)
      if key is not None:
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1 - dropout_rate, h.shape)
        h = jnp.where(keep, h / (1 - dropout_rate), 0)
  return _masked_mean(0.5 * (h[:, 0] - batch["y"]) ** 2, batch)


def token_batch(
  num_rows: int = 8, seq_len: int = 6, vocab: int = 11, *, seed: int = 0
) -> dict[str, jax.Array]:
  """Padded token rows with unequal real lengths (0 to ``seq_len``; row 1 is all padding).

  Row 0 is full (``seq_len`` real tokens), row 1 empty, the others have random
  lengths. Tokens are drawn from ``1 .. vocab - 1``; ``targets`` is ``inputs``
  shifted by one.

  Args:
    num_rows: rows ``N``.
    seq_len: tokens per row ``T``.
    vocab: vocabulary size (>= 2).
    seed: NumPy seed.

  Returns:
    ``{'inputs': int32[N, T], 'targets': int32[N, T], 'mask': float32[N, T]}``
    (mask 1 = a real token, 0 = padding).

  Raises:
    ValueError: from NumPy, if ``vocab < 2`` or a size or the seed is negative.

  Examples:
    >>> token_batch(4, seq_len=6)['mask'].sum(axis=1)[:2]  # a full row, an empty row
    Array([6., 0.], dtype=float32)
  """
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, seq_len + 1, size=num_rows)
  lengths[: min(num_rows, 2)] = [seq_len, 0][: min(num_rows, 2)]
  tokens = rng.integers(1, vocab, size=(num_rows, seq_len + 1))
  mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.float32)
  return {
    "inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
    "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
    "mask": jnp.asarray(mask),
  }


def token_params(vocab: int = 11, dim: int = 256, *, seed: int = 0) -> dict[str, jax.Array]:
  """A bigram model's params, float32: ``{'embed': [vocab, dim], 'mix': [dim, dim],
  'out': [dim, vocab]}`` (``mix`` is 65,536 elements at the default ``dim``).

  Args:
    vocab: vocabulary size, as in :func:`token_batch`.
    dim: embedding width.
    seed: NumPy seed.

  Returns:
    ``embed`` standard normal, ``mix`` and ``out`` normal / ``sqrt(dim)``.

  Examples:
    >>> token_params()['mix'].size
    65536
  """
  rng = np.random.default_rng(seed)
  return {
    "embed": jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32),
    "mix": jnp.asarray(rng.normal(size=(dim, dim)) / np.sqrt(dim), jnp.float32),
    "out": jnp.asarray(rng.normal(size=(dim, vocab)) / np.sqrt(dim), jnp.float32),
  }


def token_logits(params: Mapping[str, jax.Array], inputs: jax.Array) -> jax.Array:
  """The bigram model's next-token logits: ``tanh(embed[inputs] @ mix) @ out``.

  Args:
    params: :func:`token_params`.
    inputs: ``int32[N, T]`` token ids.

  Returns:
    ``float32[N, T, vocab]``.

  Examples:
    >>> token_logits(token_params(), token_batch()['inputs']).shape
    (8, 6, 11)
  """
  return jnp.tanh(params["embed"][inputs] @ params["mix"]) @ params["out"]


def token_loss(params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]) -> jax.Array:
  """Mean next-token cross-entropy over the unmasked tokens (0 for an all-padding batch).

  Args:
    params: :func:`token_params`.
    batch: :func:`token_batch`'s ``inputs``, ``targets`` and ``mask``
      (``[N, T]`` each).

  Returns:
    A 0-d float32 array, in nats per unmasked token.

  Examples:
    >>> float(token_loss(token_params(), token_batch())) > 0
    True
  """
  nll = optax.softmax_cross_entropy_with_integer_labels(
    token_logits(params, batch["inputs"]), batch["targets"]
  )
  return _masked_mean(nll, batch)


def nnx_mlp(
  in_features: int = 3,
  hidden: int = 256,
  *,
  batch_norm: bool = False,
  dropout_rate: float = 0.0,
  seed: int = 0,
) -> Any:
  """A Flax NNX MLP (Linear, [BatchNorm], tanh, [Dropout], Linear, tanh, Linear -> 1), needs
  ``flax``; its middle ``hidden x hidden`` kernel is 65,536 elements at the default width.

  BatchNorm is in train mode (batch statistics), the case accumulation cannot
  reproduce. Use it with :func:`nnx_mlp_loss`.

  Args:
    in_features: input width (3 matches :func:`linear_regression_data`).
    hidden: hidden width (both hidden layers).
    batch_norm: add an ``nnx.BatchNorm`` after the first layer.
    dropout_rate: add an ``nnx.Dropout`` of this rate after the tanh (0: none).
    seed: seed of the ``nnx.Rngs`` (init and dropout).

  Returns:
    An ``nnx.Module`` mapping ``x: float32[N, in_features]`` to ``float32[N]``.

  Raises:
    ImportError: if ``flax`` is not installed.

  Examples:
    >>> from optax_accum.testing import _batch_dependent_layers
    >>> _batch_dependent_layers(nnx_mlp(batch_norm=True))
    ('bn',)
  """
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.fc1 = nnx.Linear(in_features, hidden, rngs=rngs)
      self.bn = nnx.BatchNorm(hidden, rngs=rngs) if batch_norm else None
      self.drop = nnx.Dropout(dropout_rate, rngs=rngs) if dropout_rate else None
      self.mid = nnx.Linear(hidden, hidden, rngs=rngs)
      self.fc2 = nnx.Linear(hidden, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
      h = self.fc1(x)
      if self.bn is not None:
        h = self.bn(h)
      h = jnp.tanh(h)
      if self.drop is not None:
        h = self.drop(h)
      return self.fc2(jnp.tanh(self.mid(h)))[:, 0]

  return MLP(nnx.Rngs(seed))


def nnx_mlp_loss(model: Any, batch: Mapping[str, jax.Array]) -> jax.Array:
  """Mean squared error of an :func:`nnx_mlp` on ``batch['x']``/``batch['y']`` (masked mean).

  Args:
    model: an :func:`nnx_mlp`.
    batch: ``{'x': [N, in_features], 'y': [N]}``, optionally ``'mask': [N]``.

  Returns:
    A 0-d float32 array: the mean of ``0.5 * (model(x) - y)**2``; 0 when
    ``mask`` is all 0.

  Examples:
    >>> float(nnx_mlp_loss(nnx_mlp(), linear_regression_data())) > 0
    True
  """
  return _masked_mean(0.5 * (model(batch["x"]) - batch["y"]) ** 2, batch)
