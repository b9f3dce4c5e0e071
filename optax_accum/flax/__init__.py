"""Flax integration for :mod:`optax_accum` (needs the ``flax`` extra).

Import it explicitly; ``import optax_accum`` never imports Flax::

  import optax_accum.flax

NNX: use ``nnx.Optimizer(model, optax_accum.accumulate(...), wrt=nnx.Param)``
and ``optimizer.update(model, grads, weight=n_tokens)`` directly; the helpers
here read the update counter (:func:`num_updates`; ``optimizer.step`` counts
microbatches) and close (:func:`flush`) or drop (:func:`discard`) the open
window in place.

Linen: :class:`TrainState` forwards ``weight``/``flush`` and counts applied
updates in ``step``.
"""

try:
  import flax  # noqa: F401 - only to say what to install
except ModuleNotFoundError as e:
  raise ModuleNotFoundError(
    'optax_accum.flax needs Flax: pip install "optax_accum[flax]" '
    '(from a clone of the repository: pip install -e ".[flax]")',
    name=e.name,
  ) from e

from optax_accum.flax._linen import TrainState  # noqa: E402
from optax_accum.flax._nnx import Optimizer, discard, flush, num_updates  # noqa: E402

__all__ = ["Optimizer", "TrainState", "discard", "flush", "num_updates"]
