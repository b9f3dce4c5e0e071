"""A small decoder-only transformer in Flax NNX and its token-weighted loss.

No batch-dependent layers (LayerNorm only), so an accumulated window equals one
physical batch up to float rounding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from optax_accum.demo.data import VOCAB_SIZE


class Block(nnx.Module):
  """Pre-norm transformer block: causal self-attention and an MLP."""

  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs, dtype: Any = jnp.float32):
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs, dtype=dtype)
    # No attention biases: the key bias has an exactly-zero gradient (softmax ignores a
    # shift shared by all keys), and Adam turns its rounding noise into full-size steps.
    self.attn = nnx.MultiHeadAttention(
      num_heads=heads, in_features=dim, decode=False, use_bias=False, rngs=rngs, dtype=dtype
    )
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs, dtype=dtype)
    self.up = nnx.Linear(dim, 4 * dim, rngs=rngs, dtype=dtype)
    self.down = nnx.Linear(4 * dim, dim, rngs=rngs, dtype=dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class CharTransformer(nnx.Module):
  """A byte-level language model.

  Args:
    seq_len: maximum context length (learned position embeddings).
    dim: model width.
    depth: number of blocks.
    heads: attention heads.
    rngs: ``nnx.Rngs`` for initialization.
    dtype: compute dtype (params stay float32).

  Examples:
    >>> from flax import nnx
    >>> m = CharTransformer(seq_len=8, dim=16, depth=1, heads=2, rngs=nnx.Rngs(0))
    >>> m(jnp.zeros((3, 8), jnp.int32)).shape
    (3, 8, 256)
  """

  def __init__(
    self,
    seq_len: int = 64,
    dim: int = 64,
    depth: int = 2,
    heads: int = 4,
    *,
    rngs: nnx.Rngs,
    dtype: Any = jnp.float32,
  ):
    self.embed = nnx.Embed(VOCAB_SIZE, dim, rngs=rngs, dtype=dtype)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, dim)))
    # `nnx.List` exists since Flax 0.12; Flax 0.11 keeps a plain list of Modules.
    modules = getattr(nnx, "List", list)
    self.blocks = modules([Block(dim, heads, rngs=rngs, dtype=dtype) for _ in range(depth)])
    self.norm = nnx.LayerNorm(dim, rngs=rngs, dtype=dtype)
    self.head = nnx.Linear(dim, VOCAB_SIZE, rngs=rngs, dtype=dtype)

  def __call__(self, inputs: jax.Array) -> jax.Array:
    x = self.embed(inputs) + self.pos[...][: inputs.shape[1]].astype(self.embed.dtype)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x)).astype(jnp.float32)


def token_loss(model: CharTransformer, batch: dict[str, jax.Array]) -> jax.Array:
  """Mean next-byte cross-entropy over the unmasked tokens of ``batch``.

  Args:
    model: the language model.
    batch: ``inputs``/``targets`` int32 ``[B, T]`` and ``mask`` float32 ``[B, T]``.

  Returns:
    float32 scalar, nats per real token; 0 when the batch has no real token
    (never 0/0), so the microbatch's ``weight`` (``mask.sum()``) is 0 too.

  Examples:
    >>> from flax import nnx
    >>> m = CharTransformer(seq_len=4, dim=8, depth=1, heads=2, rngs=nnx.Rngs(0))
    >>> b = {'inputs': jnp.zeros((2, 4), jnp.int32), 'targets': jnp.ones((2, 4), jnp.int32),
    ...      'mask': jnp.ones((2, 4))}
    >>> float(token_loss(m, b)) > 0
    True
  """
  logits = model(batch["inputs"])
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  mask = batch["mask"].astype(jnp.float32)
  total = mask.sum()
  return jnp.where(total > 0, (nll * mask).sum() / jnp.maximum(total, 1.0), 0.0)
