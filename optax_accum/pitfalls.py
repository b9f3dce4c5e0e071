"""The warning of ``optax_accum``'s pitfall checks: :class:`PitfallWarning`.

``accumulate`` and the functions around it (``update_and_apply``, ``flush``, ``discard``, the
Flax integrations, ``testing.check_equivalence``) look for what defeats accumulation (a
schedule outside ``accumulate``, ``optax.apply_if_finite`` around it, a plain
``nnx.Optimizer``'s step counter, BatchNorm, ...) in optax's and Flax's public types, and warn
with the fix. None is wrong in every case, so they warn, once per call site by default. To
silence them::

  warnings.filterwarnings("ignore", category=optax_accum.pitfalls.PitfallWarning)
"""

from __future__ import annotations

__all__ = ["PitfallWarning"]


class PitfallWarning(UserWarning):
  """A transformation or layer around or inside :func:`optax_accum.accumulate` that defeats it.

  The message names the pitfall and the fix. Filter it like any warning:

  Examples:
    >>> import warnings, optax_accum
    >>> warnings.filterwarnings("ignore", category=optax_accum.pitfalls.PitfallWarning)
    >>> warnings.resetwarnings()
  """
