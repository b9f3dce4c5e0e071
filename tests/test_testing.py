"""Tests for optax_accum.testing: the pre-flight check, batch-dependent layers, HLO counts."""

import warnings

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest

from optax_accum import testing

tokens = lambda mb: mb["mask"].sum()


def test_passes_on_mlp_with_unequal_token_weights():
  batch = models.linear_regression_data(16)
  batch["mask"] = jnp.asarray(np.random.default_rng(1).integers(0, 2, 16), jnp.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no BatchNorm, no warning
    report = testing.assert_equivalent(
      models.mlp_loss,
      models.mlp_params(),
      batch,
      optax.adam(1e-3),
      num_microbatches=4,
      weight_fn=tokens,
    )
  # Weights are the unmasked rows of each strided microbatch (rows k, k+4, ...).
  expected = [float(batch["mask"][k::4].sum()) for k in range(4)]
  assert report.weights == tuple(expected)
  assert len(set(expected)) > 1
  assert report.num_updates == 1
  assert report.grad_in_step.max_rel < 1e-5 and report.sgd_across_step.max_rel < 1e-5
  assert report.batch_dependent_layers == ()
  # Equal weights would be visibly wrong here: that is the bug the weights avoid.
  assert report.mean_of_means.max_rel > 1e-3
  text = str(report)
  for row in ("gradient, in-step", "sgd(1) step, across-step", "mean of means", "weights ["):
    assert row in text


def test_c1_mean_of_means_row_is_hand_worked():
  """C1: M1 with 1, 3 and 6 valid tokens of y = 1, 3, 0.5: gradient -1.3, mean of means -1.5."""

  def m1_loss(w, batch):
    m = batch["mask"]
    return (0.5 * (w - batch["y"]) ** 2 * m).sum() / jnp.maximum(m.sum(), 1.0)

  y = np.zeros((3, 6), np.float32)
  mask = np.zeros((3, 6), np.float32)
  for row, (n, value) in enumerate([(1, 1.0), (3, 3.0), (6, 0.5)]):
    y[row, :n], mask[row, :n] = value, 1
  batch = {"y": jnp.asarray(y), "mask": jnp.asarray(mask)}
  report = testing.check_equivalence(
    m1_loss, jnp.zeros(()), batch, optax.sgd(1.0), num_microbatches=3, weight_fn=tokens
  )
  assert report.weights == (1.0, 3.0, 6.0)
  np.testing.assert_allclose(report.mean_of_means.max_abs, abs(-1.5 - -1.3), rtol=1e-5)
  np.testing.assert_allclose(report.mean_of_means.scale, 1.3, rtol=1e-5)
  assert report.passed()


def test_detects_a_loss_that_is_not_a_mean():
  """A summed loss makes the weighted microbatches disagree with the batch: the check fails."""
  batch = models.linear_regression_data(8)
  sum_loss = lambda p, b: models.linear_regression_loss(p, b) * b["y"].shape[0]
  with pytest.raises(AssertionError, match="does not reproduce one physical batch"):
    testing.assert_equivalent(
      sum_loss, models.linear_regression_params(), batch, optax.sgd(0.1), num_microbatches=4
    )


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_nnx_mlp_passes_and_batchnorm_fails_with_warning():
  batch = models.linear_regression_data(16)
  report = testing.check_equivalence(
    models.nnx_mlp_loss, models.nnx_mlp(), batch, optax.adamw(1e-3), num_microbatches=4
  )
  assert report.passed(), str(report)

  with pytest.warns(testing.BatchDependentLayerWarning, match="BatchNorm"):
    report = testing.check_equivalence(
      models.nnx_mlp_loss,
      models.nnx_mlp(batch_norm=True),
      batch,
      optax.adamw(1e-3),
      num_microbatches=4,
    )
  assert not report.passed()
  assert report.grad_in_step.max_rel > 1e-2 and report.sgd_across_step.max_rel > 1e-2
  assert report.loss.max_rel > 1e-3  # the empirical probe: per-microbatch statistics differ
  assert report.batch_dependent_layers == ("bn",)
  assert "batch-dependent layers: bn" in str(report)


def test_batchnorm_in_eval_mode_is_not_flagged():
  model = models.nnx_mlp(batch_norm=True)
  model.eval()  # running averages: per-example, accumulation reproduces the batch
  assert testing.batch_dependent_layers(model) == ()
  report = testing.check_equivalence(
    models.nnx_mlp_loss, model, models.linear_regression_data(8), optax.sgd(1.0),
    num_microbatches=2,
  )  # fmt: skip
  assert report.passed(), str(report)


def test_linen_batch_stats_collection_warns():
  variables = {"params": models.linear_regression_params(), "batch_stats": {"BatchNorm_0": {}}}
  with pytest.warns(testing.BatchDependentLayerWarning, match="batch_stats/BatchNorm_0"):
    report = testing.check_equivalence(
      models.linear_regression_loss,
      models.linear_regression_params(),
      models.linear_regression_data(8),
      optax.sgd(1.0),
      num_microbatches=2,
      model=variables,
    )
  assert report.batch_dependent_layers == ("batch_stats/BatchNorm_0",)
  assert testing.batch_dependent_layers({"params": {}}) == ()
  assert testing.batch_dependent_layers(None) == ()


def test_difference_tolerance_rule():
  d = testing._difference({"a": jnp.array([1.0, 2.5])}, {"a": jnp.array([1.0, 2.0])})
  assert (d.max_abs, d.max_rel, d.scale) == (0.5, 0.25, 2.0)
  assert d.ok(rtol=0.25, atol=0.0) and not d.ok(rtol=0.2, atol=0.0) and d.ok(rtol=0, atol=0.5)


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_contiguous_split_reports_its_weights():
  batch = models.token_batch(num_rows=8)
  report = testing.check_equivalence(
    models.token_loss, models.token_params(), batch, optax.sgd(1.0),
    num_microbatches=2, weight_fn=tokens, strided=False,
  )  # fmt: skip
  assert report.weights == (float(batch["mask"][:4].sum()), float(batch["mask"][4:].sum()))
  assert report.passed(), str(report)


def test_indivisible_batch_raises():
  with pytest.raises(ValueError, match="not divisible"):
    testing.check_equivalence(
      models.linear_regression_loss,
      models.linear_regression_params(),
      models.linear_regression_data(10),
      optax.sgd(1.0),
      num_microbatches=4,
    )


def test_ships_only_what_a_users_tests_call():
  """The toy models live in tests/models.py, not in the package."""
  assert sorted(testing.__all__) == [
    "BatchDependentLayerWarning",
    "Difference",
    "EquivalenceReport",
    "assert_equivalent",
    "batch_dependent_layers",
    "check_equivalence",
    "count_collectives",
  ]
  assert not hasattr(testing, "token_loss") and not hasattr(testing, "linear_regression_data")


def test_models_are_deterministic():
  a, b = models.token_batch(seed=3), models.token_batch(seed=3)
  assert jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), a, b))
  assert float(models.token_batch()["mask"][1].sum()) == 0.0  # an all-padding row


def test_testing_is_an_attribute_after_import_optax_accum_without_flax():
  # The README spells it `optax_accum.testing.check_equivalence` after `import optax_accum`;
  # a fresh interpreter where flax cannot be imported must still allow that.
  import subprocess
  import sys

  code = (
    "import sys\n"
    "class NoFlax:\n"
    "  def find_spec(self, name, path=None, target=None):\n"
    "    if name == 'flax' or name.startswith('flax.'):\n"
    "      raise ImportError('flax blocked')\n"
    "sys.meta_path.insert(0, NoFlax())\n"
    "import optax_accum\n"
    "print(optax_accum.testing.check_equivalence.__name__, 'flax' in sys.modules)\n"
    "try:\n"
    "  optax_accum.no_such_name\n"
    "except AttributeError as e:\n"
    "  print(e)\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.splitlines() == [
    "check_equivalence False",
    "module 'optax_accum' has no attribute 'no_such_name'",
  ]
