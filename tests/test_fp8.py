"""FP8 (Flax's ``_overwrite_with_gradient`` meta) through an accumulated window.

The reference is the physical batch: Flax's own ``flax.training.train_state.TrainState`` fed, once
per window, one ``jax.grad`` over the window's concatenated microbatches (its FP8 meta overwritten
by that gradient's meta, as Flax does). Expected values are never written down: they come from
that run, or from numpy.

Why the windows here use losses normalized by the window's total (``denominator=1``): an FP8
backward quantizes each microbatch's output gradient with the meta's scale, which the physical
batch's amax sizes. A microbatch's MEAN loss has gradients ``W / w_i`` times the physical batch's,
so they saturate the e5m2 range (``test_mean_losses_saturate_the_fp8_backward``); a loss summed
over the microbatch and divided by the window's total ``W`` has the physical batch's gradients
row for row, so every quantization is the physical batch's.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import fp8_ops
from flax.training import train_state

import optax_accum
import optax_accum.flax

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
K = 4  # microbatches per window
ROWS = 16  # rows per (padded) microbatch
# Real rows per microbatch: powers of two summing to a power of two (W = 32), so that rescaling
# an output-gradient amax by w_i / W is exact and the meta can be compared bitwise.
REAL = (8, 4, 16, 4)
Op = functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=16)


class Fp8MLP(nn.Module):
  """Two FP8 Dense layers: the first one's output gradient comes through the second's FP8 VJP."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, dot_general_cls=Op)(x)
    return nn.Dense(1, dot_general_cls=Op)(jnp.tanh(h))[:, 0]


class Fp8Linear(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1, dot_general_cls=Op)(x)[:, 0]


def _windows(n, real=REAL, seed=0):
  """n windows, each K microbatches ``(x[ROWS, 4], y[ROWS], mask[ROWS])``."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    window = []
    for r in real:
      x = jnp.asarray(3 * rng.normal(size=(ROWS, 4)), jnp.float32)
      y = jnp.asarray(rng.normal(size=(ROWS,)), jnp.float32)
      window.append((x, y, jnp.asarray(np.arange(ROWS) < r, jnp.float32)))
    out.append(window)
  return out


def _concat(window):
  return tuple(jnp.concatenate(parts) for parts in zip(*window, strict=True))


def _mean_loss(model):
  """The masked MEAN over a microbatch's (or the physical batch's) real rows."""

  def loss(variables, x, y, mask):
    return (((model.apply(variables, x) - y) ** 2) * mask).sum() / mask.sum()

  return loss


def _window_loss(model):
  """The masked SUM over a microbatch's real rows, divided by the window's real rows ``total``."""

  def loss(variables, x, y, mask, total):
    return (((model.apply(variables, x) - y) ** 2) * mask).sum() / total

  return loss


def _inner():
  return optax.adam(1e-2)


def _variables(model):
  return jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4)))  # eager FP8 init takes seconds


def _physical(model, windows, variables=None):
  """Flax's TrainState, one grad of the mean loss over each window's concatenated batch."""
  variables = _variables(model) if variables is None else variables
  state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=_inner())
  step = jax.jit(lambda s, b: s.apply_gradients(grads=jax.grad(_mean_loss(model))(s.params, *b)))
  states = []
  for window in windows:
    state = step(state, _concat(window))
    states.append(state)
  return states


def _assert_like_physical(params, reference, before, model, window):
  # From the same variables, the window's meta is the physical batch's bitwise: one grad over
  # the concatenated window at `before` (the variables the window started from).
  physical_meta = jax.jit(jax.grad(_mean_loss(model)))(before, *_concat(window))[OWG]
  chex.assert_trees_all_equal(params[OWG], physical_meta)
  # Along the run, against Flax's TrainState: the params differ by float32 rounding (a sum of
  # four gradients is not one grad of the sum), and the kernel amax is a max of |params|.
  chex.assert_trees_all_close(params[OWG], reference[OWG], rtol=1e-6, atol=0)
  # Adam moves each param by about lr = 1e-2 per update: atol is 1e-6 of one step (a bias that
  # went up and down is near 0, where rtol alone would ask for better than float32 rounding).
  chex.assert_trees_all_close(params["params"], reference["params"], rtol=1e-6, atol=1e-8)


def _relative_error(a, b):
  return max(
    float(jnp.abs(x - y).max() / jnp.abs(y).max())
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


@pytest.mark.parametrize(
  "model",  # one FP8 layer in the fast suite; two (an FP8 VJP's output gradient) in the slow one
  [Fp8Linear(), pytest.param(Fp8MLP(), marks=pytest.mark.slow)],
  ids=["linear", "mlp"],
)
@pytest.mark.slow
def test_fp8_train_state_equals_the_physical_batch(model):
  windows = _windows(3)
  tx = optax_accum.accumulate(
    _inner(), every_k=K, aggregate=optax_accum.aggregate(denominator=1)
  )  # a plain sum
  state = optax_accum.flax.TrainState.create(apply_fn=model.apply, params=_variables(model), tx=tx)
  loss = _window_loss(model)
  step = jax.jit(lambda s, mb, total: s.apply_gradients(grads=jax.grad(loss)(s.params, *mb, total)))
  for window, reference in zip(windows, _physical(model, windows), strict=True):
    total = sum(mb[2].sum() for mb in window)  # the window's real rows, known before it starts
    before = state.params
    for i, mb in enumerate(window):
      state = step(state, mb, total)
      if i < K - 1:  # every microbatch of the window runs with the window's meta
        chex.assert_trees_all_equal(state.params, before)
    _assert_like_physical(state.params, reference.params, before, model, window)
  assert int(state.step) == 3


@pytest.mark.slow
def test_fp8_in_step_equals_the_physical_batch():
  model, windows = Fp8MLP(), _windows(3)
  loss = _window_loss(model)
  grad_fn = optax_accum.microbatched_value_and_grad(
    lambda v, mb, total: loss(v, *mb, total),
    K,
    weight_fn=lambda mb: jnp.float32(1),
    strided=False,
    aggregate=optax_accum.aggregate(denominator=1),
  )
  state = train_state.TrainState.create(apply_fn=model.apply, params=_variables(model), tx=_inner())

  @jax.jit
  def step(state, batch):
    _, grads = grad_fn(state.params, batch, batch[2].sum())
    return state.apply_gradients(grads=grads)  # Flax overwrites the meta with the reduced one

  for window, reference in zip(windows, _physical(model, windows), strict=True):
    before = state.params
    state = step(state, _concat(window))
    _assert_like_physical(state.params, reference.params, before, model, window)


@pytest.mark.slow
def test_fp8_in_step_with_mean_losses_equals_the_physical_batch():
  """In-step takes each microbatch's gradient at the batch's scale (its mean loss times its
  share w_k / W) by itself, so mean losses and weights need no recipe there."""
  model, windows = Fp8MLP(), _windows(3)
  loss = _mean_loss(model)
  grad_fn = optax_accum.microbatched_value_and_grad(
    lambda v, mb: loss(v, *mb), K, weight_fn=lambda mb: mb[2].sum(), strided=False
  )
  state = train_state.TrainState.create(apply_fn=model.apply, params=_variables(model), tx=_inner())
  step = jax.jit(lambda state, batch: state.apply_gradients(grads=grad_fn(state.params, batch)[1]))
  for window, reference in zip(windows, _physical(model, windows), strict=True):
    before = state.params
    state = step(state, _concat(window))
    _assert_like_physical(state.params, reference.params, before, model, window)


@pytest.mark.slow  # FP8 steps compile in seconds on CPU: the fast suite keeps the first test
@pytest.mark.parametrize("real", [REAL, (3, 7, 5, 6)], ids=["powers_of_two", "any"])
def test_fp8_meta_of_mean_losses_is_the_physical_batch_meta(real):
  # Default rules with mean losses and weights: the output-gradient amax of microbatch i is
  # W / w_i times the physical batch's, and accumulate records max_i(w_i * amax_i) / W: exact
  # for powers of two, within rounding otherwise. One FP8 layer (its output gradient is the
  # loss's own, not an FP8 VJP's), one window from a state with a history (two updates).
  model = Fp8Linear()
  warm, (window,) = _windows(2, real, seed=1), _windows(1, real, seed=2)
  start = _physical(model, warm)[-1].params
  (reference,) = _physical(model, [window], variables=start)
  tx = optax_accum.accumulate(_inner(), every_k=K)
  with pytest.warns(optax_accum.pitfalls.PitfallWarning, match="saturate"):
    state = optax_accum.flax.TrainState.create(apply_fn=model.apply, params=start, tx=tx)
  loss = _mean_loss(model)
  step = jax.jit(
    lambda s, mb: s.apply_gradients(grads=jax.grad(loss)(s.params, *mb), weight=mb[2].sum())
  )
  for mb in window:
    state = step(state, mb)
  assert int(state.step) == 1
  if real == REAL:
    chex.assert_trees_all_equal(state.params[OWG], reference.params[OWG])
  else:
    chex.assert_trees_all_close(state.params[OWG], reference.params[OWG], rtol=1e-6, atol=0)
  # The rules differ from what a window would give without them: Flax's per-call overwrite
  # (the last microbatch's meta) and a weighted mean of the microbatches' meta.
  grads = [jax.grad(loss)(start, *mb) for mb in window]
  weights = [float(mb[2].sum()) for mb in window]
  mean = jax.tree.map(
    lambda *g: sum(w * x for w, x in zip(weights, g, strict=True)) / sum(weights), *grads
  )
  for other in (grads[-1][OWG], mean[OWG]):
    amax = other["Dense_0"]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"]
    expected = reference.params[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]
    assert not np.allclose(amax, expected["output_grad_amax_history"], rtol=1e-3)


@pytest.mark.slow
def test_mean_losses_saturate_the_fp8_backward():
  # Why the equivalence tests above normalize by the window's total: with mean losses the same
  # windows (meta reduced by the default rules) leave the physical batch after the first update,
  # when the output-gradient scale starts to be sized by the physical batch's amax.
  model, windows = Fp8MLP(), _windows(2)
  with pytest.warns(optax_accum.pitfalls.PitfallWarning, match="saturate"):  # says the fix
    state = optax_accum.flax.TrainState.create(
      apply_fn=model.apply, params=_variables(model), tx=optax_accum.accumulate(_inner(), every_k=K)
    )
  loss = _mean_loss(model)
  step = jax.jit(
    lambda s, mb: s.apply_gradients(grads=jax.grad(loss)(s.params, *mb), weight=mb[2].sum())
  )
  for window in windows:
    for mb in window:
      state = step(state, mb)
  reference = _physical(model, windows)[-1]
  assert _relative_error(state.params["params"], reference.params["params"]) > 1e-3


@pytest.mark.slow
def test_train_state_without_accumulate_keeps_flax_fp8_behaviour():
  model, (window,) = Fp8MLP(), _windows(1)
  variables = _variables(model)
  ours = optax_accum.flax.TrainState.create(apply_fn=model.apply, params=variables, tx=_inner())
  flax_state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=_inner())
  chex.assert_trees_all_equal(ours.opt_state, flax_state.opt_state)  # params['params'] only
  loss = _mean_loss(model)
  step = jax.jit(lambda s, mb: s.apply_gradients(grads=jax.grad(loss)(s.params, *mb)))
  for mb in window[:2]:
    ours, flax_state = step(ours, mb), step(flax_state, mb)
  chex.assert_trees_all_equal(ours.params, flax_state.params)  # meta overwritten by every call
  assert int(ours.step) == 2


@pytest.mark.parametrize(
  "fused",
  [True, pytest.param(False, marks=pytest.mark.slow)],
  ids=["update_and_apply", "tx.update"],
)
def test_overwrite_with_gradient_leaf_takes_the_window_max(fused):
  # Keras' overwrite_with_gradient with plain optax: the "gradient" of `stat` is its new value.
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=3), jnp.float32), "stat": jnp.zeros(5, jnp.float32)}
  tx = optax_accum.accumulate(
    optax.sgd(0.5), every_k=3, aggregate=optax_accum.aggregate(reduce={"w": "mean", "stat": "max"})
  )
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, grads):
    if fused:
      return optax_accum.update_and_apply(tx, grads, opt_state, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for _ in range(2):
    grads = [
      {"w": rng.normal(size=3).astype(np.float32), "stat": rng.normal(size=5).astype(np.float32)}
      for _ in range(3)
    ]
    start = params
    for i, g in enumerate(grads):
      params, opt_state = step(params, opt_state, g)
      if i < 2:
        chex.assert_trees_all_equal(params, start)  # unchanged between boundaries
    expected_stat = np.max([g["stat"] for g in grads], axis=0)
    expected_w = np.asarray(start["w"]) - 0.5 * np.mean([g["w"] for g in grads], axis=0)
    if fused:
      np.testing.assert_array_equal(params["stat"], expected_stat)
    else:  # tx.update emits max - param; the param plus it is the max up to one rounding
      np.testing.assert_allclose(params["stat"], expected_stat, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(params["w"], expected_w, rtol=1e-6)
