"""Flax NNX and Linen integration: an accumulated run equals a run on window means.

The reference for every test is an *unaccumulated* optimizer fed, once per
window, the gradient of the masked mean loss over the window's concatenated
microbatches (one ``grad`` over the physical batch).
"""

import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import optax_accum
import optax_accum.flax

K = 3  # microbatches per window
ROWS = 4  # rows per (padded) microbatch
# Valid rows per microbatch, three windows: unequal, so a mean of means is wrong.
VALID = [[1, 3, 4], [2, 4, 1], [4, 4, 2]]


def _inner():
  return optax.adamw(1e-2, weight_decay=1e-2)


def _windows(valid=VALID, seed=0):
  """List of windows; each a list of (x[ROWS, 3], y[ROWS], mask[ROWS]) microbatches."""
  rng = np.random.default_rng(seed)
  out = []
  for window in valid:
    mbs = []
    for n in window:
      x = rng.normal(size=(ROWS, 3)).astype(np.float32)
      y = rng.normal(size=(ROWS,)).astype(np.float32)
      mask = (np.arange(ROWS) < n).astype(np.float32)
      mbs.append((jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)))
    out.append(mbs)
  return out


def _concat(window):
  return tuple(jnp.concatenate(parts) for parts in zip(*window, strict=True))


def _masked_mse(pred, y, mask):
  err = (pred[..., 0] - y) ** 2
  return (err * mask).sum() / mask.sum()


# ---------------------------------------------------------------------------- NNX


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(3, 8, rngs=rngs)
    self.l2 = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def _nnx_loss(model, x, y, mask):
  return _masked_mse(model(x), y, mask)


def _nnx_accumulated(windows, *, weighted=True, flush_last=False, discard_after=None):
  """Runs the windows through nnx.Optimizer(accumulate(...)) under nnx.jit."""
  model = MLP(nnx.Rngs(0))
  plain_recipe = pytest.warns(optax_accum.pitfalls.PitfallWarning, match="adds 1 to `step`")
  with plain_recipe:  # the documented plain recipe: its step counts microbatches
    opt = nnx.Optimizer(model, optax_accum.accumulate(_inner(), every_k=K), wrt=nnx.Param)
  traces = []

  @nnx.jit
  def step(model, opt, x, y, mask, flush):
    traces.append(1)
    grads = nnx.grad(_nnx_loss)(model, x, y, mask)
    opt.update(model, grads, weight=mask.sum() if weighted else 1, flush=flush)

  @nnx.jit
  def discard(opt):
    opt.opt_state = optax_accum.discard(opt.opt_state)

  for i, window in enumerate(windows):
    for j, mb in enumerate(window):
      # flush_last: the last microbatch of the data closes its (partial) window.
      last = flush_last and i == len(windows) - 1 and j == len(window) - 1
      step(model, opt, *mb, jnp.asarray(last))
    if discard_after == i:
      discard(opt)
  assert len(traces) == 1, "one compilation serves every microstep"
  return model, opt


def _nnx_reference(windows):
  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, _inner(), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x, y, mask):
    opt.update(model, nnx.grad(_nnx_loss)(model, x, y, mask))

  for window in windows:
    step(model, opt, *_concat(window))
  return model


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_nnx_accumulated_equals_window_means():
  windows = _windows()
  model, opt = _nnx_accumulated(windows)
  chex.assert_trees_all_close(_params(model), _params(_nnx_reference(windows)), rtol=2e-5)
  m = optax_accum.metrics(opt.opt_state)
  assert int(opt.step[...]) == 9  # nnx counts microbatches
  assert int(m.num_updates) == 3
  assert int(m.mini_step) == 0 and int(m.num_microbatches) == 9


def test_nnx_weights_matter_on_this_data():
  # Guards the test above: unweighted (mean of means) must differ from the reference.
  windows = _windows()
  model, _ = _nnx_accumulated(windows, weighted=False)
  ref = jax.tree.leaves(_params(_nnx_reference(windows)))
  got = jax.tree.leaves(_params(model))
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(got, ref, strict=True)) > 1e-4


def test_nnx_flush_closes_the_last_partial_window():
  windows = _windows()
  partial = windows[:2] + [windows[2][:2]]
  model, opt = _nnx_accumulated(partial, flush_last=True)
  chex.assert_trees_all_close(_params(model), _params(_nnx_reference(partial)), rtol=2e-5)
  assert int(opt.step[...]) == 8  # the flush came with the last microbatch
  assert int(optax_accum.metrics(opt.opt_state).num_updates) == 3


def test_nnx_discard_drops_the_open_window():
  windows = _windows()
  # Window 2 gets one extra microbatch that is discarded.
  with_extra = [windows[0], windows[1][:1], windows[2]]
  model, opt = _nnx_accumulated(with_extra, discard_after=1)
  reference = _nnx_reference([windows[0], windows[2]])
  chex.assert_trees_all_close(_params(model), _params(reference), rtol=2e-5)
  assert int(optax_accum.metrics(opt.opt_state).num_updates) == 2


def _fused_accumulated(windows, *, flush_last=False, discard_after=None):
  """The same windows through optax_accum.flax.Optimizer (the fused path) under nnx.jit."""
  model = MLP(nnx.Rngs(0))
  tx = optax_accum.accumulate(_inner(), every_k=K)
  opt = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
  traces = []

  @nnx.jit
  def step(model, opt, x, y, mask, flush):
    traces.append(1)
    grads = nnx.grad(_nnx_loss)(model, x, y, mask)
    assert opt.update(model, grads, weight=mask.sum(), flush=flush) is None

  def discard(opt):
    opt.opt_state = optax_accum.discard(opt.opt_state)

  for i, window in enumerate(windows):
    for j, mb in enumerate(window):
      last = flush_last and i == len(windows) - 1 and j == len(window) - 1
      step(model, opt, *mb, jnp.asarray(last))
    if discard_after == i:
      discard(opt)  # eagerly here; under nnx.jit in _nnx_accumulated
  assert len(traces) == 1, "one compilation serves every microstep"
  return model, opt


def test_fused_optimizer_equals_window_means_and_counts_updates():
  windows = _windows()
  partial = windows[:2] + [windows[2][:2]]
  model, opt = _fused_accumulated(partial, flush_last=True)
  chex.assert_trees_all_close(_params(model), _params(_nnx_reference(partial)), rtol=2e-5)
  plain_model, _ = _nnx_accumulated(partial, flush_last=True)  # nnx.Optimizer, tx.update path
  chex.assert_trees_all_close(_params(model), _params(plain_model), rtol=1e-6)
  m = optax_accum.metrics(opt.opt_state)
  assert int(opt.step[...]) == 3 == int(m.num_updates)  # applied updates, the flushed one included
  assert int(m.num_microbatches) == 8 and int(m.mini_step) == 0


@pytest.mark.slow
def test_fused_optimizer_takes_a_dict_prefix_of_rules():
  """reduce= as a plain dict over an nnx.State: l1 the weighted mean (one grad of the window's
  concatenated batch), l2 overwritten with the max of its microbatches' values."""
  (window,) = _windows(VALID[:1])
  model = MLP(nnx.Rngs(0))
  start = nnx.clone(model)
  tx = optax_accum.accumulate(
    optax.sgd(1.0), every_k=K, aggregate=optax_accum.aggregate(reduce={"l1": "mean", "l2": "max"})
  )
  opt = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
  step = nnx.jit(lambda m, o, x, y, mask: o.update(m, nnx.grad(_nnx_loss)(m, x, y, mask),
                                                    weight=mask.sum()))  # fmt: skip
  for mb in window:
    step(model, opt, *mb)
  l1_grad = _params(nnx.grad(_nnx_loss)(start, *_concat(window)))["l1"]
  l2_grads = [_params(nnx.grad(_nnx_loss)(start, *mb))["l2"] for mb in window]
  l1_start = _params(start)["l1"]
  expected = {
    "l1": jax.tree.map(lambda p, g: p - g, l1_start, l1_grad),
    "l2": jax.tree.map(lambda *g: jnp.max(jnp.stack(g), axis=0), *l2_grads),
  }
  chex.assert_trees_all_close(_params(model), expected, rtol=1e-5, atol=1e-7)
  assert int(opt.step[...]) == 1


def test_fused_optimizer_discard_and_plain_tx():
  windows = _windows()
  with_extra = [windows[0], windows[1][:1], windows[2]]
  model, opt = _fused_accumulated(with_extra, discard_after=1)
  reference = _nnx_reference([windows[0], windows[2]])
  chex.assert_trees_all_close(_params(model), _params(reference), rtol=2e-5)
  assert int(opt.step[...]) == 2
  # Without accumulate it is nnx.Optimizer: every call is an update and is counted.
  model = MLP(nnx.Rngs(0))
  opt = optax_accum.flax.Optimizer(model, _inner(), wrt=nnx.Param)
  for window in windows[:2]:
    opt.update(model, nnx.grad(_nnx_loss)(model, *_concat(window)))
  chex.assert_trees_all_close(_params(model), _params(_nnx_reference(windows[:2])), rtol=1e-6)
  assert int(opt.step[...]) == 2


# -------------------------------------------------------------------------- Linen


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(jnp.tanh(nn.Dense(8)(x)))


def _linen_state(cls, tx):
  model = LinenMLP()
  params = model.init(jax.random.key(0), jnp.zeros((1, 3)))["params"]
  return cls.create(apply_fn=model.apply, params=params, tx=tx)


def _linen_grad(state, x, y, mask):
  return jax.grad(lambda p: _masked_mse(state.apply_fn({"params": p}, x), y, mask))(state.params)


def _linen_reference(windows):
  state = _linen_state(train_state.TrainState, _inner())

  @jax.jit
  def step(state, x, y, mask):
    return state.apply_gradients(grads=_linen_grad(state, x, y, mask))

  for window in windows:
    state = step(state, *_concat(window))
  return state


@pytest.mark.parametrize("equal_sizes", [False, True])
def test_linen_train_state_equals_window_means(equal_sizes):
  chex.clear_trace_counter()
  valid = [[ROWS] * K] * 3 if equal_sizes else VALID
  windows = _windows(valid)
  state = _linen_state(optax_accum.flax.TrainState, optax_accum.accumulate(_inner(), every_k=K))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, x, y, mask):
    grads = _linen_grad(state, x, y, mask)
    if equal_sizes:  # existing Flax code: no weight passed
      return state.apply_gradients(grads=grads)
    return state.apply_gradients(grads=grads, weight=mask.sum())

  steps = []
  for window in windows:
    for mb in window:
      state = step(state, *mb)
      steps.append(int(state.step))
  chex.assert_trees_all_close(state.params, _linen_reference(windows).params, rtol=2e-5)
  assert steps == [0, 0, 1, 1, 1, 2, 2, 2, 3]  # counts applied updates
  assert int(optax_accum.metrics(state.opt_state).num_updates) == 3


@pytest.mark.slow
def test_linen_flush_and_discard():
  windows = _windows()
  state = _linen_state(optax_accum.flax.TrainState, optax_accum.accumulate(_inner(), every_k=K))
  step = jax.jit(
    lambda s, x, y, m, f: s.apply_gradients(grads=_linen_grad(s, x, y, m), weight=m.sum(), flush=f)
  )
  no = jnp.asarray(False)
  for mb in windows[0] + windows[1][:1]:
    state = step(state, *mb, no)
  discard = jax.jit(lambda s: s.replace(opt_state=optax_accum.discard(s.opt_state)))
  state = discard(state)  # drop the open microbatch
  first, last = windows[2][:2]
  state = step(state, *first, no)
  state = step(state, *last, jnp.asarray(True))  # the last microbatch closes the window
  assert int(state.step) == 2
  params = state.params
  zeros = jax.tree.map(jnp.zeros_like, state.params)  # a flush of the empty window is a no-op
  state = jax.jit(lambda s: s.apply_gradients(grads=zeros, weight=0.0, flush=True))(state)
  assert int(state.step) == 2
  chex.assert_trees_all_equal(state.params, params)
  reference = _linen_reference([windows[0], windows[2][:2]])
  chex.assert_trees_all_close(state.params, reference.params, rtol=2e-5)


def test_linen_flush_argument_and_skipped_window():
  windows = _windows()
  tx = optax_accum.accumulate(_inner(), every_k=K)
  state = _linen_state(optax_accum.flax.TrainState, tx)
  step = jax.jit(lambda s, g, w, f: s.apply_gradients(grads=g, weight=w, flush=f))
  nan_grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), state.params)
  # Window 1: a NaN microbatch -> skipped, step stays 0.
  for mb in windows[0][:2]:
    state = step(state, _linen_grad(state, *mb), mb[2].sum(), False)
  state = step(state, nan_grads, jnp.float32(4.0), False)
  assert int(state.step) == 0
  assert int(optax_accum.metrics(state.opt_state).num_skipped) == 1
  # Window 2: two microbatches, the second with flush=True.
  for i, mb in enumerate(windows[1][:2]):
    state = step(state, _linen_grad(state, *mb), mb[2].sum(), i == 1)
  assert int(state.step) == 1
  reference = _linen_reference([windows[1][:2]])
  chex.assert_trees_all_close(state.params, reference.params, rtol=2e-5)


def test_linen_plain_optimizer_counts_every_call_like_flax():
  windows = _windows()
  ours = _linen_state(optax_accum.flax.TrainState, _inner())
  flax_state = _linen_state(train_state.TrainState, _inner())
  for mb in windows[0]:
    ours = ours.apply_gradients(grads=_linen_grad(ours, *mb))
    flax_state = flax_state.apply_gradients(grads=_linen_grad(flax_state, *mb))
  assert int(ours.step) == int(flax_state.step) == 3
  chex.assert_trees_all_close(ours.params, flax_state.params)


def test_import_optax_accum_does_not_need_flax():
  code = (
    "import sys; sys.modules['flax'] = None\n"  # makes `import flax` fail
    "import optax_accum\n"
    "assert 'optax_accum.flax' not in sys.modules\n"
    "try:\n  import optax_accum.flax\nexcept ImportError:\n  print('ok')\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
  )
  assert out.stdout.strip() == "ok"


def test_import_without_flax_says_which_extra_to_install():
  code = (
    "import sys\n"
    "class NoFlax:\n"
    "  def find_spec(self, name, path=None, target=None):\n"
    "    if name == 'flax' or name.startswith('flax.'):\n"
    "      raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, NoFlax())\n"
    "import optax_accum\n"  # works without flax
    "try:\n"
    "  import optax_accum.flax\n"
    "except ModuleNotFoundError as e:\n"
    "  print(e.name, '|', e)\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  name, message = out.stdout.strip().split(" | ")
  assert name == "flax"
  assert 'pip install "optax_accum[flax]"' in message and 'pip install -e ".[flax]"' in message
