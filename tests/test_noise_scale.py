"""Tests of the gradient noise scale (optax_accum/_noise_scale.py), through every entry point.

Expectations come from elsewhere: NumPy float64 of the estimator's formulas on
the per-microbatch gradients (computed in the test from the data), McCandlish
et al.'s equal-size formulas, and the analytic ``tr(Sigma)`` and ``|G|^2`` of
models whose gradient distribution is known (a scalar mean estimation, and a
Gaussian linear regression). Every run of many windows is one jitted
``lax.scan``.
"""

from __future__ import annotations

import _compat
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite
from _steps import call, make_step
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _noise_scale, testing

# ----------------------------------------------------------------------------- references


def reference_estimates(grads, weights):
  """float64 ``(S_est, G2_est)`` of one window, or None for fewer than 2 nonzero weights.

  grads: [K, d] per-microbatch mean gradients; weights: [K] their n_k.
  """
  keep = weights != 0
  g, n = np.asarray(grads, np.float64)[keep], np.asarray(weights, np.float64)[keep]
  k, total = len(n), n.sum()
  if k < 2:
    return None
  mean = (n[:, None] * g).sum(0) / total
  g2_big = mean @ mean
  sq = (n * (g**2).sum(1)).sum()
  return (sq - total * g2_big) / (k - 1), (k * g2_big - sq / total) / (k - 1)


def reference_ema(windows, decay):
  """float64 bias-corrected ``(B_simple, EMA(S), EMA(G2))`` over ``[(grads, weights), ...]``."""
  s_ema = g_ema = weight = 0.0
  for grads, weights in windows:
    est = reference_estimates(grads, weights)
    if est is None:
      continue
    s_ema = decay * s_ema + (1 - decay) * est[0]
    g_ema = decay * g_ema + (1 - decay) * est[1]
    weight = decay * weight + (1 - decay)
    # (the state keeps the numerators; the metrics divide by the weight)
  s, g = s_ema / weight, g_ema / weight
  return s / g, s, g


def noise_metrics(state):
  m = optax_accum.metrics(state)
  return np.array([m.noise_scale, m.noise_trace, m.noise_signal], np.float64)


# ----------------------------------------------------------------------------- models


def masked_mean_loss(params, y, mask):
  """Scalar model: masked mean of 0.5 * (w - y)**2; its gradient is mean(w - y)."""
  per = 0.5 * (params["w"] - y) ** 2
  return jnp.sum(jnp.where(mask, per, 0.0)) / jnp.sum(mask)


def regression_loss(params, x, y, mask):
  """Linear regression, theta split into two leaves: masked mean of 0.5 * (x @ theta - y)**2."""
  theta = jnp.concatenate([params["a"], params["b"]])
  per = 0.5 * (x @ theta - y) ** 2
  return jnp.sum(jnp.where(mask, per, 0.0)) / jnp.sum(mask)


def run_windows(tx, params, loss, *data):
  """Feeds every microbatch (leading axis of ``data``) through ``tx`` in one jitted scan.

  The params are not moved (the estimator needs only the gradients), so every window's
  gradients are taken at ``params``.
  """

  @jax.jit
  def run(state, data):
    def body(state, xs):
      g = jax.grad(loss)(params, *xs)
      _, state = tx.update(g, state, params, weight=jnp.sum(xs[-1]))
      return state, g

    return jax.lax.scan(body, state, data)

  return run(tx.init(params), data)


def scalar_data(num_windows, k, seed, mu=1.0, sigma=2.0, max_n=16):
  """Microbatches of 1..max_n samples of N(mu, sigma**2): y, mask [W*K, max_n], weights [W, K]."""
  rng = np.random.default_rng(seed)
  n = rng.integers(1, max_n + 1, size=(num_windows, k))
  y = rng.normal(mu, sigma, size=(num_windows * k, max_n)).astype(np.float32)
  mask = np.arange(max_n) < n.reshape(-1, 1)
  return y, mask, n


# ----------------------------------------------------------------------------- known answers


def test_scalar_model_unequal_sizes_known_answer_and_formulas():
  """loss 0.5 (w - y)^2 at w = 0, y ~ N(mu, sigma^2): G = -mu, tr Sigma = sigma^2."""
  mu, sigma, k, windows, decay = 1.0, 2.0, 4, 400, 0.99
  y, mask, n = scalar_data(windows, k, seed=0, mu=mu, sigma=sigma)
  tx = optax_accum.accumulate(optax.sgd(1.0), k, observe=(optax_accum.noise_scale(decay),))
  params = {"w": jnp.zeros(())}
  state, _ = run_windows(tx, params, masked_mean_loss, y, mask)
  got = noise_metrics(state)
  # The per-microbatch gradients computed here from the data: -mean(y) over the mask.
  g = -np.where(mask, y.astype(np.float64), 0).sum(1) / mask.sum(1)
  expected = reference_ema(
    [(g.reshape(windows, k)[i, :, None], n[i]) for i in range(windows)], decay
  )
  np.testing.assert_allclose(got, expected, rtol=2e-4)
  truth = np.array([sigma**2 / mu**2, sigma**2, mu**2])
  np.testing.assert_allclose(got, truth, rtol=0.25)
  assert_state_finite(state)


def test_equal_sizes_reproduce_mccandlish_formulas():
  """n_k = n: |G|^2 and tr(Sigma) from B_small = n, B_big = K n (McCandlish et al., app. A)."""
  k, n = 5, 3.0
  rng = np.random.default_rng(1)
  grads = [{"a": rng.normal(size=(2, 3)), "b": rng.normal(size=4) + 1.0} for _ in range(k)]
  flat = np.stack([np.concatenate([g["a"].ravel(), g["b"]]) for g in grads])
  small = np.mean((flat**2).sum(1))  # |G_small|^2: the mean over microbatches
  big = np.sum(flat.mean(0) ** 2)  # |G_big|^2: the window mean
  b_small, b_big = n, k * n
  signal = (b_big * big - b_small * small) / (b_big - b_small)
  trace = (small - big) / (1 / b_small - 1 / b_big)
  tx = optax_accum.accumulate(optax.sgd(0.0), k, observe=(optax_accum.noise_scale(0.0),))
  params = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), grads[0])
  step = make_step(tx)
  state = tx.init(params)
  for g in grads:
    _, state, _ = call(step, jax.tree.map(jnp.float32, g), state, params, weight=n)
  np.testing.assert_allclose(noise_metrics(state), [trace / signal, trace, signal], rtol=1e-5)


def test_linear_regression_analytic_covariance():
  """x ~ N(0, I_d), y = x . theta* + eps: at theta = theta* + delta, G = delta and
  Sigma = (|delta|^2 + s^2) I + delta delta^T (Isserlis), so tr Sigma = d (|delta|^2 + s^2)
  + |delta|^2."""
  d, s, k, windows, max_n, decay = 4, 1.0, 8, 300, 8, 0.98
  theta_star = np.array([0.5, -1.0, 2.0, 0.0])
  delta = np.array([1.0, 0.5, -0.5, 0.25])
  rng = np.random.default_rng(2)
  m = windows * k
  n = rng.integers(1, max_n + 1, size=(windows, k))
  x = rng.normal(size=(m, max_n, d))
  y = x @ theta_star + s * rng.normal(size=(m, max_n))
  mask = np.arange(max_n) < n.reshape(-1, 1)
  theta = theta_star + delta
  params = {"a": jnp.asarray(theta[:2], jnp.float32), "b": jnp.asarray(theta[2:], jnp.float32)}
  tx = optax_accum.accumulate(optax.sgd(1.0), k, observe=(optax_accum.noise_scale(decay),))
  f32 = lambda a: a.astype(np.float32)
  state, _ = run_windows(tx, params, regression_loss, f32(x), f32(y), mask)
  got = noise_metrics(state)
  # float64 per-microbatch gradients: mean over the mask of x * (x . theta - y).
  r = np.where(mask, x @ theta - y, 0.0)
  g = np.einsum("mtd,mt->md", x, r) / mask.sum(1, keepdims=True)
  grads = g.reshape(windows, k, d)
  np.testing.assert_allclose(
    got, reference_ema([(grads[i], n[i]) for i in range(windows)], decay), rtol=1e-3
  )
  d2 = delta @ delta
  trace = d * (d2 + s**2) + d2
  np.testing.assert_allclose(got, [trace / d2, trace, d2], rtol=0.25)


# ----------------------------------------------------------------------------- what counts


def test_short_skipped_and_empty_windows_leave_the_ema_and_flush_is_no_sample():
  decay = 0.5
  tx = optax_accum.accumulate(optax.sgd(0.0), 3, observe=(optax_accum.noise_scale(decay),))
  params = {"w": jnp.zeros(2)}
  step = make_step(tx)
  vec = lambda *v: {"w": jnp.array(v, jnp.float32)}
  state = tx.init(params)
  np.testing.assert_array_equal(noise_metrics(state), 0.0)  # no estimate yet: zeros
  # A window of one microbatch (flushed): K = 1, no estimate.
  _, state, _ = call(step, vec(1.0, 2.0), state, params, weight=2.0, flush=True)
  assert int(state.num_updates) == 1 and float(state.observers[0].ema_weight) == 0.0
  # A full window: [w=2 g1, w=0 NaN (all padding), w=3 g2]: two samples.
  _, state, _ = call(step, vec(1.0, 2.0), state, params, weight=2.0)
  _, state, _ = call(step, vec(np.nan, np.nan), state, params, weight=0.0)
  _, state, _ = call(step, vec(-1.0, 0.5), state, params, weight=3.0)
  first = reference_estimates(np.array([[1.0, 2.0], [-1.0, 0.5]]), np.array([2.0, 3.0]))
  expected = noise_metrics(state)
  np.testing.assert_allclose(expected[1:], first, rtol=1e-6)
  # A skipped window (an Inf in a weighted microbatch) and an empty one change nothing.
  _, state, _ = call(step, vec(1.0, 2.0), state, params, weight=1.0)
  _, state, _ = call(step, vec(np.inf, 2.0), state, params, weight=1.0)
  _, state, _ = call(step, vec(1.0, 2.0), state, params, weight=1.0)
  assert int(state.num_skipped) == 1
  for _ in range(3):
    _, state, _ = call(step, vec(5.0, 5.0), state, params, weight=0.0)
  # A window closed by a zero-weight flush: the flush is not a sample.
  _, state, _ = call(step, vec(3.0, 1.0), state, params, weight=4.0)
  _, state, _ = call(step, vec(0.0, 1.0), state, params, weight=1.0)
  _, state = jax.jit(lambda s: optax_accum.flush(tx, s, params))(state)
  second = reference_estimates(np.array([[3.0, 1.0], [0.0, 1.0]]), np.array([4.0, 1.0]))
  s = (decay * (1 - decay) * first[0] + (1 - decay) * second[0]) / (1 - decay**2)
  g = (decay * (1 - decay) * first[1] + (1 - decay) * second[1]) / (1 - decay**2)
  np.testing.assert_allclose(noise_metrics(state), [s / g, s, g], rtol=1e-6)
  assert_state_finite(state)


def test_negative_signal_estimate_reads_as_zero_noise_scale():
  # n = (1, 1), g = (1, -1): G_B = 0, so S = 2 and G2 = -1 < 0: B_simple is not defined.
  tx = optax_accum.accumulate(optax.sgd(0.0), 2, observe=(optax_accum.noise_scale(0.0),))
  params = {"w": jnp.zeros(())}
  step = make_step(tx)
  state = tx.init(params)
  for v in (1.0, -1.0):
    _, state, _ = call(step, {"w": jnp.asarray(v)}, state, params)
  np.testing.assert_allclose(noise_metrics(state), [0.0, 2.0, -1.0])


def test_loss_scale_divides_out_on_the_fused_path():
  rng = np.random.default_rng(3)
  grads = rng.normal(size=(4, 3)).astype(np.float32) + 0.5
  weights = [1.0, 5.0, 2.0, 3.0]
  params = {"w": jnp.zeros(3)}
  results = []
  for scale, fused in ((None, False), (2.0**10, True)):
    loss_scale = None if scale is None else optax_accum.static_loss_scale(scale)
    tx = optax_accum.accumulate(
      optax.sgd(0.0), 4, loss_scale=loss_scale, observe=(optax_accum.noise_scale(0.0),)
    )

    @jax.jit
    def step(g, state, w, tx=tx, fused=fused):
      if fused:
        return optax_accum.update_and_apply(tx, {"w": g}, state, params, weight=w)[1]
      return tx.update({"w": g}, state, params, weight=w)[1]

    state = tx.init(params)
    for g, w in zip(grads, weights, strict=True):
      state = step(jnp.asarray(g * (scale or 1.0)), state, jnp.float32(w))
    results.append(noise_metrics(state))
  expected = reference_estimates(grads, np.array(weights))
  np.testing.assert_allclose(results[0][1:], expected, rtol=1e-5)
  np.testing.assert_allclose(results[1], results[0], rtol=1e-6)


def test_off_computes_nothing(monkeypatch):
  """Without an observer the estimator is never called; the state has no noise sub-states."""

  def boom(*_, **__):
    raise AssertionError("the noise scale is off")

  for name in ("add", "estimate", "ema_update"):
    monkeypatch.setattr(_noise_scale, name, boom)
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for v in (1.0, 3.0, -2.0, 4.0):
    _, state = jax.jit(tx.update)({"w": jnp.full(2, v)}, state, params)
  assert int(state.num_updates) == 2
  # Off, the window's noise sums and the EMAs are not in the state at all.
  assert state.window.observers == () and state.observers == ()
  np.testing.assert_array_equal(noise_metrics(state), 0.0)


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, float("nan")])
def test_bad_decay_values(bad):
  with pytest.raises(ValueError, match=r"noise_scale: decay must be in \[0, 1\)"):
    optax_accum.accumulate(optax.sgd(0.1), 2, observe=(optax_accum.noise_scale(bad),))


@pytest.mark.parametrize("bad", [True, "0.9", [0.9]])
def test_bad_decay_types(bad):
  with pytest.raises(TypeError, match="noise_scale: decay must be a number"):
    optax_accum.accumulate(optax.sgd(0.1), 2, observe=(optax_accum.noise_scale(bad),))


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_bad_in_step_flag(bad):
  with pytest.raises(TypeError, match="noise_scale must be True or False"):
    optax_accum.microbatched_value_and_grad(masked_mean_loss, 2, noise_scale=bad)


# ----------------------------------------------------------------------------- shard_map


AXIS, N_DEV, EVERY_K = "data", 8, 2
COUNTS = [  # valid samples per device per microstep; device 3 has none in the first
  [4, 1, 2, 0, 3, 4, 1, 2],
  [2, 4, 1, 3, 1, 3, 4, 2],
  [1, 1, 4, 2, 3, 2, 2, 4],
  [3, 2, 1, 4, 2, 1, 1, 1],
  [4, 4, 4, 4, 1, 1, 1, 1],
  [2, 1, 2, 1, 2, 1, 2, 1],
]


def test_shard_map_equals_single_device_on_the_same_microbatches():
  """Per-device microbatches are the samples: K_total = every_k x devices."""
  decay, tokens = 0.5, 4
  rng = np.random.default_rng(4)
  y = rng.normal(1.0, 2.0, size=(len(COUNTS), N_DEV * tokens)).astype(np.float32)
  mask = (np.arange(tokens) < np.array(COUNTS)[..., None]).reshape(len(COUNTS), -1)
  params = {"w": jnp.zeros(())}

  tx = optax_accum.accumulate(
    optax.sgd(0.0), EVERY_K, axis_name=AXIS, observe=(optax_accum.noise_scale(decay),)
  )
  mesh = _compat.make_mesh((N_DEV,), (AXIS,))
  state = optax_accum.sharding.stack_windows(tx.init(params), mesh, AXIS)
  specs = optax_accum.sharding.window_specs(state, AXIS)

  def body(params, state, y, mask):
    state = optax_accum.sharding.local_state(state)
    g = jax.grad(masked_mean_loss)(_compat.pcast_varying(params, AXIS), y, mask)
    _, state = tx.update(g, state, params, weight=jnp.sum(mask))
    return optax_accum.sharding.stacked_state(state)

  step = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=specs)
  )
  place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  args = lambda i: (place(params, P()), state, place(y[i], P(AXIS)), place(mask[i], P(AXIS)))
  # The noise sums ride in the boundary's one all-reduce; nothing between boundaries.
  counts = testing.count_collectives(step.lower(*args(0)).compile().as_text())
  assert sum(counts["outside"].values()) == 0, counts
  # one psum: grad_sum (1 leaf), weight_sum, value_sum, value_weight, the noise sums (2)
  assert dict(counts["in_conditional"]) == _compat.one_psum(6), counts
  for i in range(len(COUNTS)):
    state = step(*args(i))
  assert int(optax_accum.metrics(state).num_updates) == len(COUNTS) // EVERY_K

  # The same microbatches, one device's at a time, through a single-device accumulate.
  single = optax_accum.accumulate(
    optax.sgd(0.0), EVERY_K * N_DEV, observe=(optax_accum.noise_scale(decay),)
  )
  ys, masks = y.reshape(-1, tokens), mask.reshape(-1, tokens)
  ref, _ = run_windows(single, params, masked_mean_loss, ys, masks)
  np.testing.assert_allclose(noise_metrics(state), noise_metrics(ref), rtol=1e-5)
  assert float(state.observers[0].ema_weight) == pytest.approx(
    1 - decay ** (len(COUNTS) // EVERY_K)
  )
  assert_state_finite(state)


# ----------------------------------------------------------------------------- in-step


def test_in_step_matches_the_formulas_with_and_without_loss_scale():
  k, rows = 4, 8
  rng = np.random.default_rng(5)
  batch = {"y": rng.normal(1.0, 2.0, size=k * rows).astype(np.float32)}
  batch["mask"] = rng.random(k * rows) < 0.7
  batch["mask"][:rows] = False  # microbatch 0 is all padding: not a sample
  loss = lambda p, b: masked_mean_loss(p, b["y"], b["mask"])
  tokens = lambda mb: jnp.sum(mb["mask"])
  params = {"w": jnp.zeros(())}
  outs = []
  for scale in (None, 2.0**8):
    f = optax_accum.microbatched_value_and_grad(
      loss, k, weight_fn=tokens, strided=False, loss_scale=scale, noise_scale=True
    )
    (value, est), _ = jax.jit(f)(params, batch)
    outs.append(est)
  ym, mm = batch["y"].reshape(k, rows), batch["mask"].reshape(k, rows)
  w = mm.sum(1)
  g = -np.where(mm, ym.astype(np.float64), 0).sum(1) / np.maximum(w, 1)
  expected = reference_estimates(g[:, None], w)
  for est in outs:
    assert int(est.num_samples) == k - 1 and bool(est.valid)
    np.testing.assert_allclose([est.trace, est.signal], expected, rtol=1e-5)


def test_in_step_jit_lanes_are_samples():
  """Under jit with axis_name, each (microbatch, device) lane is a sample: K x D of them."""
  k, rows_per_lane = 2, 4
  b = k * N_DEV * rows_per_lane
  rng = np.random.default_rng(6)
  y = rng.normal(1.0, 2.0, size=b).astype(np.float32)
  mask = rng.random(b) < 0.8
  loss = lambda p, bt: masked_mean_loss(p, bt["y"], bt["mask"])
  f = optax_accum.microbatched_value_and_grad(
    loss, k, weight_fn=lambda mb: jnp.sum(mb["mask"]), axis_name=AXIS, noise_scale=True
  )
  mesh = _compat.make_mesh((N_DEV,), (AXIS,))
  batch = jax.device_put({"y": y, "mask": mask}, NamedSharding(mesh, P(AXIS)))
  with _compat.set_mesh(mesh):
    (_, est), grads = jax.jit(f)({"w": jnp.zeros(())}, batch)
  # Documented rule: microbatch k holds rows r with r % K == k, lane d the rows of block d.
  rows = np.arange(b)
  lanes = [(rows % k == i) & (rows // (b // N_DEV) == d) for i in range(k) for d in range(N_DEV)]
  w = np.array([(mask & lane).sum() for lane in lanes], np.float64)
  g = np.array(
    [-y[mask & lane].astype(np.float64).sum() / max(c, 1) for lane, c in zip(lanes, w, strict=True)]
  )
  assert int(est.num_samples) == int((w > 0).sum())
  np.testing.assert_allclose([est.trace, est.signal], reference_estimates(g[:, None], w), rtol=1e-5)
  chex.assert_trees_all_close(float(grads["w"]), -y[mask].mean(), rtol=1e-5)
