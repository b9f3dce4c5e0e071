"""Tests of optax_accum/_buffers.py: the compiled step keeps every buffer in place.

These fail if a JAX upgrade changes how XLA places the zero updates or the
accumulator reset (docs/design.md): nothing parameter-sized computed between
boundaries on the default path (tx.update + optax.apply_updates), no
parameter-sized copy outside its boundary branch, none at all on the fused path.
"""

import functools
import re

import _compat
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
  """``{computation name: [copy lines]}`` for the parameter-sized copies in the HLO."""
  pattern = r"= f32\[" + ",".join(map(str, shape)) + r"\]\{[^}]*\} copy\("
  found, name = {}, None
  for line in compiled.as_text().splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      name = line.split("(")[0].strip()
    elif re.search(pattern, line):
      found.setdefault(name, []).append(line)
  return found


def _computation(compiled, name):
  text = compiled.as_text()
  start = text.index("\n" + name + " ") + 1 if name != "ENTRY" else text.index("\nENTRY") + 1
  return text[start : text.index("\n}", start)]


@pytest.mark.parametrize(
  "kwargs",
  [{}, {"clip": 1.0, "loss_scale": optax_accum.dynamic_loss_scale()}],
  ids=["plain", "clip_scale"],
)
def test_compiled_step_keeps_buffers_in_place(kwargs):
  """The two train steps on CPU: buffers stay in place (issues 6 and 10).

  Four equal-shape leaves (equal zero broadcasts used to be merged and copied).
  The fused step has no parameter-sized copy and no gradient-sized temporary.
  The default optax step has none outside the boundary branch: between
  boundaries it writes no update buffer (the zero updates are selected from the
  accumulator, _buffers.stash); at a boundary, XLA copies the inner optimizer's
  updates into the accumulator's buffer once (one copy per leaf, one
  gradient-sized temporary).
  """
  if jax.default_backend() != "cpu":
    pytest.skip("the HLO shape is checked for the CPU backend")
  shape = (64, 256)
  params = {f"w{i}": jnp.zeros(shape) for i in range(4)}
  inner = optax.adam(1e-3)
  if "clip" in kwargs:  # the window's clip, inside the inner chain
    inner = optax.chain(optax.clip_by_global_norm(kwargs["clip"]), inner)
  rest = {k: v for k, v in kwargs.items() if k != "clip"}
  tx = optax_accum.accumulate(inner, every_k=4, **rest)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def fused_step(params, state, grads):
    return optax_accum.update_and_apply(tx, grads, state, params)

  param_bytes = 4 * 64 * 256 * 4
  fused = fused_step.lower(params, tx.init(params), params).compile()
  assert _param_sized_copies(fused, shape) == {}
  temp_limit = param_bytes / 2 if _compat.FUSED_STEP_IN_PLACE else param_bytes + 4096
  if "clip" in kwargs:
    # optax's clip inside the inner chain reads the window mean twice (its norm, then the
    # clipped step): XLA keeps the mean as one gradient-sized temporary at the boundary
    # (docs/performance.md). Still no parameter-sized copy.
    temp_limit = param_bytes + 4096
  assert fused.memory_analysis().temp_size_in_bytes < temp_limit

  compiled = step.lower(params, tx.init(params), params).compile()
  copies = _param_sized_copies(compiled, shape)
  assert len(copies) <= 1 and sum(map(len, copies.values())) <= len(params)
  for name in copies:  # only in the boundary branch: the one holding the apply/skip cond
    assert not name.startswith("ENTRY") and " conditional(" in _computation(compiled, name)
  assert compiled.memory_analysis().temp_size_in_bytes <= param_bytes + 4096
  # Between boundaries nothing parameter-sized is computed: the branch passes the
  # accumulator and the inner state through (the zero updates are a select
  # fused into apply_updates).
  entry = _computation(compiled, "ENTRY")
  (branches,) = re.findall(r" conditional\(.*branch_computations=\{([^}]*)\}", entry)
  between = [
    b.strip()
    for b in branches.split(",")
    if " conditional(" not in _computation(compiled, b.strip())
  ]
  assert len(between) == 1
  computed = [
    line
    for line in _computation(compiled, between[0]).splitlines()[1:]
    if "f32[64,256]" in line.split("=")[1].split("(")[0]
    and not re.search(r"\b(get-tuple-element|tuple|parameter)\(", line)
  ]
  assert computed == []
