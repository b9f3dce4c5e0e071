"""optax_accum/_resume.py: resume mid-window from an Orbax checkpoint (C12); refuse another config.

Run A goes straight through 12 microbatches (every_k=4, adamw, model M2). Run B
saves the whole optimizer state after microbatch 6 (mid-window), restores it
from disk into a fresh state object and continues with microbatch 7. Params,
state and emitted updates must be bitwise equal.
"""

import _compat
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _finite import assert_state_finite
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

AXIS = "data"
N_DEV = 8
EVERY_K = 4
SAVE_AFTER = 6


def loss_fn(params, batch):
  """M2: masked mean squared error of x @ theta + b."""
  err = batch["x"] @ params["theta"] + params["b"] - batch["y"]
  return jnp.sum(jnp.where(batch["mask"], 0.5 * err**2, 0.0)) / jnp.sum(batch["mask"])


def make_batches(n=12, rows=16, seed=0):
  rng = np.random.default_rng(seed)
  return [
    {
      "x": rng.normal(size=(rows, 3)).astype(np.float32),
      "y": rng.normal(size=(rows,)).astype(np.float32),
      "mask": rng.random(rows) < 0.7,
    }
    for _ in range(n)
  ]


def make_tx(every_k=EVERY_K, **kwargs):
  return optax_accum.accumulate(optax.adamw(1e-2, weight_decay=1e-2), every_k, **kwargs)


def jit_step(tx):
  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, weight=jnp.sum(batch["mask"]))
    return optax.apply_updates(params, updates), opt_state, updates

  return step


def save(path, tree):
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, tree)
    ckptr.wait_until_finished()


def restore(path, target):
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(path, target)


def metadata(path):
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.metadata(path).item_metadata.tree


def run(step, params, opt_state, batches, sharding):
  trace = []
  for batch in batches:
    params, opt_state, updates = step(params, opt_state, jax.device_put(batch, sharding))
    trace.append(updates)
  return params, opt_state, trace


def test_resume_mid_window_is_bitwise_equal(tmp_path):
  mesh = Mesh(np.array(jax.devices()), (AXIS,))  # Auto axes, no mesh context
  # theta (8,) sharded over the devices (FSDP), b replicated.
  params0 = jax.device_put(
    {"theta": jnp.linspace(-1.0, 1.0, 8), "b": jnp.zeros(())},
    {"theta": NamedSharding(mesh, P(AXIS)), "b": NamedSharding(mesh, P())},
  )
  rng = np.random.default_rng(0)
  batches = [
    {
      "x": rng.normal(size=(16, 8)).astype(np.float32),
      "y": rng.normal(size=(16,)).astype(np.float32),
      "mask": rng.random(16) < 0.7,
    }
    for _ in range(12)
  ]
  batch_sharding = NamedSharding(mesh, P(AXIS))
  tx = make_tx()
  step = jit_step(tx)

  # Run A: straight through.
  params_a, state_a, updates_a = run(
    step, params0, optax_accum.sharding.init_sharded(tx, params0), batches, batch_sharding
  )

  # Run B: save after microbatch 6, mid-window.
  params_b, state_b, updates_b = run(
    step,
    params0,
    optax_accum.sharding.init_sharded(tx, params0),
    batches[:SAVE_AFTER],
    batch_sharding,
  )
  assert int(optax_accum.metrics(state_b).mini_step) == SAVE_AFTER % EVERY_K  # mid-window
  save(tmp_path / "ckpt", {"params": params_b, "opt_state": state_b})
  del params_b, state_b

  fresh_tx = make_tx()  # a new process would build the transformation again
  target = {
    "params": jax.tree.map(
      lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding), params0
    ),
    "opt_state": optax_accum.sharding.abstract_state(fresh_tx, params0),
  }
  optax_accum.sharding.check_compatible(fresh_tx, params0, metadata(tmp_path / "ckpt")["opt_state"])
  restored = restore(tmp_path / "ckpt", target)
  params_b = restored["params"]
  state_b = optax_accum.sharding.check_compatible(fresh_tx, params0, restored["opt_state"])
  assert isinstance(state_b, optax_accum.AccumulationState)
  assert state_b.window.grad_sum["theta"].sharding.is_equivalent_to(params0["theta"].sharding, 1)
  resume_at = int(optax_accum.metrics(state_b).num_microbatches)
  assert resume_at == SAVE_AFTER  # the data position to resume from
  params_b, state_b, rest = run(
    jit_step(fresh_tx), params_b, state_b, batches[resume_at:], batch_sharding
  )
  updates_b += rest

  chex.assert_trees_all_equal(params_b, params_a)
  chex.assert_trees_all_equal(state_b, state_a)
  assert_state_finite(state_b)
  chex.assert_trees_all_equal(updates_b, updates_a)
  assert int(state_a.num_updates) == 3


def test_resume_shard_map_windows_is_bitwise_equal(tmp_path):
  """The per-device window sums (a leading device axis) save and restore sharded."""
  mesh = _compat.make_mesh((N_DEV,), (AXIS,))
  tx = make_tx(axis_name=AXIS)
  params0 = {"theta": jnp.array([0.5, -1.0, 2.0]), "b": jnp.zeros(())}
  params = jax.device_put(params0, NamedSharding(mesh, P()))
  opt_state = optax_accum.sharding.stack_windows(tx.init(params0), mesh, AXIS)
  specs = optax_accum.sharding.window_specs(opt_state, AXIS)

  def body(params, opt_state, batch):
    opt_state = optax_accum.sharding.local_state(opt_state)
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, weight=jnp.sum(batch["mask"]))
    return (
      optax.apply_updates(params, updates),
      optax_accum.sharding.stacked_state(opt_state),
      updates,
    )

  step = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(), specs, P(AXIS)),
      out_specs=(P(), specs, P()),
      check_vma=False,
    )
  )
  batches = make_batches(n=12, rows=N_DEV * 4, seed=3)
  batch_sharding = NamedSharding(mesh, P(AXIS))
  params_a, state_a, updates_a = run(step, params, opt_state, batches, batch_sharding)
  params_b, state_b, updates_b = run(step, params, opt_state, batches[:SAVE_AFTER], batch_sharding)
  save(tmp_path / "ckpt", state_b)
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state_b
  )
  del state_b
  optax_accum.sharding.check_compatible(tx, params0, metadata(tmp_path / "ckpt"), stacked=True)
  state_b = optax_accum.sharding.check_compatible(
    tx, params0, restore(tmp_path / "ckpt", target), stacked=True
  )
  assert state_b.window.grad_sum["theta"].shape == (N_DEV, 3)
  assert state_b.window.grad_sum["theta"].sharding.is_equivalent_to(NamedSharding(mesh, P(AXIS)), 2)
  params_b, state_b, rest = run(step, params_b, state_b, batches[SAVE_AFTER:], batch_sharding)
  chex.assert_trees_all_equal((params_b, state_b, updates_b + rest), (params_a, state_a, updates_a))
  assert_state_finite(state_b)
  with pytest.raises(ValueError, match="(?s)grad_sum.*check_compatible\\(..., stacked=True\\)"):
    optax_accum.sharding.check_compatible(tx, params0, state_b)  # a stacked state, said so
  local = make_tx()  # and an eager tx.update on it names local_state
  with pytest.raises(ValueError, match="(?s)a window per device.*sharding.local_state"):
    local.update(params0, jax.device_get(state_b), params0)


@pytest.fixture
def mid_window_checkpoint(tmp_path):
  params = {"theta": jnp.array([0.5, -1.0, 2.0]), "b": jnp.zeros(())}
  tx = make_tx()
  step = jit_step(tx)
  opt_state = tx.init(params)
  for batch in make_batches(n=SAVE_AFTER):
    params, opt_state, _ = step(params, opt_state, batch)
  save(tmp_path / "ckpt", opt_state)
  return tmp_path / "ckpt", params


@pytest.mark.slow
def test_restore_into_another_every_k_continues_under_the_new_window_length(mid_window_checkpoint):
  """Issue 48: the window length is configuration (optax's way): a mid-window state (2 of 4
  microbatches held) restored into every_k=8 is accepted and closes after 6 more."""
  path, params = mid_window_checkpoint
  other = make_tx(every_k=8)
  optax_accum.sharding.check_compatible(other, params, metadata(path))
  state = restore(path, jax.eval_shape(other.init, params))
  optax_accum.sharding.check_compatible(other, params, state)
  held, applied = int(state.mini_step), int(state.num_updates)
  assert held == SAVE_AFTER % EVERY_K
  step = jit_step(other)
  for n, batch in enumerate(make_batches(n=8 - held), start=1):
    params, state, _ = step(params, state, batch)
    assert int(state.num_updates) == applied + (n == 8 - held)


def test_restore_into_another_accumulator_dtype_raises(mid_window_checkpoint):
  path, params = mid_window_checkpoint
  other = make_tx(accumulator_dtype=jnp.bfloat16)
  with pytest.raises(
    ValueError, match=r"window\.grad_sum\.theta: restored float32\[3\], tx.init gives bfloat16"
  ):
    optax_accum.sharding.check_compatible(other, params, metadata(path))
  # Why the metadata is checked: Orbax casts to the target's dtype without a word.
  state = restore(path, jax.eval_shape(other.init, params))
  assert state.window.grad_sum["theta"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
  "saved,resumed,match",
  [
    (
      optax_accum.dynamic_loss_scale(init_scale=2.0**8),
      None,
      r"loss_scale\.scale: in the restored state but not in tx\.init\(params\)",
    ),
    (
      None,
      optax_accum.static_loss_scale(128.0),
      r"loss_scale\.scale: missing from the restored state",
    ),
  ],
  ids=["dynamic-into-none", "none-into-static"],
)
def test_restore_into_another_loss_scale_raises(tmp_path, saved, resumed, match):
  """Issue 11, item 4: check_compatible accepted these; every window mean was then divided
  by the wrong scale (256 forever). Through orbax, then update(). With a loss scale in its own
  sub-state (EmptyState when off), a checkpoint with and one without a loss scale differ in
  their leaves: the metadata check refuses them already."""
  params = {"theta": jnp.array([0.5, -1.0, 2.0]), "b": jnp.zeros(())}
  tx = optax_accum.accumulate(optax.adamw(0.1), 4, loss_scale=saved)
  save(tmp_path / "ckpt", tx.init(params))
  other = optax_accum.accumulate(optax.adamw(0.1), 4, loss_scale=resumed)
  with pytest.raises(ValueError, match=match):
    optax_accum.sharding.check_compatible(other, params, metadata(tmp_path / "ckpt"))
  state = restore(tmp_path / "ckpt", jax.eval_shape(tx.init, params))
  with pytest.raises(ValueError, match=match):
    optax_accum.sharding.check_compatible(other, params, state)
  with pytest.raises(ValueError, match="loss"):  # update() refuses it too
    other.update(jax.tree.map(jnp.zeros_like, params), state, params)
  optax_accum.sharding.check_compatible(tx, params, state)  # its own configuration is fine


def _plain_steps(inner, params, state, batches):
  """The unaccumulated reference: one inner step per batch (a window's concatenated rows)."""
  for batch in batches:
    updates, state = inner.update(jax.grad(loss_fn)(params, batch), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _concat(batches):
  return jax.tree.map(lambda *xs: np.concatenate(xs), *batches)


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_a_run_without_accumulation_continues_with_it(tmp_path):
  """Issue 23's trap: 3 plain adamw steps on disk, resumed under accumulate. The checkpoint's
  metadata is refused with the fix named; migrate_state continues Adam's count, so the next
  window's update equals a 4th plain step on the window's concatenated batch."""
  inner = optax.adamw(1e-2, weight_decay=1e-2)
  batches = make_batches(n=3 + EVERY_K)
  params = {"theta": jnp.zeros(3), "b": jnp.zeros(())}
  params, old_state = _plain_steps(inner, params, inner.init(params), batches[:3])
  save(tmp_path / "plain", old_state)
  tx = make_tx()
  with pytest.raises(ValueError, match="written by a run without optax_accum.accumulate.*migrate"):
    optax_accum.sharding.check_compatible(tx, params, metadata(tmp_path / "plain"))
  restored = restore(tmp_path / "plain", jax.eval_shape(inner.init, params))
  state = optax_accum.sharding.migrate_state(tx, params, restored)
  assert int(state.inner_state[0].count) == 3
  step = jit_step(tx)
  got, state, _ = run(step, params, state, batches[3:], jax.devices()[0])
  window = _concat(batches[3:])  # weights are tokens: the window mean is the concatenation's
  want, _ = _plain_steps(inner, params, restored, [window])
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
  assert int(optax_accum.metrics(state).num_updates) == 1


def test_an_accumulated_run_continues_without_it():
  """The reverse: the inner state of a closed window, bitwise; an open window is refused."""
  params = {"theta": jnp.zeros(3), "b": jnp.zeros(())}
  tx, inner = make_tx(), optax.adamw(1e-2, weight_decay=1e-2)
  step = jit_step(tx)
  params, state, _ = run(step, params, tx.init(params), make_batches(n=EVERY_K), jax.devices()[0])
  plain = optax_accum.sharding.migrate_state(inner, params, state)
  chex.assert_trees_all_equal(plain, state.inner_state)
  with pytest.raises(ValueError, match="written by a run with optax_accum.accumulate"):
    optax_accum.sharding.check_compatible(inner, params, state)
  _, state, _ = run(step, params, state, make_batches(n=1), jax.devices()[0])
  with pytest.raises(ValueError, match="open window holds 1 microbatches.*discard"):
    optax_accum.sharding.migrate_state(inner, params, state)
  with pytest.raises(ValueError, match="does not match this transformation"):  # another inner
    optax_accum.sharding.migrate_state(tx, params, optax.sgd(0.1).init(params))


# ----------------------------------------------------------------------- another every_k on resume


def _m1_grad(w, y):
  return {"w": w["w"] - y}  # M1: an item's gradient at w is w - y


def test_a_larger_every_k_on_resume_keeps_adams_moments():
  """Issue 42, item 4: windows of 4, then (a larger effective batch) windows of 8. The reference
  is adam fed each window's mean gradient directly (C5b's rule), computed without accumulate."""
  ys = np.random.default_rng(42).normal(size=(4 + 4 + 2 + 8 + 8, 2)).astype(np.float32)
  adam = optax.adam(0.1)
  params = {"w": jnp.zeros(2)}
  four = optax_accum.accumulate(adam, 4)
  state = four.init(params)
  for y in ys[:10]:  # two windows, then two microbatches of a third
    params, state = optax_accum.update_and_apply(four, _m1_grad(params, y), state, params)
  eight = optax_accum.accumulate(adam, 8)
  state = optax_accum.discard(state)  # drop the two; the run continues from microbatch 10
  # The same leaves: nothing to move (every_k lives in the closure).
  assert optax_accum.sharding.migrate_state(eight, params, state) is state
  assert int(state.inner_state[0].count) == 2
  for y in ys[10:]:
    params, state = optax_accum.update_and_apply(eight, _m1_grad(params, y), state, params)
  ref_p, ref_s = {"w": jnp.zeros(2)}, adam.init({"w": jnp.zeros(2)})
  for lo, hi in ((0, 4), (4, 8), (10, 18), (18, 26)):
    g = {"w": ref_p["w"] - jnp.asarray(ys[lo:hi].mean(axis=0))}
    u, ref_s = adam.update(g, ref_s, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
  np.testing.assert_allclose(params["w"], ref_p["w"], rtol=1e-5, atol=1e-6)
  assert int(optax_accum.metrics(state).num_updates) == 4


def test_another_window_policy_on_resume_keeps_the_loss_scale():
  scale = optax_accum.dynamic_loss_scale(init_scale=2.0**5, growth_interval=1)
  params = {"w": jnp.zeros(2)}
  counted = optax_accum.accumulate(optax.sgd(0.1), 2, loss_scale=scale)
  state = counted.init(params)
  for _ in range(4):  # two applied windows: the scale grew twice
    _, state = counted.update({"w": jnp.ones(2) * 2.0**5}, state, params)
  budget = optax_accum.accumulate(optax.sgd(0.1), optax_accum.token_budget(6), loss_scale=scale)
  moved = optax_accum.sharding.migrate_state(budget, params, state)
  assert float(optax_accum.metrics(moved).loss_scale) == 2.0**7  # the same structure: kept
  assert int(optax_accum.metrics(moved).weight_seen) == 0  # a new policy's count starts at 0
  assert int(moved.num_updates) == 2
