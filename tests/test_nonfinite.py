"""A window with a NaN or an Inf is skipped whole at every size and on every path (issue 46).

XLA picks other kernels above size thresholds: on jaxlib 0.10's CPU, ``jnp.max(jnp.abs(x))`` of a
leaf of 4,096 elements or more drops a NaN, so a finite check that relies on max skipped nothing
there while every small test passed. Each test here puts a NaN, a +Inf or a -Inf at the first, a
middle or the last element of a leaf on both sides of those thresholds (7, 4,096, 65,536 and
1,000,000 elements), and asserts what "skipped whole" means: the skip is counted, the params
are bitwise unchanged, the inner state is bitwise unchanged, and every state leaf is finite.
The reference for the clean windows around them is the same run without the bad windows.
"""

import itertools

import _compat
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

SIZES = [7, 4096, 65_536, 1_000_000]
KINDS = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}


def positions(n):
  return {"first": 0, "middle": n // 2, "last": n - 1}


def bad_cases(n):
  """Every (kind, position) pair: 9 non-finite windows."""
  return [
    (kind, value, where, pos)
    for (kind, value), (where, pos) in itertools.product(KINDS.items(), positions(n).items())
  ]


def some_bad_cases(n):
  """Three of them, each kind once and each position once (for the costlier paths)."""
  return [c for i, c in enumerate(bad_cases(n)) if i % 4 == 0]


def make_params(n):
  rng = np.random.default_rng(n)
  return {
    "big": jnp.asarray(rng.normal(size=n), jnp.float32),
    "small": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
  }


def clean_grads(n, seed):
  rng = np.random.default_rng(seed)
  return {
    "big": jnp.asarray(rng.normal(size=n), jnp.float32),
    "small": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
  }


def poisoned(grads, value, pos):
  return {**grads, "big": grads["big"].at[pos].set(value)}


def host(tree):
  return jax.tree.map(np.asarray, tree)


def assert_bitwise_equal(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_installed_max_may_drop_nan_our_skip_does_not_care():
  """Records whether this jaxlib's ``jnp.max`` carries a NaN at each size (it does not at 4,096
  and above on jaxlib 0.10's CPU; it does on 0.7), and asserts the skip either way."""
  carried = {}
  for n in SIZES:
    x = jnp.ones(n).at[n // 2].set(jnp.nan)
    carried[n] = bool(jnp.isnan(jax.jit(lambda x: jnp.max(jnp.abs(x)))(x)))
    tx = optax_accum.accumulate(optax.sgd(1.0), every_k=1)
    params = {"w": jnp.zeros(n)}
    updates, state = jax.jit(tx.update)({"w": x}, tx.init(params), params)
    assert int(state.num_skipped) == 1 and int(state.num_updates) == 0, (n, carried)
    assert not np.any(np.asarray(updates["w"])), (n, carried)
  print(f"jax {jax.__version__}: jnp.max carries a NaN at sizes {carried}")


def _config(name):
  """The issue's configurations: plain adam, and every feature that reads the window's norm or
  finiteness at once (a clip chain, a dynamic loss scale, a spike rule, the loss value)."""
  if name == "adam":
    return optax_accum.accumulate(optax.adam(1e-2), every_k=2), False
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  tx = optax_accum.accumulate(
    inner,
    every_k=2,
    loss_scale=optax_accum.dynamic_loss_scale(init_scale=2.0**4),
    skip_if=optax_accum.spike_rule(warmup=2),
  )
  return tx, True


def _step(tx, path, with_value):
  if path == "update":

    def step(grads, state, params, weight):
      extra = {"value": jnp.float32(1.0)} if with_value else {}
      u, state = tx.update(grads, state, params, weight=weight, **extra)
      return optax.apply_updates(params, u), state

  else:

    def step(grads, state, params, weight):
      extra = {"value": jnp.float32(1.0)} if with_value else {}
      return optax_accum.update_and_apply(tx, grads, state, params, weight=weight, **extra)

  return jax.jit(step)


def _scaled(grads, state):
  """The gradient of the scaled loss, as a user's ``jax.grad(loss * scale)`` gives it."""
  scale = optax_accum.metrics(state).loss_scale
  return jax.tree.map(lambda g: g * scale, grads)


@pytest.mark.parametrize("config", ["adam", "all_features"])
@pytest.mark.parametrize("path", ["update", "update_and_apply"])
@pytest.mark.parametrize("n", SIZES)
def test_a_nonfinite_window_is_skipped_whole(n, path, config):
  tx, with_value = _config(config)
  step = _step(tx, path, with_value)
  params = make_params(n)
  state = tx.init(params)
  windows = [(clean_grads(n, 2 * i), clean_grads(n, 2 * i + 1)) for i in range(3)]

  def window(params, state, pair, weights=(3.0, 1.0)):
    for g, w in zip(pair, weights, strict=True):
      params, state = step(_scaled(g, state), state, params, jnp.float32(w))
    return params, state

  # The reference: the clean windows alone.
  ref_p, ref_s = params, state
  for pair in windows:
    ref_p, ref_s = window(ref_p, ref_s, pair)

  params, state = window(params, state, windows[0])
  for i, (kind, value, where, pos) in enumerate(bad_cases(n)):
    before_p, before_inner = host(params), host(state.inner_state)
    skipped = int(state.num_skipped)
    g1, g2 = windows[1]
    bad = (poisoned(g1, value, pos), g2) if i % 2 else (g1, poisoned(g2, value, pos))
    params, state = window(params, state, bad)
    what = f"{kind} at the {where} element of a leaf of {n}"
    assert int(state.num_skipped) == skipped + 1, what
    assert int(state.num_updates) == 1, what
    assert_bitwise_equal(params, before_p)
    assert_bitwise_equal(state.inner_state, before_inner)
    assert_state_finite(state)
  for pair in windows[1:]:
    params, state = window(params, state, pair)
  assert int(state.num_updates) == 3
  # The loss scale halved at each skip: the power-of-two scales unscale exactly.
  chex.assert_trees_all_close(params, ref_p, rtol=1e-6, atol=1e-7)
  assert_state_finite(state)


@pytest.mark.parametrize("n", [7, 65_536, 1_000_000])
def test_a_flushed_nonfinite_window_is_skipped(n):
  tx = optax_accum.accumulate(optax.adam(1e-2), every_k=4)
  update = jax.jit(tx.update)
  flush = jax.jit(lambda s, p: optax_accum.flush(tx, s, p))
  params = make_params(n)
  state = tx.init(params)
  for kind, value, where, pos in some_bad_cases(n):
    before_inner = host(state.inner_state)
    u, state = update(clean_grads(n, 0), state, params)
    u, state = update(poisoned(clean_grads(n, 1), value, pos), state, params)
    assert int(state.mini_step) == 2
    u, state = flush(state, params)
    assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(u)), (kind, where)
    assert_bitwise_equal(state.inner_state, before_inner)
    assert int(state.mini_step) == 0 and int(state.num_updates) == 0
    assert_state_finite(state)
  assert int(state.num_skipped) == 3


def test_a_max_rule_leaf_marks_its_nonfinite_window():
  """``aggregate(reduce='max')`` leaves (Flax's FP8 amax) are elementwise maxima: a NaN, +Inf or
  -Inf in one must still skip the window, whatever ``max`` does with it."""
  n = 65_536
  agg = optax_accum.aggregate(reduce={"big": "max", "small": "mean"})
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, aggregate=agg)
  step = jax.jit(lambda g, s, p: optax_accum.update_and_apply(tx, g, s, p))
  params = make_params(n)
  state = tx.init(params)
  for i, (kind, value, where, pos) in enumerate(bad_cases(n)):
    before = host(params)
    g1, g2 = clean_grads(n, 0), clean_grads(n, 1)
    bad = (poisoned(g1, value, pos), g2) if i % 2 else (g1, poisoned(g2, value, pos))
    for g in bad:
      params, state = step(g, state, params)
    assert int(state.num_skipped) == i + 1, (kind, where)
    assert_bitwise_equal(params, before)
    assert_state_finite(state)
  params, state = step(clean_grads(n, 0), state, params)
  params, state = step(clean_grads(n, 1), state, params)
  assert int(state.num_updates) == 1
  want = np.maximum(np.asarray(clean_grads(n, 0)["big"]), np.asarray(clean_grads(n, 1)["big"]))
  np.testing.assert_array_equal(np.asarray(params["big"]), want)  # overwritten with the max


# --------------------------------------------------------------------------- in-step


def _in_step_loss(params, batch):
  """Mean over the rows of ``sum(w * v_row) + |small|^2``: row r's gradient of ``big`` is
  ``v_r``, so a non-finite element of one row's ``v`` is one microbatch's bad gradient."""
  per_row = batch["v"] @ params["big"] + jnp.sum(params["small"] ** 2)
  return jnp.mean(per_row)


@pytest.mark.parametrize("n", [7, 65_536])
def test_in_step_microbatching_skips_a_nonfinite_microbatch(n):
  tx = optax_accum.accumulate(optax.adam(1e-2), every_k=1)
  grad_fn = optax_accum.microbatched_value_and_grad(_in_step_loss, num_microbatches=4)

  @jax.jit
  def step(params, state, batch):
    loss, grads = grad_fn(params, batch)
    return optax_accum.update_and_apply(tx, grads, state, params, value=loss)

  params = make_params(n)
  state = tx.init(params)
  rng = np.random.default_rng(0)
  for i, (kind, value, where, pos) in enumerate(some_bad_cases(n)):
    v = rng.normal(size=(8, n)).astype(np.float32)
    v[i % 8, pos] = value  # one microbatch's row
    before, inner = host(params), host(state.inner_state)
    params, state = step(params, state, {"v": v})
    assert int(state.num_skipped) == i + 1, (kind, where)
    assert_bitwise_equal(params, before)
    assert_bitwise_equal(state.inner_state, inner)
    assert_state_finite(state)


# --------------------------------------------------------------------------- on a mesh

AXIS, N_DEV = "data", 8


def _mesh_loss(params, batch):
  return jnp.mean(batch["v"] @ params["big"]) + jnp.sum(params["small"] ** 2)


@pytest.mark.parametrize("shard", [False, True], ids=["axis_name", "zero1"])
def test_on_a_mesh_one_devices_nonfinite_microbatch_skips_the_window(shard):
  n = 65_536  # 8,192 per device under ZeRO-1: still above the threshold
  mesh = jax.make_mesh((N_DEV,), (AXIS,))
  params = jax.device_put(make_params(n), NamedSharding(mesh, P()))
  tx = optax_accum.accumulate(optax.adam(1e-2), 2, axis_name=AXIS, shard_optimizer=shard)
  state = optax_accum.sharding.init_sharded(tx, params, AXIS)
  specs = optax_accum.sharding.window_specs(state, AXIS)

  def body(params, state, batch):
    state = optax_accum.sharding.local_state(state)
    grads = jax.grad(_mesh_loss)(_compat.pcast_varying(params, AXIS), batch)
    params, state = optax_accum.update_and_apply(tx, grads, state, params)
    return params, optax_accum.sharding.stacked_state(state)

  step = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
  )
  rng = np.random.default_rng(0)
  for i, (kind, value, where, pos) in enumerate(some_bad_cases(n)):
    before = host(params)
    for j in range(2):
      v = rng.normal(size=(N_DEV * 2, n)).astype(np.float32)
      if j == i % 2:
        v[5, pos] = value  # device 2's rows
      params, state = step(params, state, jax.device_put({"v": v}, NamedSharding(mesh, P(AXIS))))
    m = optax_accum.metrics(state)
    assert int(m.num_skipped) == i + 1 and int(m.num_updates) == 0, (kind, where)
    assert_bitwise_equal(params, before)
    assert_state_finite(state)


def test_hsdp_skips_a_nonfinite_window():
  """Replica 2 x fsdp 4, params FSDP-sharded (docs/scaling.md's spelling)."""
  n = 65_536
  mesh = _compat.make_mesh(
    (2, 4),
    ("replica", "fsdp"),
    axis_types=(jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto),
  )
  params = jax.device_put(
    make_params(n),
    {"big": NamedSharding(mesh, P("fsdp")), "small": NamedSharding(mesh, P())},
  )
  tx = optax_accum.accumulate(optax.adam(1e-2), every_k=2, axis_name="replica")
  state = optax_accum.sharding.init_sharded(tx, params)
  state = optax_accum.sharding.stack_windows(state, mesh, "replica")
  specs = optax_accum.sharding.window_specs(state, "replica")

  def body(params, state, batch):
    state = optax_accum.sharding.local_state(state)
    grads = jax.grad(_mesh_loss)(_compat.pcast_varying(params, "replica"), batch)
    updates, state = tx.update(grads, state, params)
    return updates, optax_accum.sharding.stacked_state(state)

  step = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(), specs, P("replica")),
      out_specs=(P(), specs),
      axis_names={"replica"},
    )
  )
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P(("replica", "fsdp")))
  for i, (kind, value, where, pos) in enumerate(some_bad_cases(n)):
    before = host(params)
    for j in range(2):
      v = rng.normal(size=(8, n)).astype(np.float32)
      if j == i % 2:
        v[6, pos] = value  # replica 1's rows
      updates, state = step(params, state, jax.device_put({"v": v}, data))
      params = optax.apply_updates(params, updates)
    m = optax_accum.metrics(state)
    assert int(m.num_skipped) == i + 1 and int(m.num_updates) == 0, (kind, where)
    assert_bitwise_equal(params, before)
    assert_state_finite(state)


# --------------------------------------------------------------------------- Flax and Equinox


def test_flax_optimizer_and_train_state_skip_a_nonfinite_window():
  from flax import nnx
  from flax.training import train_state

  import optax_accum.flax

  class Wide(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(256, 256, rngs=rngs)  # a kernel of 65,536 elements

    def __call__(self, x):
      return self.fc(x)

  def loss(y):
    return jnp.mean(y**2)

  def poison(grads, value, pos):  # the 65,536-element kernel; the bias stays clean
    at = lambda g: g.at[jnp.unravel_index(pos, g.shape)].set(value) if g.size == 65_536 else g
    return jax.tree.map(at, grads)

  cases = some_bad_cases(65_536)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 256)), jnp.float32)

  # NNX: optax_accum.flax.Optimizer (the fused path).
  model = Wide(nnx.Rngs(0))
  opt = optax_accum.flax.Optimizer(
    model, optax_accum.accumulate(optax.adam(1e-2), every_k=2), wrt=nnx.Param
  )

  @nnx.jit
  def nnx_step(model, opt, x, value, pos, bad):
    grads = nnx.grad(lambda m: loss(m(x)))(model)
    grads = jax.tree.map(lambda g, b: jnp.where(bad, b, g), grads, poison(grads, value, pos))
    opt.update(model, grads)

  for i, (kind, value, where, pos) in enumerate(cases):
    before = host(nnx.state(model, nnx.Param))
    for j in range(2):
      nnx_step(model, opt, x, jnp.float32(value), pos, jnp.asarray(j == i % 2))
    m = optax_accum.metrics(opt.opt_state)
    assert int(m.num_skipped) == i + 1 and int(opt.step[...]) == 0, (kind, where)
    assert_bitwise_equal(nnx.state(model, nnx.Param), before)
    assert_state_finite(nnx.state(opt, nnx.optimizer.OptState))

  # Linen: optax_accum.flax.TrainState.
  import flax.linen as nn

  module = nn.Dense(256)
  state = optax_accum.flax.TrainState.create(
    apply_fn=module.apply,
    params=module.init(jax.random.key(0), x)["params"],
    tx=optax_accum.accumulate(optax.adam(1e-2), every_k=2),
  )
  assert isinstance(state, train_state.TrainState)

  @jax.jit
  def linen_step(state, value, pos, bad):
    grads = jax.grad(lambda p: loss(state.apply_fn({"params": p}, x)))(state.params)
    grads = jax.tree.map(lambda g, b: jnp.where(bad, b, g), grads, poison(grads, value, pos))
    return state.apply_gradients(grads=grads)

  for i, (kind, value, where, pos) in enumerate(cases):
    before = host(state.params)
    for j in range(2):
      state = linen_step(state, jnp.float32(value), pos, jnp.asarray(j == i % 2))
    m = optax_accum.metrics(state.opt_state)
    assert int(m.num_skipped) == i + 1 and int(state.step) == 0, (kind, where)
    assert_bitwise_equal(state.params, before)
    assert_state_finite(state.opt_state)


@pytest.mark.skipif(
  jax.__version_info__[:2] == (0, 7) and jax.__version_info__ < (0, 7, 2),
  reason="Equinox does not support jax 0.7.0 and 0.7.1 (equinox issue 1084)",
)
def test_equinox_skips_a_nonfinite_window():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.Linear(256, 256, key=jax.random.key(0))  # a weight of 65,536 elements
  params, static = eqx.partition(model, eqx.is_array)
  tx = optax_accum.accumulate(optax.adam(1e-2), every_k=2)
  state = tx.init(params)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 256)), jnp.float32)

  @jax.jit
  def step(params, state, value, pos, bad):
    loss = lambda p: jnp.mean(jax.vmap(eqx.combine(p, static))(x) ** 2)
    grads = jax.grad(loss)(params)
    g = grads.weight
    idx = jnp.unravel_index(pos, g.shape)
    grads = eqx.tree_at(lambda t: t.weight, grads, jnp.where(bad, g.at[idx].set(value), g))
    updates, state = tx.update(grads, state, params)
    return eqx.apply_updates(params, updates), state

  for i, (kind, value, where, pos) in enumerate(some_bad_cases(65_536)):
    before = host(params)
    for j in range(2):
      params, state = step(params, state, jnp.float32(value), pos, jnp.asarray(j == i % 2))
    assert int(state.num_skipped) == i + 1 and int(state.num_updates) == 0, (kind, where)
    assert_bitwise_equal(params, before)
    assert_state_finite(state)


@pytest.mark.slow  # a 10.8M-parameter transformer: about a minute of compile and steps on CPU
def test_a_real_model_matches_its_physical_batches_then_skips_a_nan_window():
  """Item 5: the demo's transformer at a real scale (8 blocks of width 336: 102 leaves, 10.8M
  params), three windows of four unequal microbatches on ``update_and_apply`` and on the Flax
  optimizer, each window against one physical batch's Adam step from the same params and
  Adam state (<= 1e-5; the Flax optimizer within 1e-5 of update_and_apply), then a window
  whose second microbatch has a NaN in one gradient element is skipped on both."""
  from flax import nnx

  import optax_accum.flax
  from optax_accum.demo.model import CharTransformer, token_loss

  k, rows, seq_len = 4, 2, 32

  def new_model():
    return CharTransformer(seq_len=seq_len, dim=336, depth=8, heads=4, rngs=nnx.Rngs(0))

  model = new_model()
  graphdef, state = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(state)
  leaves = jax.tree.leaves(params)
  assert len(leaves) >= 100 and sum(x.size for x in leaves) >= 10_000_000
  # eps = 1e-6: Adam's step g / (|g| + eps) turns a 1e-9 summation-order difference of a tiny
  # gradient element into at most lr * 1e-3, well under the tolerance.
  inner = optax.adam(1e-3, eps=1e-6)
  tx = optax_accum.accumulate(inner, every_k=k)
  grad = jax.jit(jax.grad(lambda p, b: token_loss(nnx.merge(graphdef, p), b)))

  rng = np.random.default_rng(0)

  def window():
    """k microbatches of ``rows`` rows; real lengths 1..seq_len, so token counts differ."""
    tokens = rng.integers(0, 256, size=(k, rows, seq_len + 1))
    lengths = rng.integers(1, seq_len + 1, size=(k, rows))
    mask = (np.arange(seq_len) < lengths[..., None]).astype(np.float32)
    return [
      {"inputs": t[:, :-1], "targets": t[:, 1:], "mask": m}
      for t, m in zip(jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), strict=True)
    ]

  windows = [window() for _ in range(3)]

  def physical(w):
    return jax.tree.map(lambda *x: jnp.concatenate(x), *w)

  ref_update = jax.jit(inner.update)
  step = jax.jit(lambda g, s, p, w: optax_accum.update_and_apply(tx, g, s, p, weight=w))
  p, s = params, tx.init(params)
  flax_model = new_model()
  opt = optax_accum.flax.Optimizer(flax_model, tx, wrt=nnx.Param)
  flax_grad = nnx.jit(nnx.grad(token_loss))

  @nnx.jit
  def flax_step(m, opt, g, w):
    opt.update(m, g, weight=w)

  def max_diff(a, b):  # NumPy's max propagates NaN
    return max(np.max(np.abs(np.asarray(x) - np.asarray(y))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))  # fmt: skip

  for w in windows:
    # The physical batch's step from where the accumulated run starts the window.
    u, _ = ref_update(grad(p, physical(w)), s.inner_state, p)
    ref = optax.apply_updates(p, u)
    for mb in w:
      p, s = step(grad(p, mb), s, p, mb["mask"].sum())
      flax_step(flax_model, opt, flax_grad(flax_model, mb), mb["mask"].sum())
    assert max_diff(p, ref) <= 1e-5
    assert max_diff(nnx.to_pure_dict(nnx.state(flax_model, nnx.Param)), p) <= 1e-5

  # A NaN in one element of the second microbatch's gradient: the window is skipped whole.
  big = max(range(len(leaves)), key=lambda i: leaves[i].size)
  before = (p, jax.tree.map(jnp.copy, nnx.state(flax_model, nnx.Param)))
  for i, mb in enumerate(window()):
    g = grad(p, mb)
    gf = flax_grad(flax_model, mb)
    if i == 1:
      poison = lambda t: jax.tree.unflatten(
        jax.tree.structure(t),
        [x.reshape(-1).at[x.size // 2].set(jnp.nan).reshape(x.shape) if j == big else x
         for j, x in enumerate(jax.tree.leaves(t))],
      )  # fmt: skip
      g, gf = poison(g), poison(gf)
    p, s = step(g, s, p, mb["mask"].sum())
    flax_step(flax_model, opt, gf, mb["mask"].sum())
  chex.assert_trees_all_equal(p, before[0])
  chex.assert_trees_all_equal(nnx.state(flax_model, nnx.Param), before[1])
  for state in (s, opt.opt_state):
    m = optax_accum.metrics(state)
    assert (int(m.num_updates), int(m.num_skipped)) == (3, 1)
    assert_state_finite(state)
