"""Tests of optax_accum/_deprecated.py: old top-level names warn and still work."""

import jax.numpy as jnp
import optax
import pytest

import optax_accum
from optax_accum import _deprecated


@pytest.mark.parametrize("name", sorted(_deprecated.MOVED))
def test_old_names_warn_with_the_new_spelling(name):
  _, instead = _deprecated.MOVED[name]
  with pytest.warns(DeprecationWarning, match=instead.split("(")[0].replace(".", r"\.")):
    obj = getattr(optax_accum, name)
  assert callable(obj)
  assert name not in optax_accum.__all__


def test_apply_if_updated_still_applies_only_on_updates():
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  with pytest.warns(DeprecationWarning):
    apply_if_updated = optax_accum.apply_if_updated
  u, state = tx.update({"w": jnp.array([1.0, 3.0])}, state, params)
  assert float(apply_if_updated(params, u, state)["w"][0]) == 1.0  # skipped
  u, state = tx.update({"w": jnp.array([3.0, 1.0])}, state, params)
  assert float(apply_if_updated(params, u, state)["w"][0]) == -1.0  # 1 - mean grad 2


def test_public_surface_is_small():
  assert len(optax_accum.__all__) == len(set(optax_accum.__all__)) <= 15  # + issue 15's one
  assert all(hasattr(optax_accum, name) for name in optax_accum.__all__)
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    _ = optax_accum.nope
