"""optax_accum/_metrics.py: what metrics() reads, against hand-worked runs."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

PARAMS = {"w": jnp.zeros(2)}


def _run(tx, feeds):
  """Feeds ``(grad, weight, value)`` triples through ``tx.update``; returns the state."""
  state = tx.init(PARAMS)
  for g, w, v in feeds:
    _, state = tx.update({"w": jnp.full(2, g)}, state, PARAMS, weight=w, value=v)
  return state


def test_counters_loss_and_norm_of_a_hand_worked_run():
  # every_k=2: window 1 = (g=1, w=3, loss 1), (g=5, w=1, loss 3); then one open microbatch.
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  m = optax_accum.metrics(_run(tx, [(1.0, 3, 1.0), (5.0, 1, 3.0), (2.0, 7, 0.5)]))
  assert (int(m.mini_step), int(m.num_microbatches), int(m.num_updates)) == (1, 3, 1)
  assert (int(m.num_skipped), bool(m.updated), float(m.pending_weight)) == (0, False, 7.0)
  assert float(m.window_loss) == (3 * 1.0 + 1 * 3.0) / 4 and bool(m.has_window_loss)
  # The window mean is (3 * 1 + 1 * 5) / 4 = 2 in both coordinates: norm 2 * sqrt(2).
  assert float(m.grad_norm) == pytest.approx(2 * 2**0.5, rel=1e-7) and bool(m.has_grad_norm)


def test_features_that_are_off_read_as_documented():
  state = optax_accum.accumulate(optax.sgd(1.0), every_k=2).init(PARAMS)
  m = optax_accum.metrics(state)
  assert float(m.loss_scale) == 1.0 == float(optax_accum.metrics(state).loss_scale)
  assert (float(m.noise_scale), float(m.noise_trace), float(m.noise_signal)) == (0.0, 0.0, 0.0)
  assert m.weight_seen is None and m.window_weight is None  # counted with a token budget
  assert not bool(m.has_window_loss) and not bool(m.has_grad_norm)


def test_loss_scale_and_token_counts_when_on():
  scale = optax_accum.dynamic_loss_scale(init_scale=8.0, growth_interval=1)
  tx = optax_accum.accumulate(optax.sgd(1.0), optax_accum.token_budget(4), loss_scale=scale)
  state = _run(tx, [(8.0, 3, 1.0), (8.0, 2, 1.0)])  # 3 + 2 >= 4: one applied window
  m = optax_accum.metrics(state)
  assert float(m.loss_scale) == 16.0 == float(optax_accum.metrics(state).loss_scale)  # grown once
  assert (int(m.weight_seen), int(m.window_weight)) == (5, 5)


def test_metrics_is_a_getter_that_never_warns_and_works_under_jit():
  tx = optax.apply_if_finite(optax_accum.accumulate(optax.sgd(1.0), every_k=2), 3)  # a pitfall
  state = tx.init(PARAMS)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    m = jax.jit(optax_accum.metrics)(state)
  assert int(m.num_updates) == 0 and int(m.mini_step) == 0


def test_no_or_two_accumulation_states_raise():
  two = optax.chain(
    optax_accum.accumulate(optax.sgd(1.0), 2), optax_accum.accumulate(optax.sgd(1.0), 2)
  )
  for state in (optax.sgd(1.0).init(PARAMS), two.init(PARAMS)):
    with pytest.raises(ValueError, match="expected exactly one"):
      optax_accum.metrics(state)


@pytest.mark.parametrize(
  "every_k, observe, first",
  [
    (optax_accum.adaptive_window(8, 64), (optax_accum.noise_scale(0.9),), "every_k="),
    (4, (optax_accum.noise_scale(0.9), optax_accum.noise_scale(0.5)), "observe[0]"),
  ],
  ids=["adaptive_window_and_an_observer", "two_observers"],
)
def test_two_features_showing_one_metric_are_refused_at_construction(every_k, observe, first):
  """Issue 48: Metrics.noise_scale held whichever feature showed it last, silently."""
  with pytest.raises(ValueError) as e:
    optax_accum.accumulate(optax.sgd(1.0), every_k, observe=observe)
  second = "observe[0]" if first == "every_k=" else "observe[1]"
  assert f"{first} and {second} both show the metric 'noise_scale'" in str(e.value)


def test_features_showing_distinct_metrics_each_fill_their_fields():
  """A token budget's counts and an observed noise scale side by side: each its own field."""
  tx = optax_accum.accumulate(
    optax.sgd(1.0), optax_accum.token_budget(4), observe=(optax_accum.noise_scale(0.0),)
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for g, w in (((1.0, 0.0), 2), ((3.0, 0.0), 2)):  # one window of weight 4
    _, state = tx.update({"w": jnp.array(g)}, state, params, weight=w)
  m = optax_accum.metrics(state)
  assert float(m.window_weight) == 4 and float(m.weight_seen) == 4
  # decay 0: the one window's estimates. |G|^2 and S by hand (McCandlish et al. 2018, App. A):
  # B_small = 2, B_big = 4; |G_small|^2 = (1 + 9) / 2 = 5, |G_big|^2 = ((2*1 + 2*3) / 4)^2 = 4.
  g2 = (4 * 4 - 2 * 5) / (4 - 2)  # (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
  s = (5 - 4) / (1 / 2 - 1 / 4)
  np.testing.assert_allclose(float(m.noise_signal), g2, rtol=1e-6)
  np.testing.assert_allclose(float(m.noise_trace), s, rtol=1e-6)
  np.testing.assert_allclose(float(m.noise_scale), s / g2, rtol=1e-6)
