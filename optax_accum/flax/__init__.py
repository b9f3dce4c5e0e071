"""Flax integration for :mod:`optax_accum` (needs the ``flax`` extra).

Import it explicitly; ``import optax_accum`` never imports Flax::

  import optax_accum.flax

NNX: :class:`Optimizer` (``nnx.Optimizer`` on the fused path, ``step`` counts
applied updates). Linen: :class:`TrainState` forwards ``weight``/``flush`` and
counts applied updates in ``step``. Both close the last window with
``flush=True`` on its last microbatch. In-step: :func:`microbatched_value_and_grad` of an NNX
module's loss (split, merge and state threading done for you).
"""

try:
  import flax  # noqa: F401 - only to say what to install
except ModuleNotFoundError as e:
  raise ModuleNotFoundError(
    'optax_accum.flax needs Flax: pip install "optax_accum[flax]" '
    '(from a clone of the repository: pip install -e ".[flax]")',
    name=e.name,
  ) from e

from optax_accum.flax._in_step import microbatched_value_and_grad  # noqa: E402
from optax_accum.flax._linen import TrainState  # noqa: E402
from optax_accum.flax._nnx import Optimizer  # noqa: E402

__all__ = ["Optimizer", "TrainState", "microbatched_value_and_grad"]
