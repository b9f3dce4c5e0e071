"""optax_accum/_vma.py: accumulate(..., axis_name=) in shard_map: local windows, one all-reduce.

Eight fake CPU devices (conftest.py). Model M2 of shared/cases (linear regression)
on padded microbatches with a token mask; every device holds its own tokens and
its own window sums. The reference is float64 NumPy over all valid tokens of the
window, gathered from every device: one physical batch.
"""

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
from optax_accum import testing

AXIS = "data"
N_DEV = 8
TOKENS = 4  # padded microbatch length per device
EVERY_K = 2

# The two recipes: check_vma=True needs params marked device-varying before jax.grad;
# check_vma=False skips the type check (the replicas are equal by construction).
RECIPES = [
  pytest.param(True, id="check_vma"),
  pytest.param(False, id="no_check_vma"),
]


def loss_fn(params, batch):
  """Masked mean of 0.5 * residual**2; 0/0 = NaN for a microbatch without tokens."""
  pred = batch["x"] @ params["theta"] + params["b"]
  per_token = 0.5 * (pred - batch["y"]) ** 2
  return jnp.sum(jnp.where(batch["mask"], per_token, 0.0)) / jnp.sum(batch["mask"])


def make_step(tx, mesh, specs, check_vma, pcast=None):
  """The documented recipe: one microbatch per call, window sums on a device axis."""
  pcast = check_vma if pcast is None else pcast
  chex.clear_trace_counter()

  def body(params, opt_state, batch):
    opt_state = optax_accum.sharding.local_state(opt_state)
    # Differentiate w.r.t. a device-varying copy: the gradient stays local (no
    # all-reduce per microstep). tx.update and apply_updates get the replicated params.
    local = _compat.pcast_varying(params, AXIS) if pcast else params
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    weight = jnp.sum(batch["mask"])
    updates, opt_state = tx.update(grads, opt_state, params, weight=weight, value=loss)
    return optax.apply_updates(params, updates), optax_accum.sharding.stacked_state(opt_state)

  return jax.jit(
    jax.shard_map(
      chex.assert_max_traces(body, n=1),  # one compilation serves every microstep
      mesh=mesh,
      in_specs=(P(), specs, P(AXIS)),
      out_specs=(P(), specs),
      check_vma=check_vma,
    )
  )


def make_data(counts, seed=0):
  """Microbatches; counts[step][device] valid tokens (the rest is padding)."""
  rng = np.random.default_rng(seed)
  batches = []
  for row in counts:
    x = rng.normal(size=(N_DEV * TOKENS, 3)).astype(np.float32)
    y = rng.normal(size=(N_DEV * TOKENS,)).astype(np.float32)
    mask = np.zeros((N_DEV, TOKENS), bool)
    for d, c in enumerate(row):
      mask[d, :c] = True
    batches.append({"x": x, "y": y, "mask": mask.reshape(-1)})
  return batches


def reference_window(params, window, clip_norm=None):
  """float64 SGD(1) step on the mean loss over all valid tokens of the window."""
  x = np.concatenate([b["x"][b["mask"]] for b in window]).astype(np.float64)
  y = np.concatenate([b["y"][b["mask"]] for b in window]).astype(np.float64)
  theta, b = np.asarray(params["theta"], np.float64), float(params["b"])
  r = x @ theta + b - y
  g_theta, g_b = x.T @ r / len(y), r.sum() / len(y)
  if clip_norm is not None:
    norm = np.sqrt(np.sum(g_theta**2) + g_b**2)
    scale = min(1.0, clip_norm / norm)
    g_theta, g_b = g_theta * scale, g_b * scale
  loss = np.mean(0.5 * r**2)
  return {"theta": theta - g_theta, "b": np.float64(b - g_b)}, loss


def place(mesh, tree, spec):
  return jax.device_put(tree, NamedSharding(mesh, spec))


def assert_replicas_equal(tree):
  """Every device's copy of every leaf holds the same bits."""
  for leaf in jax.tree.leaves(tree):
    shards = [np.asarray(s.data).tobytes() for s in leaf.addressable_shards]
    assert len(shards) == N_DEV and all(s == shards[0] for s in shards)


def setup(tx, params0):
  mesh = _compat.make_mesh((N_DEV,), (AXIS,))
  params = place(mesh, params0, P())
  opt_state = optax_accum.sharding.stack_windows(tx.init(params0), mesh, AXIS)
  specs = optax_accum.sharding.window_specs(opt_state, AXIS)
  return mesh, params, opt_state, specs


PARAMS0 = {"theta": jnp.array([0.5, -1.0, 2.0], jnp.float32), "b": jnp.array(0.25, jnp.float32)}
# Window 1: device 3 holds no token at all; window 2: device 5 none in its first microbatch.
COUNTS = [
  [4, 1, 2, 0, 3, 4, 1, 2],
  [2, 4, 1, 0, 1, 3, 4, 2],
  [1, 1, 4, 2, 3, 0, 2, 4],
  [3, 2, 1, 4, 2, 1, 1, 1],
]


@pytest.mark.parametrize("check_vma", RECIPES)
@pytest.mark.parametrize("clip_norm", [None, 0.5])
def test_global_token_weighted_mean_and_identical_replicas(check_vma, clip_norm):
  inner = optax.sgd(1.0)
  if clip_norm is not None:
    inner = optax.chain(optax.clip_by_global_norm(clip_norm), inner)
  tx = optax_accum.accumulate(inner, EVERY_K, axis_name=AXIS)
  mesh, params, opt_state, specs = setup(tx, PARAMS0)
  step = make_step(tx, mesh, specs, check_vma)
  batches = make_data(COUNTS)
  expected = {k: np.asarray(v, np.float64) for k, v in PARAMS0.items()}
  for i, batch in enumerate(batches):
    before = params
    params, opt_state = step(params, opt_state, place(mesh, batch, P(AXIS)))
    assert_replicas_equal(params)
    m = optax_accum.metrics(opt_state)
    assert_replicas_equal([m.num_updates, m.num_skipped, m.mini_step, m.window_loss])
    if (i + 1) % EVERY_K:
      chex.assert_trees_all_equal(params, before)  # between boundaries: exact zeros
      continue
    window = batches[i + 1 - EVERY_K : i + 1]
    expected, loss = reference_window(expected, window, clip_norm)
    chex.assert_trees_all_close(params, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.window_loss, loss, rtol=1e-5)
    assert int(m.num_updates) == (i + 1) // EVERY_K and int(m.num_skipped) == 0
    np.testing.assert_array_equal(m.pending_weight, np.zeros(N_DEV))
  assert int(optax_accum.metrics(opt_state).num_microbatches) == len(batches)


@pytest.mark.parametrize("check_vma", RECIPES)
def test_overflow_on_one_device_skips_the_window_everywhere(check_vma):
  tx = optax_accum.accumulate(optax.sgd(1.0), EVERY_K, axis_name=AXIS)
  mesh, params, opt_state, specs = setup(tx, PARAMS0)
  step = make_step(tx, mesh, specs, check_vma)
  batches = make_data([[4] * N_DEV] * 4, seed=1)
  batches[1]["x"] = batches[1]["x"].copy()
  batches[1]["x"][2 * TOKENS] = np.inf  # a valid token of device 2 only, window 1
  for batch in batches[:2]:
    params, opt_state = step(params, opt_state, place(mesh, batch, P(AXIS)))
  assert_replicas_equal(params)
  chex.assert_trees_all_equal(params, PARAMS0)  # skipped on every device
  m = optax_accum.metrics(opt_state)
  assert (int(m.num_skipped), int(m.num_updates)) == (1, 0)
  assert not bool(m.has_grad_norm)  # no norm for a non-finite window, and no NaN in the state
  assert_state_finite(opt_state)
  chex.assert_trees_all_equal(
    opt_state.window.grad_sum, jax.tree.map(jnp.zeros_like, opt_state.window.grad_sum)
  )
  for batch in batches[2:]:  # the next window is clean and applies everywhere
    params, opt_state = step(params, opt_state, place(mesh, batch, P(AXIS)))
  expected, _ = reference_window(PARAMS0, batches[2:])
  chex.assert_trees_all_close(params, expected, rtol=1e-5, atol=1e-6)
  assert_replicas_equal(params)
  assert int(optax_accum.metrics(opt_state).num_updates) == 1


def count(tx, check_vma, pcast):
  mesh, params, opt_state, specs = setup(tx, PARAMS0)
  step = make_step(tx, mesh, specs, check_vma, pcast)
  batch = place(mesh, make_data([[4] * N_DEV])[0], P(AXIS))
  return testing.count_collectives(step.lower(params, opt_state, batch).compile().as_text())


@pytest.mark.parametrize("check_vma", RECIPES)
def test_one_all_reduce_per_window(check_vma):
  """No collective between boundaries; one variadic all-reduce (the psum) at the boundary."""
  tx = optax_accum.accumulate(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    EVERY_K,
    loss_scale=optax_accum.dynamic_loss_scale(),
    axis_name=AXIS,
  )
  counts = count(tx, check_vma, pcast=check_vma)
  assert sum(counts["outside"].values()) == 0, counts
  # one psum of the window: grad_sum (2 leaves), weight_sum, value_sum, value_weight
  assert dict(counts["in_conditional"]) == _compat.one_psum(5), counts


def test_trap_grad_of_replicated_params_is_refused():
  """check_vma=True without pcast: jax.grad sums the devices' mean gradients (equal weights)
  on every microstep; weighted again by each device's weight that is no batch's gradient, so
  accumulate refuses it and names the fix."""
  mesh = _compat.make_mesh((N_DEV,), (AXIS,))
  host = jax.tree.map(np.asarray, make_data([COUNTS[0]])[0])
  params, batch = place(mesh, PARAMS0, P()), place(mesh, host, P(AXIS))
  grad = jax.shard_map(jax.grad(loss_fn), mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
  summed = jax.jit(grad)(params, batch)  # what the trap hands tx.update on every device
  rows = lambda d: jax.tree.map(lambda x: x[d * TOKENS : (d + 1) * TOKENS], host)
  per_device = [jax.grad(loss_fn)(PARAMS0, rows(d)) for d in range(N_DEV) if COUNTS[0][d]]
  np.testing.assert_allclose(summed["b"], sum(g["b"] for g in per_device), rtol=1e-5)
  tx = optax_accum.accumulate(optax.sgd(1.0), EVERY_K, axis_name=AXIS)
  with pytest.raises(ValueError, match=r"not device-varying.*pcast\(params, 'data'"):
    count(tx, check_vma=True, pcast=False)


def test_forgotten_or_unbound_axis_name_is_named():
  """Per-device gradients with no axis_name, and an axis_name no shard_map binds, raise with
  the argument to pass instead of an internal lax.cond or axis_index error."""
  tx = optax_accum.accumulate(optax.sgd(1.0), EVERY_K)
  mesh, params, _, _ = setup(optax_accum.accumulate(optax.sgd(1.0), EVERY_K, axis_name=AXIS),
                             PARAMS0)  # fmt: skip
  state = tx.init(PARAMS0)
  batch = place(mesh, make_data([[4] * N_DEV])[0], P(AXIS))

  def body(params, opt_state, batch):
    grads = jax.grad(loss_fn)(_compat.pcast_varying(params, AXIS), batch)
    return tx.update(grads, opt_state, params)

  step = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P()))
  with pytest.raises(ValueError, match="accumulate has no axis_name: pass .*axis_name='data'"):
    jax.jit(step).lower(params, state, batch)
  unbound = optax_accum.accumulate(optax.sgd(1.0), EVERY_K, axis_name=AXIS)
  with pytest.raises(ValueError, match="no such axis is bound where tx.update runs"):
    jax.jit(unbound.update)(PARAMS0, unbound.init(PARAMS0), PARAMS0)


def test_in_step_without_axis_name_inside_shard_map_is_refused():
  mesh = _compat.make_mesh((N_DEV,), (AXIS,))
  batch = place(mesh, make_data([[4] * N_DEV])[0], P(AXIS))
  f = optax_accum.microbatched_value_and_grad(loss_fn, 2, weight_fn=lambda mb: mb["mask"].sum())
  step = jax.shard_map(f, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P()))
  with pytest.raises(ValueError, match="without axis_name inside shard_map.*axis_name='data'"):
    jax.jit(step).lower(place(mesh, PARAMS0, P()), batch)


def test_trap_per_device_window_cannot_be_returned_replicated():
  """A device's own weighted sum is device-varying: out_specs=P() rejects it."""
  mesh = _compat.make_mesh((N_DEV,), (AXIS,))
  params = place(mesh, PARAMS0, P())

  def body(params, batch):
    grads = jax.grad(loss_fn)(_compat.pcast_varying(params, AXIS), batch)
    acc = jax.tree.map(jnp.zeros_like, grads)
    return optax_accum._numerics.weighted_add(acc, grads, jnp.sum(batch["mask"]))

  batch = place(mesh, make_data([[4] * N_DEV])[0], P(AXIS))
  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
  with pytest.raises(ValueError, match="replicat"):
    jax.jit(f).lower(params, batch)


def test_per_device_windows_without_axis_name_under_check_vma():
  """Independent per-device runs (no axis_name) inside shard_map with check_vma=True.

  Each device's window is its own: the result equals a plain single-device run on that
  device's gradients (the boundary's constant branches must keep the device variance).
  """
  mesh = _compat.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  sharding = NamedSharding(mesh, P("d"))
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  params = jax.device_put(jnp.zeros((2, 3)), sharding)
  state = jax.device_put(jax.vmap(tx.init)(jnp.zeros((2, 3))), sharding)
  grads = np.arange(12, dtype=np.float32).reshape(2, 2, 3)  # [microstep, device, 3]

  def body(p, s, g):
    s = jax.tree.map(lambda x: x[0], s)
    u, s = tx.update(g[0], s, p[0], weight=1.0 + g[0, 0])
    return (p[0] + u)[None], jax.tree.map(lambda x: x[None], s)

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  for g in grads:
    params, state = step(params, state, jax.device_put(jnp.asarray(g), sharding))
  w = 1.0 + grads[:, :, :1]  # weight of each device's microbatch, [microstep, device, 1]
  expected = -(w * grads).sum(0) / w.sum(0)
  np.testing.assert_allclose(np.asarray(params), expected, rtol=1e-6)


def scan_training(tx, mesh, windows, fused=False):
  """The whole run inside one shard_map: tx.init there, microbatches through lax.scan.

  No recipe: no stack_windows / local_state, params passed replicated (P()), gradients
  taken with respect to a device-varying copy, a per-device token count as the weight.
  """

  def body(params, xs):
    def micro(carry, batch):
      params, opt_state = carry
      local = _compat.pcast_varying(params, AXIS)
      loss, grads = jax.value_and_grad(loss_fn)(local, batch)
      w = jnp.sum(batch["mask"])
      if fused:
        params, opt_state = optax_accum.update_and_apply(
          tx, grads, opt_state, params, weight=w, value=loss
        )
      else:
        updates, opt_state = tx.update(grads, opt_state, params, weight=w, value=loss)
        params = optax.apply_updates(params, updates)
      return (params, opt_state), None

    (params, opt_state), _ = jax.lax.scan(micro, (params, tx.init(params)), xs)
    m = optax_accum.metrics(opt_state)
    return params, (m.num_updates, m.window_loss, m.has_window_loss)

  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=(P(), P()))
  xs = jax.tree.map(lambda *b: np.stack(b), *windows)
  return jax.jit(f), place(mesh, xs, P(None, AXIS))


@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
def test_state_made_inside_shard_map_is_a_scan_carry(fused):
  """Issue 11, item 2: shard_map (check_vma=True) without the recipe gave JAX's type error.

  tx.init inside shard_map made unvarying window sums that the first microbatch turned
  device-varying: "scan body function carry input and carry output must have equal
  types". The window sums are now device-varying from init (a type, no communication).
  Expected: the float64 reference of the globally token-weighted window; one all-reduce.
  """
  tx = optax_accum.accumulate(optax.sgd(1.0), EVERY_K, axis_name=AXIS)
  mesh = _compat.make_mesh((N_DEV,), (AXIS,))
  batches = make_data(COUNTS)
  step, xs = scan_training(tx, mesh, batches, fused)
  params = place(mesh, PARAMS0, P())
  out, (num_updates, window_loss, has_loss) = step(params, xs)
  expected = {k: np.asarray(v, np.float64) for k, v in PARAMS0.items()}
  for i in range(0, len(batches), EVERY_K):
    expected, loss = reference_window(expected, batches[i : i + EVERY_K])
  chex.assert_trees_all_close(out, expected, rtol=1e-5, atol=1e-6)
  assert int(num_updates) == len(batches) // EVERY_K and bool(has_loss)
  np.testing.assert_allclose(window_loss, loss, rtol=1e-5)
  counts = optax_accum.testing.count_collectives(step.lower(params, xs).compile().as_text())
  # The boundary's cond sits in the scan body: count_collectives reports it as in_loop (it runs
  # at most once per iteration); nothing outside the cond, one all-reduce in all.
  assert sum(counts["outside"].values()) == 0, counts
  assert dict(counts["in_loop"]) == _compat.one_psum(5) and not counts["in_conditional"], counts


def test_device_varying_params_are_refused_with_the_fix():
  """Issue 11, item 2: params pcast to varying gave JAX's "cond branches must have equal
  output types"; now our error names the argument and the fix."""
  tx = optax_accum.accumulate(optax.sgd(1.0), EVERY_K, axis_name=AXIS)
  mesh = _compat.make_mesh((N_DEV,), (AXIS,))

  def body(params, batch):
    local = _compat.pcast_varying(params, AXIS)
    grads = jax.grad(loss_fn)(local, batch)
    updates, _ = tx.update(grads, tx.init(params), local, weight=jnp.sum(batch["mask"]))
    return optax.apply_updates(params, updates)

  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
  batch = place(mesh, make_data([[4] * N_DEV])[0], P(AXIS))
  with pytest.raises(ValueError, match=r"params\['b'\] varies over the mesh axis.*pcast"):
    jax.jit(f).lower(place(mesh, PARAMS0, P()), batch)
