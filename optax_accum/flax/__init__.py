"""Flax integration for :mod:`optax_accum` (needs the ``flax`` extra).

Import it explicitly; ``import optax_accum`` never imports Flax::

  import optax_accum.flax

NNX: :class:`Optimizer`, a drop-in ``nnx.Optimizer`` on the fused path whose
``step`` counts applied updates (``flush`` and ``discard`` are methods). A plain
``nnx.Optimizer(model, optax_accum.accumulate(...), wrt=nnx.Param)`` also works;
for it, :func:`num_updates`, :func:`flush` and :func:`discard` read the update
counter and close or drop the open window in place.

Linen: :class:`TrainState` forwards ``weight``/``flush``, takes the fused path
and counts applied updates in ``step``.

See docs/design.md for the module map.
"""

from optax_accum.flax._linen import TrainState
from optax_accum.flax._nnx import Optimizer, discard, flush, num_updates

__all__ = ["Optimizer", "TrainState", "discard", "flush", "num_updates"]
