"""Every public name called as the README and docs/ call it, for the type checker only.

tests/test_types.py runs pyrefly on this file with optax_accum/ (pyproject.toml, [tool.pyrefly]):
a call the package's annotations refuse here would be refused in a user's type-checked code (a
built-in policy that did not match the window-policy protocol, an ``update`` that did not match
optax's). Nothing here runs: importing this module defines functions and calls none.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import optax_accum
import optax_accum.flax
import optax_accum.sharding
import optax_accum.testing
from optax_accum.pitfalls import PitfallWarning

Params = Any  # as users hold them: optax.apply_updates returns optax.Params


def loss_fn(params: Params, batch: dict[str, jax.Array]) -> jax.Array:
  return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def options() -> list[optax.GradientTransformationExtraArgs]:
  """Each option of ``accumulate`` from its factory, as docs/ passes it."""
  ramp = lambda n: jnp.where(n < 100, 1024, 4096)
  return [
    optax_accum.accumulate(optax.adamw(1e-3), 4),
    optax_accum.accumulate(optax.sgd(0.1), lambda n: jnp.minimum(n + 1, 8)),
    optax_accum.accumulate(optax.adam(1e-3), optax_accum.token_budget(2**20)),
    optax_accum.accumulate(optax.adam(1e-3), optax_accum.token_budget(ramp, of="num_updates")),
    optax_accum.accumulate(
      optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4)),
      8,
      loss_scale=optax_accum.dynamic_loss_scale(),
      skip_if=(optax_accum.spike_rule(), lambda s: s.grad_norm > 10.0, optax.skip_not_finite),
      aggregate=optax_accum.aggregate(denominator=4096),
      observe=(optax_accum.noise_scale(0.9),),
      accumulator_dtype=jnp.float32,
    ),
    optax_accum.accumulate(optax.sgd(0.1), 2, loss_scale=optax_accum.static_loss_scale(1024.0)),
    optax_accum.accumulate(optax.adam(1e-3), 4, axis_name="data", shard_optimizer=True),
  ]


class AlternatingState(NamedTuple):
  closed: jax.Array


class Alternating:
  """docs/protocols.md's window policy, written without annotations as a user would."""

  every_k = 0

  def init(self):
    return AlternatingState(jnp.zeros((), jnp.int32))

  def init_window(self):
    return optax.EmptyState()

  def add(self, window, weight, grads):
    return window

  def closes(self, state, window, position):
    return position.mini_step >= jnp.where(position.num_updates % 2 == 0, 2, 3)

  def close(self, state, window, outcome):
    return AlternatingState(state.closed + 1)


def train(params: Params, batches: list[dict[str, jax.Array]]) -> tuple[Params, jax.Array]:
  """The README's loop: ``tx.update`` + ``optax.apply_updates``, the fused step, the metrics."""
  tx = optax.chain(optax_accum.accumulate(optax.adamw(1e-3), Alternating()), optax.identity())
  state = tx.init(params)
  for batch in batches:
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, weight=batch["mask"].sum(), value=1.0)
    params = optax.apply_updates(params, updates)
    params, state = optax_accum.update_and_apply(tx, grads, state, params, weight=3, flush=True)
  _, state = optax_accum.flush(tx, state, params)
  state = optax_accum.discard(state)
  assert isinstance(optax_accum.sharding.local_state(state), tuple)
  m = optax_accum.metrics(state)
  return params, m.num_updates + m.num_skipped


def in_step(params: Params, batch: dict[str, jax.Array]) -> Any:
  step = optax_accum.microbatched_value_and_grad(loss_fn, 4, weight_fn=lambda mb: mb["mask"].sum())
  value, grads = jax.jit(step)(params, batch)
  plan = optax_accum.plan_microbatch(
    lambda p, b: jax.grad(loss_fn)(p, b), lambda n: (params, batch), memory_budget="2GB"
  )
  report = optax_accum.testing.check_equivalence(
    loss_fn, params, batch, optax.sgd(0.1), num_microbatches=4
  )
  report.assert_passed()
  counts = optax_accum.testing.count_collectives(jax.jit(step).lower(params, batch).as_text())
  return value, grads, plan.size, counts["outside"]


def scale_out(tx: optax.GradientTransformation, params: Params, mesh: jax.sharding.Mesh) -> Any:
  sharding = optax_accum.sharding
  state = sharding.init_sharded(tx, params)
  target = sharding.abstract_state(tx, params)
  state = sharding.check_compatible(tx, params, state)
  state = sharding.migrate_state(tx, params, state)
  specs = sharding.window_specs(state, "data")
  stacked = sharding.stack_windows(sharding.stacked_state(state), mesh, "data")
  return target, specs, stacked, sharding.state_shardings(tx, params)


def with_flax(model: nnx.Module, batch: dict[str, jax.Array], variables: Any) -> Any:
  tx = optax_accum.accumulate(optax.adamw(1e-3), every_k=4)
  optimizer = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
  grads = nnx.grad(lambda m: m(batch["x"]).mean())(model)
  optimizer.update(model, grads, weight=3)
  step = optax_accum.flax.microbatched_value_and_grad(lambda m, mb: m(mb["x"]).mean(), 4)
  loss, grads = nnx.jit(step)(model, batch)
  state = optax_accum.flax.TrainState.create(apply_fn=lambda v, x: x, params=variables, tx=tx)
  state = state.apply_gradients(grads=grads, weight=3, flush=True, value=loss)
  warnings.filterwarnings("ignore", category=PitfallWarning)
  opt_state = optax_accum.accumulate(optax.sgd(0.1), 2).init({})
  assert isinstance(opt_state, optax_accum.AccumulationState)
  return state, opt_state.num_updates, opt_state.window_sum
