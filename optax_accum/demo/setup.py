"""The demo's configuration and setup: sizes, data split, model and optimizer.

Used by :mod:`optax_accum.demo.train` (the loop and the pre-flight).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
from flax import nnx

from optax_accum.demo.data import encode, stdlib_lines
from optax_accum.demo.model import CharTransformer

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """Sizes and hyperparameters of the demo run.

  Attributes:
    microbatch_size: lines (rows) per microbatch.
    every_k: microbatches per window (one AdamW step per window) when
      ``tokens_per_update`` is None; else only the pre-flight's window length.
    tokens_per_update: real bytes (tokens) per window: each window closes at
      the first microbatch reaching it (``accumulate(inner, optax_accum.token_budget(N))``),
      so every update sees about the same number of tokens; None: windows of
      ``every_k`` microbatches, whose token counts vary.
    adaptive: windows that follow the measured critical batch (``optax_accum.adaptive_window``:
      from ``tokens_per_update`` up to ``train.ADAPTIVE_RANGE`` times it, the learning rate
      scaled by the square root of each window's tokens); needs ``tokens_per_update``.
    updates: optimizer updates (windows) to train for.
    seed: seed of the model init and of the data shuffling.
    seq_len: context length in bytes; longer lines are cut.
    dim: model width.
    depth: transformer blocks.
    heads: attention heads.
    learning_rate: AdamW peak learning rate (linear warmup, cosine decay to a
      tenth, over ``updates`` updates: the schedule counts updates, not
      microbatches).
    weight_decay: AdamW decoupled weight decay.
    max_files: standard-library files to read (sorted by name).
    eval_lines: lines held out (never trained on) to measure the loss on.
  """

  microbatch_size: int = 16
  every_k: int = 4
  tokens_per_update: int | None = 2048  # about every_k microbatches of real bytes
  adaptive: bool = False
  updates: int = 500
  seed: int = 0
  seq_len: int = 64
  dim: int = 64
  depth: int = 2
  heads: int = 4
  learning_rate: float = 3e-3
  weight_decay: float = 0.01
  max_files: int = 40
  eval_lines: int = 512


QUICK = DemoConfig(
  microbatch_size=8,
  tokens_per_update=768,
  updates=120,
  seq_len=48,
  dim=32,
  depth=1,
  max_files=8,
  eval_lines=256,
)


def split_lines(config: DemoConfig) -> tuple[list[bytes], list[bytes]]:
  """Shuffles the standard-library lines with ``config.seed``; holds out ``eval_lines``.

  Returns:
    ``(train_lines, eval_lines)``, lists of ``bytes``.

  Examples:
    >>> train_lines, eval_lines = split_lines(DemoConfig(max_files=2, eval_lines=10))
    >>> len(eval_lines), len(train_lines) > 100
    (10, True)
  """
  lines = stdlib_lines(max_files=config.max_files)
  order = np.random.default_rng(config.seed).permutation(len(lines))
  lines = [lines[i] for i in order]
  return lines[config.eval_lines :], lines[: config.eval_lines]


def microbatches(lines: list[bytes], seq_len: int, size: int) -> list[Batch]:
  """Cuts encoded lines into microbatches of ``size`` rows, keeping the remainder.

  The last microbatch is completed with all-padding rows (mask 0): they add no
  token to the weight, so nothing is dropped and no shape changes.

  Args:
    lines: byte lines (see :func:`optax_accum.demo.data.encode`).
    seq_len: context length.
    size: rows per microbatch.

  Returns:
    A list of ``{'inputs', 'targets', 'mask'}`` dicts of ``[size, seq_len]``
    NumPy arrays (int32, int32, float32).

  Examples:
    >>> mbs = microbatches([b'abc', b'hello', b'xy'], seq_len=4, size=2)
    >>> [mb['mask'].sum(axis=1).tolist() for mb in mbs]
    [[2.0, 4.0], [1.0, 0.0]]
  """
  data = encode(lines, seq_len)
  pad = -len(lines) % size
  data = {k: np.concatenate([v, np.zeros((pad, seq_len), v.dtype)]) for k, v in data.items()}
  return [{k: v[i : i + size] for k, v in data.items()} for i in range(0, len(data["mask"]), size)]


def planned_microbatches(config: DemoConfig, epoch_length: int) -> int:
  """The microbatches a run of ``config.updates`` updates consumes.

  Each epoch of ``epoch_length`` microbatches ends with a flushed window, so it
  holds ``ceil(epoch_length / every_k)`` windows; the run stops right after its
  last update.

  Args:
    config: ``updates`` and ``every_k``.
    epoch_length: microbatches per epoch.

  Returns:
    The number of microbatches (training steps) of the run.

  Examples:
    >>> planned_microbatches(DemoConfig(every_k=4, updates=5), epoch_length=10)  # 4+4+2, 4+4
    18
    >>> planned_microbatches(DemoConfig(every_k=1_000_000, updates=3), epoch_length=10)
    30
  """
  windows_per_epoch = -(-epoch_length // config.every_k)
  full_epochs, rest = divmod(config.updates, windows_per_epoch)
  return full_epochs * epoch_length + min(rest * config.every_k, epoch_length)


def planned_by_tokens(config: DemoConfig, train_lines: list[bytes]) -> int:
  """The microbatches a run with ``config.tokens_per_update`` consumes, by replaying its data.

  The training loop's order: an epoch of ``train_lines``, then each next epoch
  reshuffled by ``default_rng(config.seed + 1)``; a window closes at the first
  microbatch reaching ``tokens_per_update`` real bytes, or at an epoch's end.

  Examples:
    >>> cfg = DemoConfig(microbatch_size=1, tokens_per_update=5, updates=2, seq_len=8)
    >>> planned_by_tokens(cfg, [b'abcd', b'ab', b'abc', b'abcdef'])  # 3 + 1 + 2, then 5
    4
  """
  budget = config.tokens_per_update
  if budget is None:
    raise ValueError("planned_by_tokens needs a token budget: config.tokens_per_update is None.")
  lines, rng = list(train_lines), np.random.default_rng(config.seed + 1)
  done = updates = 0
  while True:
    pending = 0
    epoch = microbatches(lines, config.seq_len, config.microbatch_size)
    for i, mb in enumerate(epoch):
      pending += int(mb["mask"].sum())
      done += 1
      if pending >= budget or i == len(epoch) - 1:
        pending, updates = 0, updates + 1
        if updates >= config.updates:
          return done
    rng.shuffle(lines)


def make_model(config: DemoConfig) -> CharTransformer:
  """The demo's :class:`~optax_accum.demo.model.CharTransformer`.

  Args:
    config: ``seq_len``, ``dim``, ``depth``, ``heads`` and ``seed`` (the init).

  Returns:
    A float32 model, initialized from ``nnx.Rngs(config.seed)``.

  Examples:
    >>> from flax import nnx
    >>> nnx.eval_shape(lambda: make_model(DemoConfig(seq_len=8, dim=8, depth=1, heads=2))).pos.shape
    (8, 8)
  """
  return CharTransformer(
    seq_len=config.seq_len,
    dim=config.dim,
    depth=config.depth,
    heads=config.heads,
    rngs=nnx.Rngs(config.seed),
  )


def make_inner(config: DemoConfig) -> optax.GradientTransformation:
  """The inner optimizer: AdamW with a warmup-cosine learning rate.

  Linear warmup from a tenth of ``config.learning_rate`` over the first 5% of
  ``config.updates``, cosine decay back to a tenth at ``config.updates``. Inside
  :func:`optax_accum.accumulate` its step count, and so the schedule, advance
  once per applied window (reference case C4), not once per microbatch.

  Args:
    config: ``learning_rate``, ``weight_decay`` and ``updates``.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax.numpy as jnp
    >>> tx = make_inner(DemoConfig(updates=100))
    >>> state = tx.init({'w': jnp.zeros(2)})
  """
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=config.learning_rate / 10,
    peak_value=config.learning_rate,
    warmup_steps=max(1, config.updates // 20),
    decay_steps=max(2, config.updates),
    end_value=config.learning_rate / 10,
  )
  return optax.adamw(schedule, weight_decay=config.weight_decay)
