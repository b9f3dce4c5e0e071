"""Tests of optax_accum/_buffers.py: the compiled step keeps every buffer in place.

These fail if a JAX upgrade changes how XLA places the zero updates or the
accumulator reset (docs/design.md): no parameter-sized copy in the compiled
step, on the default path (tx.update + optax.apply_updates) and the fused one.
"""

import functools
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum
from optax_accum import _buffers


def test_distinct_zeros_are_exact_and_keep_dtypes():
  like = {"a": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.full(4, jnp.nan)}
  for flag in (True, False):
    out = jax.jit(_buffers.distinct_zeros)(like, jnp.asarray(flag))
    assert out["a"].dtype == jnp.bfloat16 and out["b"].dtype == jnp.float32
    assert not any(bool(jnp.any(x != 0)) for x in jax.tree.leaves(out))


def test_zeros_like_placed_reads_nothing_of_a_nan():
  out = jax.jit(_buffers.zeros_like_placed, static_argnums=1)(jnp.full(3, jnp.nan), jnp.float32)
  assert out.dtype == jnp.float32 and not bool(jnp.any(out != 0))


def _param_sized_copies(compiled, shape):
  pattern = r"= f32\[" + ",".join(map(str, shape)) + r"\]\{[^}]*\} copy\("
  return [line for line in compiled.as_text().splitlines() if re.search(pattern, line)]


@pytest.mark.parametrize(
  "kwargs",
  [{}, {"clip_norm": 1.0, "loss_scale": optax_accum.dynamic_loss_scale()}],
  ids=["plain", "clip_scale"],
)
def test_compiled_step_has_no_param_sized_copies(kwargs):
  """The recommended step on CPU: buffers stay in place (the point of issue 6).

  Four equal-shape leaves (equal zero broadcasts used to be merged and copied);
  temp memory is one gradient-sized buffer (the updates), not more.
  """
  if jax.default_backend() != "cpu":
    pytest.skip("the HLO shape is checked for the CPU backend")
  shape = (64, 256)
  params = {f"w{i}": jnp.zeros(shape) for i in range(4)}
  tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4, **kwargs)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def fused_step(params, state, grads):
    return optax_accum.update_and_apply(tx, grads, state, params)

  param_bytes = 4 * 64 * 256 * 4
  for f in (step, fused_step):
    compiled = f.lower(params, tx.init(params), params).compile()
    assert _param_sized_copies(compiled, shape) == []
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= param_bytes + 4096
