"""Real text that every machine with Python has: the standard library's sources.

The files are read as bytes (vocabulary of 256), split into lines, and lines
are cut to at most ``seq_len + 1`` bytes. Lines have different lengths, so a
batch of them padded to one length holds different numbers of real tokens per
row: exactly the case where weighting microbatches by token count matters.
"""

from __future__ import annotations

import glob
import os
import sysconfig

import numpy as np

VOCAB_SIZE = 256
PAD = 0  # NUL never occurs in Python source, so it is free for padding.


def stdlib_lines(max_files: int = 40, min_len: int = 2) -> list[bytes]:
  """Non-empty lines of the first ``max_files`` ``*.py`` files of the standard library.

  Args:
    max_files: how many files (sorted by name) to read.
    min_len: drop lines shorter than this many bytes (after stripping).

  Returns:
    A list of ``bytes`` lines, deterministic for a given Python installation.

  Raises:
    FileNotFoundError: if no standard-library sources are found.

  Examples:
    >>> lines = stdlib_lines(max_files=2)
    >>> len(lines) > 100 and all(isinstance(x, bytes) for x in lines)
    True
  """
  root = sysconfig.get_paths()["stdlib"]
  files = sorted(glob.glob(os.path.join(root, "*.py")))[:max_files]
  if not files:
    raise FileNotFoundError(f"No Python sources found under {root}.")
  lines = []
  for path in files:
    with open(path, "rb") as f:
      for line in f.read().split(b"\n"):
        line = line.strip()
        if len(line) >= min_len:
          lines.append(line)
  return lines


def encode(lines: list[bytes], seq_len: int) -> dict[str, np.ndarray]:
  """Pads byte lines into next-token-prediction arrays.

  Args:
    lines: byte strings; each is cut to ``seq_len + 1`` bytes.
    seq_len: model context length.

  Returns:
    ``{'inputs': int32[N, seq_len], 'targets': int32[N, seq_len],
    'mask': float32[N, seq_len]}``; ``mask`` is 1 where the target is a real
    byte, 0 on padding.

  Examples:
    >>> b = encode([b'abc', b'hello world'], seq_len=4)
    >>> b['mask'].sum(axis=1).tolist()
    [2.0, 4.0]
  """
  n = len(lines)
  tokens = np.full((n, seq_len + 1), PAD, np.int32)
  lengths = np.zeros(n, np.int32)
  for i, line in enumerate(lines):
    ids = np.frombuffer(line[: seq_len + 1], np.uint8)
    tokens[i, : len(ids)] = ids
    lengths[i] = len(ids)
  mask = (np.arange(seq_len)[None, :] < (lengths[:, None] - 1)).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def batches(
  seq_len: int, batch_size: int, *, seed: int = 0, max_files: int = 40
) -> tuple[dict[str, np.ndarray], ...]:
  """Shuffled, padded batches of standard-library lines (one epoch).

  Args:
    seq_len: model context length.
    batch_size: rows per batch (the last partial batch is dropped).
    seed: shuffling seed.
    max_files: how many standard-library files to read.

  Returns:
    A tuple of batches as returned by :func:`encode`.

  Examples:
    >>> bs = batches(seq_len=16, batch_size=8, max_files=2)
    >>> bs[0]['inputs'].shape, bs[0]['mask'].dtype
    ((8, 16), dtype('float32'))
  """
  lines = stdlib_lines(max_files=max_files)
  order = np.random.default_rng(seed).permutation(len(lines))
  data = encode([lines[i] for i in order], seq_len)
  n = len(lines) // batch_size
  return tuple(
    {k: v[i * batch_size : (i + 1) * batch_size] for k, v in data.items()} for i in range(n)
  )
