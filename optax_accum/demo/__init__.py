"""The demo: a small Flax NNX character-level transformer on Python's own sources.

Needs the ``flax`` extra (``pip install "optax_accum[flax]"``). Submodules:
``data`` (the standard-library text, cut into padded lines with a token mask)
and ``model`` (the transformer and its token-weighted loss).
"""
