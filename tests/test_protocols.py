"""optax_accum/_protocols.py: a window policy, a guard and an observer written outside the package.

Issue 38, item 2: each is defined here, from the documented protocols only (docs/protocols.md),
and checked against windows computed by hand. Then ``skip_if`` with an ``optax.MultiSteps``
``should_skip_update_fn``, call for call against MultiSteps itself.
"""

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite

import optax_accum

PARAMS = {"w": jnp.zeros(2)}


def _grads(v):
  return {"w": jnp.asarray(v, jnp.float32)}


# ----------------------------------------------------------------------------- a window policy


class AlternatingState(NamedTuple):
  closed: jax.Array  # windows this policy closed (its own count)


class Alternating:
  """Windows of 2 microbatches after an even number of applied updates, 3 after an odd one."""

  def init(self):
    return AlternatingState(jnp.zeros((), jnp.int32))

  def init_window(self):
    return optax.EmptyState()

  def add(self, window, weight, grads):
    return window

  def closes(self, state, window, position):
    length = jnp.where(position.num_updates % 2 == 0, 2, 3)
    return position.mini_step >= length

  def close(self, state, window, outcome):
    return AlternatingState(state.closed + 1)


def test_a_window_policy_written_outside_the_package():
  tx = optax_accum.accumulate(optax.sgd(1.0), Alternating())
  state = tx.init(PARAMS)
  step = jax.jit(lambda g, s, w: tx.update(g, s, PARAMS, weight=w))
  gs = [1.0, 3.0, 2.0, 4.0, 6.0, 5.0, 7.0, 1.0, 1.0, 9.0]
  ws = [1.0, 1.0, 2.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 2.0]
  emitted = []
  for g, w in zip(gs, ws, strict=True):
    u, state = step(_grads([g, -g]), state, w)
    emitted.append(float(u["w"][0]))
  # By hand: windows [0, 1] (2 after 0 updates), [2, 3, 4] (3 after 1), [5, 6] (2 after 2),
  # [7, 8, 9] (3 after 3); sgd(1) emits minus each window's weighted mean at its last call.
  means = [(1 + 3) / 2, (2 * 2 + 4 + 6) / 4, (3 * 5 + 7) / 4, (1 + 1 + 2 * 9) / 4]
  want = [0, -means[0], 0, 0, -means[1], 0, -means[2], 0, 0, -means[3]]
  np.testing.assert_allclose(emitted, want, rtol=1e-6)
  assert int(state.policy.closed) == 4 == int(optax_accum.metrics(state).num_updates)
  assert_state_finite(state)


class TokenCallback:
  """A token budget read from a callback: the budget is whatever ``budget_of(num_updates)``
  says; the window's weight is summed by the core (``position.weight_sum``)."""

  def __init__(self, budget_of):
    self.budget_of = budget_of

  def init(self):
    return optax.EmptyState()

  def init_window(self):
    return optax.EmptyState()

  def add(self, window, weight, grads):
    return window

  def closes(self, state, window, position):
    return position.weight_sum >= self.budget_of(position.num_updates)

  def close(self, state, window, outcome):
    return state


def test_a_token_budget_from_a_callback_equals_token_budget():
  mine = optax_accum.accumulate(optax.sgd(1.0), TokenCallback(lambda n: 5.0 + 3.0 * n))
  ours = optax_accum.accumulate(
    optax.sgd(1.0), optax_accum.token_budget(lambda n: 5.0 + 3.0 * n, of="num_updates")
  )
  states = [mine.init(PARAMS), ours.init(PARAMS)]
  for i, w in enumerate([2, 2, 2, 4, 1, 3, 5, 1, 1, 6]):
    pairs = zip((mine, ours), states, strict=True)
    outs = [tx.update(_grads([i, 1.0]), s, PARAMS, weight=w) for tx, s in pairs]
    chex.assert_trees_all_close(outs[0][0], outs[1][0], rtol=1e-6)
    states = [o[1] for o in outs]
  assert int(states[0].num_updates) == int(states[1].num_updates) == 3  # budgets 5, 8, 11


class GradEnergy:
  """Closes a window when its microbatches' squared gradient norms sum to ``threshold``: a
  policy whose ``add`` takes the gradient (``add(window, weight, grads)``, issue 40)."""

  def __init__(self, threshold):
    self.threshold = threshold

  def init(self):
    return optax.EmptyState()

  def init_window(self):
    return jnp.zeros((), jnp.float32)

  def add(self, window, weight, grads):
    sq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
    return jnp.where(weight > 0, window + sq, window)

  def closes(self, state, window, position):
    return window >= self.threshold

  def close(self, state, window, outcome):
    return state


def test_a_window_policy_that_reads_each_microbatch_gradient():
  """The window sums of a policy see each microbatch's gradient."""
  tx = optax_accum.accumulate(optax.sgd(1.0), GradEnergy(20.0))
  state = tx.init(PARAMS)
  step = jax.jit(lambda g, s, w: tx.update(g, s, PARAMS, weight=w))
  gs = [1.0, 3.0, 2.0, 2.0, 1.0, 4.0, 5.0]
  ws = [1.0, 2.0, 1.0, 1.0, 2.0, 1.0, 1.0]
  emitted = []
  for g, w in zip(gs, ws, strict=True):
    u, state = step(_grads([g, -g]), state, w)
    emitted.append(float(u["w"][0]))
  # By hand: |g|^2 = 2 g^2 per microbatch: 2 + 18 = 20 closes [0, 1]; 8 + 8 + 2 + 32 = 50
  # closes [2, 3, 4, 5]; 50 closes [6].
  means = [(1 + 2 * 3) / 3, (2 + 2 + 2 * 1 + 4) / 5, 5.0]
  want = [0, -means[0], 0, 0, 0, -means[1], -means[2]]
  np.testing.assert_allclose(emitted, want, rtol=1e-6)
  assert int(optax_accum.metrics(state).num_updates) == 3
  assert_state_finite(state)


def test_a_policy_whose_add_takes_no_gradient_is_refused_when_made():
  class TwoArgumentAdd(GradEnergy):
    def add(self, window, weight):
      return window

  with pytest.raises(TypeError, match=r"cannot take \(window, weight, grads\)"):
    optax_accum.accumulate(optax.sgd(1.0), TwoArgumentAdd(1.0))


def test_a_policy_missing_a_method_is_refused():
  class NoClose:
    def closes(self, state, window, position):
      return True

  with pytest.raises(TypeError, match=r"lacks the methods \['init', 'init_window', 'add'"):
    optax_accum.accumulate(optax.sgd(1.0), NoClose())


# ----------------------------------------------------------------------------- a guard


class LossCapState(NamedTuple):
  judged: jax.Array


class LossCap:
  """Skip a window whose mean loss is above ``cap``; count the windows judged."""

  def __init__(self, cap):
    self.cap = cap

  def init(self):
    return LossCapState(jnp.zeros((), jnp.int32))

  def judge(self, state, stats):
    return stats.has_loss & (stats.loss > self.cap)

  def close(self, state, outcome):
    return LossCapState(state.judged + 1)


def test_a_guard_on_the_window_loss_written_outside_the_package():
  tx = optax_accum.accumulate(optax.sgd(1.0), 2, skip_if=LossCap(5.0))
  state = tx.init(PARAMS)
  step = jax.jit(lambda g, s, w, v: tx.update(g, s, PARAMS, weight=w, value=v))
  # Windows: losses (2, 4) weights (1, 1): mean 3, applied; (4, 10) weights (3, 1): mean 5.5,
  # skipped; (9, 1) weights (1, 3): mean 3, applied.
  feed = [(1.0, 1, 2.0), (3.0, 1, 4.0), (5.0, 3, 4.0), (7.0, 1, 10.0), (2.0, 1, 9.0), (4.0, 3, 1.0)]
  updates = []
  for g, w, v in feed:
    u, state = step(_grads([g, g]), state, jnp.float32(w), jnp.float32(v))
    updates.append(float(u["w"][0]))
  np.testing.assert_allclose(updates, [0, -2.0, 0, 0, 0, -(2 + 3 * 4) / 4], rtol=1e-6)
  m = optax_accum.metrics(state)
  assert (int(m.num_updates), int(m.num_spikes), int(m.num_skipped)) == (2, 1, 0)
  assert int(state.guard.rules[0].judged) == 3


# ----------------------------------------------------------------------------- an observer


class MaxGradState(NamedTuple):
  last_window_max: jax.Array

  def metrics(self):
    return {"max_abs_grad": self.last_window_max}


class MaxGrad:
  """Records the largest |gradient| element of the last closed window's microbatches."""

  def init(self):
    return MaxGradState(jnp.zeros((), jnp.float32))

  def init_window(self, params):
    return jnp.zeros((), jnp.float32)

  def add(self, window, weight, grads):
    big = jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in jax.tree.leaves(grads)]))
    return jnp.where(weight > 0, jnp.maximum(window, big), window)

  def close(self, state, window, outcome):
    return MaxGradState(jnp.where(outcome.empty, state.last_window_max, window))


def test_an_observer_written_outside_the_package():
  tx = optax_accum.accumulate(optax.sgd(1.0), 3, observe=(MaxGrad(), optax_accum.noise_scale(0)))
  state = tx.init(PARAMS)
  step = jax.jit(lambda g, s, w: tx.update(g, s, PARAMS, weight=w))
  windows = [[([1.0, -4.0], 1), ([2.0, 3.0], 1), ([0.5, 0.5], 2)],
             [([-7.0, 1.0], 1), ([jnp.nan, 100.0], 0), ([1.0, 1.0], 1)]]  # fmt: skip
  for window, want in zip(windows, (4.0, 7.0), strict=True):
    for g, w in window:
      _, state = step(_grads(g), state, jnp.float32(w))
    observed = optax_accum.metrics(state).observers
    assert float(observed[0]["max_abs_grad"]) == want  # a weight-0 microbatch is not seen
    assert set(observed[1]) == {"noise_scale", "noise_trace", "noise_signal"}
  assert_state_finite(state)


class MeanOnly(MaxGrad):
  """An observer whose reading needs the window to be the weighted mean."""

  def __init__(self):
    self.asked = []

  def check_aggregation(self, weighted_mean):
    self.asked.append(weighted_mean)
    if not weighted_mean:
      raise ValueError("MeanOnly observes weighted means only")


def test_an_observer_that_needs_the_weighted_mean_is_asked_when_accumulate_is_made():
  mean, fixed = MeanOnly(), MeanOnly()
  optax_accum.accumulate(optax.sgd(1.0), 2, observe=(mean,))
  with pytest.raises(ValueError, match="MeanOnly observes weighted means only"):
    optax_accum.accumulate(
      optax.sgd(1.0), 2, observe=(fixed,), aggregate=optax_accum.aggregate(denominator=8)
    )
  assert (mean.asked, fixed.asked) == ([True], [False])


def test_an_observer_without_the_protocol_is_refused():
  with pytest.raises(TypeError, match=r"observe takes a tuple of observers.*lacks the methods"):
    optax_accum.accumulate(optax.sgd(1.0), 2, observe=(lambda g: g,))


# ----------------------------------------------------------------- optax.MultiSteps' skip protocol


def _stream(n, seed=0, bad=(2, 7, 8)):
  rng = np.random.default_rng(seed)
  gs = [rng.normal(size=3).astype(np.float32) for _ in range(n)]
  for i in bad:
    gs[i][1] = np.nan if i % 2 else np.inf
  return [{"w": jnp.asarray(g)} for g in gs]


@pytest.mark.parametrize(
  "skip",
  [optax.skip_not_finite, functools.partial(optax.skip_large_updates, max_squared_norm=2.0)],
  ids=["skip_not_finite", "skip_large_updates"],
)
def test_skip_if_takes_a_multisteps_should_skip_update_fn_call_for_call(skip):
  """MultiSteps' meaning: a flagged microbatch is dropped and does not count toward every_k."""
  inner = optax.adam(0.1)
  ms = optax.MultiSteps(inner, every_k_schedule=3, should_skip_update_fn=skip)
  acc = optax_accum.accumulate(inner, 3, skip_if=skip)
  params = {"w": jnp.zeros(3)}
  p_ms, s_ms = params, ms.init(params)
  p_acc, s_acc = params, acc.init(params)
  ms_step = jax.jit(ms.update)
  acc_step = jax.jit(lambda g, s, p: optax_accum.update_and_apply(acc, g, s, p))
  dropped = 0
  for g in _stream(14):
    u, s_ms = ms_step(g, s_ms, p_ms)
    p_ms = optax.apply_updates(p_ms, u)
    p_acc, s_acc = acc_step(g, s_acc, p_acc)
    chex.assert_trees_all_close(p_acc, p_ms, rtol=1e-6, atol=1e-7)
    dropped += int(bool(skip(g, 0, None)[0]))
  m = optax_accum.metrics(s_acc)
  assert int(m.num_dropped) == dropped > 0
  assert int(m.num_updates) == int(s_ms.gradient_step) > 0
  assert int(m.num_skipped) == 0  # the dropped microbatches never reached a window
  assert_state_finite(s_acc)


def test_skip_if_tells_a_predicate_from_a_multisteps_function_by_its_arguments():
  with pytest.raises(TypeError, match="cannot tell what"):
    optax_accum.accumulate(optax.sgd(1.0), 2, skip_if=lambda *args: False)
  with pytest.raises(TypeError, match="must return a boolean scalar"):
    tx = optax_accum.accumulate(optax.sgd(1.0), 2, skip_if=lambda u, n, p: (1.0, {}))
    tx.update(_grads([1.0, 1.0]), tx.init(PARAMS), PARAMS)
