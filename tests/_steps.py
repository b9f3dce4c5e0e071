"""Shared test helpers: one jitted microstep of an accumulate transformation."""

import jax
import jax.numpy as jnp
import optax


def make_step(tx):
  """One jitted microstep: weight and flush are traced, so one compilation serves all."""

  @jax.jit
  def step(grads, state, params, weight, flush):
    updates, state = tx.update(grads, state, params, weight=weight, flush=flush)
    return updates, state, optax.apply_updates(params, updates)

  return step


def call(step, grads, state, params, weight=1.0, flush=False):
  return step(grads, state, params, jnp.asarray(weight, jnp.float32), jnp.asarray(flush))
