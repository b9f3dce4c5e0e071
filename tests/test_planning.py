"""Tests of optax_accum._planning: the plan equals an exhaustive scan of the candidates."""

import math

import _compat
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import optax_accum
from optax_accum import _planning as planning
from optax_accum._planning import MicrobatchPlan, parse_bytes, plan_microbatch

SIZES = (3, 32, 32, 1)  # the MLP's widths


def _sds(tree, sharding=None):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _mlp_batch(rows, sharding=None):
  return {
    "x": jax.ShapeDtypeStruct((rows, SIZES[0]), jnp.float32, sharding=sharding),
    "y": jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=sharding),
  }


def _across_step():
  """One microbatch per call: accumulate(adam, every_k=4), params and state donated."""
  tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4)
  params = models.mlp_params(SIZES)
  abstract = _sds((params, tx.init(params)))

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(models.mlp_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, weight=len(batch["y"]), value=loss)
    return optax.apply_updates(params, updates), opt_state

  step = jax.jit(step, donate_argnums=(0, 1))
  return step, lambda size: (*abstract, _mlp_batch(size))


def _in_step(num_microbatches=4):
  """The whole batch per call: K microbatches of ``size`` rows in one lax.scan."""
  params = models.mlp_params(SIZES)
  value_and_grad = optax_accum.microbatched_value_and_grad(models.mlp_loss, num_microbatches)
  step = jax.jit(value_and_grad)
  return step, lambda size: (_sds(params), _mlp_batch(num_microbatches * size))


def _exhaustive(step, make_args, sizes):
  return {s: planning.compiled_peak_bytes(step, *make_args(s)) for s in sizes}


def _largest_fitting(exhaustive, budget):
  return max(s for s, b in exhaustive.items() if b <= budget)


def _check_against_exhaustive(step, make_args, sizes, index):
  """The plan is the exhaustive scan's answer, found with few compilations.

  One real plan (its budget between ``sizes[index]`` and the next size's bytes), then
  the same search over the scan's bytes for budgets at and between every pair of sizes.
  """
  exhaustive = _exhaustive(step, make_args, sizes)
  values = [exhaustive[s] for s in sizes]
  assert values == sorted(values) and values[0] < values[-1]  # bytes grow with the size
  budget = (values[index] + values[index + 1]) // 2
  plan = plan_microbatch(step, make_args, memory_budget=budget, sizes=sizes)
  assert plan.size == _largest_fitting(exhaustive, budget) == sizes[index]
  assert plan.peak_bytes == exhaustive[plan.size] <= budget < exhaustive[sizes[index + 1]]
  assert plan.measured == {s: exhaustive[s] for s in plan.measured}
  assert plan.num_compilations == len(plan.measured) <= math.log2(len(sizes)) + 2
  for i in range(len(sizes) - 1):
    for budget in (values[i], (values[i] + values[i + 1]) // 2):  # exactly at, and between
      measured = planning._search(sizes, exhaustive.__getitem__, budget, known={})
      assert _largest_fitting(measured, budget) == _largest_fitting(exhaustive, budget)
      assert len(measured) <= 2 * math.ceil(math.log2(len(sizes))) + 3, (budget, measured)
  return exhaustive


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_across_step_plan_equals_exhaustive_scan():
  step, make_args = _across_step()
  sizes = [2, 8, 32, 128, 512]
  exhaustive = _check_against_exhaustive(step, make_args, sizes, index=2)
  # The rows' bytes are counted: x (3 floats) and y (1 float) per row at least.
  assert exhaustive[512] - exhaustive[2] >= 510 * 4 * 4


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_in_step_plan_equals_exhaustive_scan():
  step, make_args = _in_step(num_microbatches=4)
  sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
  _check_against_exhaustive(step, make_args, sizes, index=5)


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_sharded_plan_is_per_device():
  assert len(jax.devices()) == 8
  mesh = _compat.make_mesh((8,), ("data",))
  rows, replicated = (
    NamedSharding(mesh, PartitionSpec("data")),
    NamedSharding(mesh, PartitionSpec()),
  )
  params = _sds(models.mlp_params(SIZES), replicated)
  step = jax.jit(jax.value_and_grad(models.mlp_loss), out_shardings=replicated)
  sizes = [512 * 2**i for i in range(6)]

  def make_args(size):
    return params, _mlp_batch(size, rows)

  exhaustive = _check_against_exhaustive(step, make_args, sizes, index=3)
  # Per device: each of the 8 devices holds 1/8 of the rows, so its bytes are about those
  # of the same step on one device with 1/8 of the rows.
  single = jax.jit(jax.value_and_grad(models.mlp_loss))
  for size in (sizes[0], sizes[-1]):
    one_device = planning.compiled_peak_bytes(
      single, _sds(models.mlp_params(SIZES)), _mlp_batch(size // 8)
    )
    np.testing.assert_allclose(exhaustive[size], one_device, rtol=0.01)


def _linear(size):
  return 1000 + 37 * size


@pytest.mark.parametrize(
  "bytes_at",
  [
    _linear,
    lambda s: 64 * -(-(1000 + 37 * s) // 64),  # linear, rounded up to 64-byte alignment
    lambda s: 5 * s * s,  # convex: the first secant guess is short
    lambda s: 1000 * math.isqrt(s),  # concave, with flat steps
    lambda s: 10 if s < 900 else 10**9,  # a cliff (a different algorithm above 900 rows)
  ],
  ids=["linear", "aligned", "convex", "concave-steps", "cliff"],
)
@pytest.mark.parametrize("budget", [1_000, 40_000, 123_457, 5_000_000])
def test_search_equals_brute_force(bytes_at, budget):
  cands = range(1, 1001)
  if bytes_at(1) > budget:
    return
  measured = planning._search(cands, bytes_at, budget, known={})
  answer = max(s for s, b in measured.items() if b <= budget)
  assert answer == max(s for s in cands if bytes_at(s) <= budget)
  # Settled: the next candidate was compiled and does not fit (or the answer is the last).
  assert answer == cands[-1] or bytes_at(answer + 1) > budget and answer + 1 in measured
  assert len(measured) <= 2 * math.ceil(math.log2(len(cands))) + 3


def test_linear_bytes_take_at_most_four_compilations():
  for budget in range(1_100, 38_000, 997):
    measured = planning._search(range(1, 1001), _linear, budget, known={})
    assert len(measured) <= 4, (budget, measured)


def test_a_line_a_few_rows_off_takes_a_few_more():
  # 2**20 - 1 candidates; the line through the probes predicts 30,999 rows, 7 short.
  def bytes_at(size):
    return 20_209 if size == 1 else 2_064 * size + 1_600

  budget = 64_000_000
  measured = planning._search(range(1, 2**20), bytes_at, budget, known={})
  answer = (budget - 1_600) // 2_064
  assert max(s for s, b in measured.items() if b <= budget) == answer
  assert answer == 31_006 and answer + 1 in measured
  # 2 probes, the prediction, 4 gallop steps (1, 2, 4, 8 rows), 3 bisection steps; plain
  # bisection would take 2 + 20.
  assert len(measured) == 10


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_known_sizes_are_not_compiled():
  step, make_args = _in_step(num_microbatches=2)
  sizes = range(1, 257)
  budget = planning.compiled_peak_bytes(step, *make_args(100))
  fresh = plan_microbatch(step, make_args, memory_budget=budget, sizes=sizes)
  known = {256: fresh.measured[256]}
  reused = plan_microbatch(step, make_args, memory_budget=budget, sizes=sizes, known=known)
  assert fresh.size == reused.size >= 100
  assert reused.num_compilations == fresh.num_compilations - 1


def test_fitted_line_goes_through_the_probes():
  step, make_args = _in_step(num_microbatches=1)
  plan = plan_microbatch(step, make_args, memory_budget="1GB", sizes=[2, 10, 50])
  assert plan.size == 50 and plan.num_compilations == 2
  for s in (2, 50):
    np.testing.assert_allclose(plan.fixed_bytes + plan.bytes_per_row * s, plan.measured[s])


def test_parse_bytes():
  assert parse_bytes("200MB") == 200 * 1000**2
  assert parse_bytes("1.5GiB") == 3 * 2**29
  assert parse_bytes(" 512 kib ") == 512 * 1024
  assert parse_bytes("2e3") == parse_bytes("2000B") == parse_bytes(2000) == 2000
  for bad in ("", "MB", "12 parsecs", "-5MB", "1.2.3GB"):
    with pytest.raises(ValueError, match="like '200MB'"):
      parse_bytes(bad)
  for bad in (0, "0.1B"):
    with pytest.raises(ValueError, match="at least 1 byte"):
      parse_bytes(bad)
  for bad in (True, 2.5e9, None):
    with pytest.raises(TypeError, match="memory size"):
      parse_bytes(bad)


def test_default_budget():
  with pytest.raises(ValueError, match="memory_budget="):  # CPU reports no bytes_limit
    planning.default_budget()
  with pytest.raises(ValueError, match="memory_budget="):
    plan_microbatch(*_in_step(), sizes=[1, 2])

  class FakeGpu:
    def memory_stats(self):
      return {"bytes_limit": 80 * 10**9, "bytes_in_use": 0}

  assert planning.default_budget(FakeGpu()) == 72 * 10**9  # 10% margin, by hand


def test_errors_name_the_argument_and_the_fix():
  step, make_args = _in_step()
  with pytest.raises(ValueError, match=r"smallest candidate microbatch \(4 rows\).*memory_budget"):
    plan_microbatch(step, make_args, memory_budget=100, sizes=[4, 8])
  with pytest.raises(TypeError, match=r"tuple of step_fn's positional arguments.*\(arg,\)"):
    plan_microbatch(step, lambda s: make_args(s)[1], memory_budget="1GB", sizes=[1])
  with pytest.raises(ValueError, match="sizes must be ints >= 1"):
    plan_microbatch(step, make_args, memory_budget="1GB", sizes=[0, 4])
  with pytest.raises(ValueError, match="sizes is empty"):
    plan_microbatch(step, make_args, memory_budget="1GB", sizes=[])


def _plan(size):
  return MicrobatchPlan(size, 0, 0, {}, 0, 0, 0.0, 0.0)


def test_microbatches_for():
  split = _plan(48).microbatches_for(256)
  assert (split.microbatch_size, split.num_microbatches, split.every_k) == (32, 8, 8)
  assert _plan(1000).microbatches_for(256) == (256, 1)
  assert _plan(50).microbatches_for(90) == (45, 2)
  assert _plan(50).microbatches_for(90, multiple_of=6) == (30, 3)
  assert _plan(7).microbatches_for(97) == (1, 97)  # a prime: microbatches of one row
  with pytest.raises(ValueError, match="multiple_of=8"):
    _plan(48).microbatches_for(100, multiple_of=8)
  with pytest.raises(ValueError, match="global_batch must be >= 1"):
    _plan(48).microbatches_for(0)
  with pytest.raises(TypeError, match="multiple_of must be a positive int"):
    _plan(48).microbatches_for(64, multiple_of=2.0)


@pytest.mark.slow
def test_split_keeps_the_physical_batch_gradient():
  # In-step with the split's num_microbatches gives the gradient of the whole batch.
  params = models.mlp_params(SIZES)
  batch = models.linear_regression_data(90)
  split = _plan(50).microbatches_for(90)
  grad = optax_accum.microbatched_value_and_grad(models.mlp_loss, split.num_microbatches)
  _, got = jax.jit(grad)(params, batch)
  want = jax.grad(models.mlp_loss)(params, batch)
  assert split.num_microbatches == 2
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)
