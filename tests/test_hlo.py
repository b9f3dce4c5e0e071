"""tests/_hlo.py's fusion reader on programs whose fusions are known, and issue 47: the number of
distinct fused computations of a step does not grow with the number of equal leaves."""

import _hlo
import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import optax_accum

LEAF = (64, 64)


def _text(f, *args):
  return jax.jit(f).lower(*args).compile().as_text()


def _leaves(n):
  return {f"w{i:02d}": jnp.full(LEAF, 0.01 * (i + 1), jnp.float32) for i in range(n)}


@pytest.mark.parametrize("n", [8, 16])
def test_identical_ops_on_equal_leaves_are_one_computation(n):
  """``n`` fusion instructions (one per leaf, each its own named computation), one body."""
  text = _text(lambda t: jax.tree.map(lambda x: jnp.sin(x) * 2, t), _leaves(n))
  assert text.count(" fusion(") == n and list(_hlo.fused_computations(text).values()) == [n]
  assert _hlo.distinct_fusions(text) == 1


def test_different_ops_and_constants_are_different_computations():
  x = jnp.ones(LEAF)
  assert _hlo.distinct_fusions(_text(lambda a, b: (jnp.sin(a) * 2, jnp.cos(b) * 2), x, x)) == 2
  # A per-leaf constant (issue 47's pattern) makes one computation per leaf.
  assert _hlo.distinct_fusions(_text(lambda a, b: (jnp.sin(a) * 2, jnp.sin(b) * 3), x, x)) == 2


def test_callees_compare_by_body():
  """Two reductions whose fused bodies differ only in the name of their ``to_apply``."""
  x = jnp.ones(LEAF)
  reduce = lambda op: lambda a: lax.reduce(a, 0.0, op, (0, 1))
  same = _text(lambda a, b: (reduce(lax.add)(a), reduce(lax.add)(b)), x, x)
  other = _text(lambda a, b: (reduce(lax.add)(a), reduce(lax.max)(b)), x, x)
  if " reduce(" in same and not _hlo.fused_computations(same):
    pytest.skip("this XLA:CPU (jaxlib 0.7) does not fuse reductions: no fused bodies to compare")
  assert sorted(_hlo.fused_computations(same).values()) == [2]
  assert sorted(_hlo.fused_computations(other).values()) == [1, 1]


def test_names_and_metadata_do_not_count():
  """The same program from two functions (other names, other source lines) reads the same."""
  x = jnp.ones(LEAF)

  def first(a, b):
    return jnp.exp(a) + b

  def second(p, q):
    return jnp.exp(p) + q

  assert _hlo.fused_computations(_text(first, x, x)) == _hlo.fused_computations(_text(second, x, x))
  assert _hlo.fused_computations("HloModule empty") == {}


def _step(tx, fused):
  def step(params, state, grads):
    if fused:
      return optax_accum.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.parametrize(
  "make, fused",
  [
    pytest.param(lambda: optax.adam(1e-3), False, id="adam"),
    pytest.param(lambda: optax.MultiSteps(optax.adam(1e-3), 4), False, id="multisteps"),
    pytest.param(lambda: optax_accum.accumulate(optax.adam(1e-3), 4), False, id="accumulate"),
    pytest.param(lambda: optax_accum.accumulate(optax.adam(1e-3), 4), True, id="update_and_apply"),
    pytest.param(
      lambda: optax_accum.accumulate(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        4,
        loss_scale=optax_accum.dynamic_loss_scale(),
        skip_if=optax_accum.spike_rule("grad_norm"),
      ),
      True,
      id="all_features",
    ),
  ],
)
def test_distinct_fusions_do_not_grow_with_equal_leaves(make, fused):
  """8 and 16 equal leaves: as many distinct kernels (issue 47: each leaf's zeros once carried a
  per-leaf constant, 49 -> 57; benchmarks/compile.py times the cost)."""
  counts = []
  for n in (8, 16):
    tx, params = make(), _leaves(n)
    counts.append(_hlo.distinct_fusions(_text(_step(tx, fused), params, tx.init(params), params)))
  assert counts[1] == counts[0], counts
