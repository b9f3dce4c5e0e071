"""Writes ``state_03.npz``: an optax_accum 0.3 optimizer state saved mid-window, and the params a
straight 0.3 run reaches, for ``tests/test_resume.py``'s 0.3 -> 0.4 migration test.

Run it against optax_accum 0.3 (``git archive v0.3 optax_accum | tar -x -C /tmp/v03``, then
``PYTHONPATH=/tmp/v03 python tests/data/make_state_03.py``). The state uses every 0.3 feature
with a sub-state: a token budget with a microbatch cap, a noise scale, a spike rule and a dynamic
loss scale, with adam inside. Leaves are stored by path (as Orbax restores a tree without a
target: nested dicts keyed by field name).
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum


def tx():
  return optax_accum.accumulate(
    optax.adam(0.05),
    4,
    window_weight=10,
    noise_scale_decay=0.5,
    skip_if=optax_accum.spike_rule("grad_norm", history=4),
    loss_scale=optax_accum.dynamic_loss_scale(init_scale=2.0**4, growth_interval=2),
  )


def data():
  rng = np.random.default_rng(3)
  ys = rng.normal(size=(14, 3)).astype(np.float32)
  ws = rng.integers(1, 6, size=14).astype(np.float32)
  return ys, ws


def main():
  assert optax_accum.__version__.startswith("0.3"), optax_accum.__version__
  t, (ys, ws) = tx(), data()
  params = {"w": jnp.zeros(3)}
  state = t.init(params)

  @jax.jit
  def step(params, state, y, w):
    scale = optax_accum.get_loss_scale(state)
    g = jax.tree.map(lambda p: (p - y) * scale, params)  # M1's gradient, loss-scaled
    return optax_accum.update_and_apply(t, g, state, params, weight=w)

  saved = None
  for i in range(14):
    params, state = step(params, state, ys[i], ws[i])
    if i == 8:
      saved = (params, state)
  leaves = {}
  for path, x in jax.tree_util.tree_flatten_with_path(saved[1])[0]:
    name = ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)
    leaves["state/" + name] = np.asarray(x)
  leaves["params_saved/w"] = np.asarray(saved[0]["w"])
  leaves["params_final/w"] = np.asarray(params["w"])
  out = pathlib.Path(__file__).with_name("state_03.npz")
  np.savez(out, **leaves)
  print(f"wrote {out}: {len(leaves)} arrays, num_updates {int(state.num_updates)}")


if __name__ == "__main__":
  main()
