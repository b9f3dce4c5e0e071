"""What the pre-flight's weights fit and update allowance cost next to the whole check.

``optax_accum.testing.check_equivalence`` runs one window three ways (the physical batch,
in-step, across-step) in one compiled function. Issue 37 added a least-squares fit of the
weights the loss implies and issue 42 a per-element allowance for the inner update; this
measures each added piece on its own, after a warm-up call, at the same size:

* ``gram``: ``G G^T`` and ``G g_batch`` of the ``K`` stacked microbatch gradients, on the device
  (inside the check's compiled function: timed here as its own jitted function);
* ``solve``: the ``K x K`` least squares in float64 on the host;
* ``residuals``: one more pass over the gradients for the fit's and each count's residual;
* ``allowance``: the inner update (adamw) at the gradient plus and minus its tolerance;

and the whole ``check_equivalence`` call (it compiles its function on every call: that is what
a user waits for). A 2-layer tanh MLP, float32, adamw.

  python benchmarks/preflight.py --out benchmarks/results/preflight.json   # 16M params
  python benchmarks/preflight.py --quick                                   # CI smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from microstep import machine, median_ms, write_report

from optax_accum import testing


def mlp(num_params: int, features: int, seed: int = 0) -> dict[str, jax.Array]:
  """A ``features -> hidden -> features`` tanh MLP with about ``num_params`` float32 params."""
  hidden = max(1, num_params // (2 * features))
  rng = np.random.default_rng(seed)
  w1 = rng.normal(size=(features, hidden)).astype(np.float32) / np.sqrt(features)
  w2 = rng.normal(size=(hidden, features)).astype(np.float32) / np.sqrt(hidden)
  return {"w1": jnp.asarray(w1), "w2": jnp.asarray(w2)}


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
  """Mean squared error over the rows."""
  out = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
  return jnp.mean(0.5 * jnp.sum((out - batch["y"]) ** 2, axis=-1))


def _pieces(params, batch, inner, k: int, calls: int) -> tuple[dict[str, float], float]:
  """Median ms of each added piece on this size's gradients, and the residual pass' first call."""
  rows = jax.tree.leaves(batch)[0].shape[0]
  micro = jax.tree.map(lambda v: v.reshape(k, rows // k, *v.shape[1:]), batch)
  grads = jax.jit(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0)))(params, micro)
  g_ref = jax.jit(jax.grad(loss_fn))(params, batch)
  state = inner.init(params)
  u_ref = jax.jit(lambda g: inner.update(g, state, params)[0])(g_ref)

  gram_fn = jax.jit(lambda g, r: testing._gram(g, r, k))
  gram, proj, _ = jax.device_get(gram_fn(grads, g_ref))
  a, _ = testing._solve(gram, proj)
  # The demo's case: the fit, and the weights passed (the same as one of the batch's counts).
  weights = jnp.asarray(np.stack([a, np.full(k, 1 / k)]), jnp.float32)
  allowance = jax.jit(lambda g, u: testing._allowance(inner, g, state, params, u))
  t = time.perf_counter()
  jax.block_until_ready(testing._residuals(grads, g_ref, weights))
  first_ms = (time.perf_counter() - t) * 1e3  # compiles once per shape
  pieces = {
    "gram": median_ms(lambda: gram_fn(grads, g_ref), calls),
    "solve": median_ms(lambda: testing._solve(gram, proj), calls),
    "residuals": median_ms(lambda: testing._residuals(grads, g_ref, weights), calls),
    "allowance": median_ms(lambda: allowance(g_ref, u_ref), calls),
  }
  return pieces, first_ms


def run(num_params: int, k: int, rows: int, features: int, calls: int) -> dict[str, object]:
  """Milliseconds of each piece, and seconds of the whole check, for one size."""
  params = mlp(num_params, features)
  rng = np.random.default_rng(1)
  batch = {
    "x": jnp.asarray(rng.normal(size=(rows, features)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=(rows, features)), jnp.float32),
  }
  inner = optax.adamw(1e-3)
  pieces, residuals_first_ms = _pieces(params, batch, inner, k, calls)
  checks = []
  for _ in range(max(1, calls // 5)):
    t = time.perf_counter()
    report = testing.check_equivalence(loss_fn, params, batch, inner, num_microbatches=k)
    checks.append(time.perf_counter() - t)
  check_s = statistics.median(checks)
  fit_ms = pieces["gram"] + pieces["solve"] + pieces["residuals"]
  return {
    "num_params": sum(int(x.size) for x in jax.tree.leaves(params)),
    "num_microbatches": k,
    "rows": rows,
    "calls": calls,
    "ms": pieces,
    "residuals_first_call_ms": residuals_first_ms,
    "fit_ms": fit_ms,
    "check_equivalence_s": check_s,
    "fit_over_check": fit_ms / (1e3 * check_s),
    "allowance_over_check": pieces["allowance"] / (1e3 * check_s),
    "passed": report.passed(),
    "loss_weights": report.loss_weights,
    "loss_weights_residual": report.loss_weights_residual,
  }


def main(argv: list[str] | None = None) -> dict[str, object]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", type=float, nargs="+", default=[16e6])
  parser.add_argument("--num-microbatches", type=int, default=4)
  parser.add_argument("--rows", type=int, default=64, help="rows of the physical batch")
  parser.add_argument("--features", type=int, default=1024, help="MLP input and output width")
  parser.add_argument("--calls", type=int, default=10, help="timed calls per piece")
  parser.add_argument("--out", default=None, help="write the JSON here (else stdout)")
  parser.add_argument("--quick", action="store_true", help="262k params, 3 calls")
  args = parser.parse_args(argv)
  if args.quick:
    args.sizes, args.calls, args.features = [2**18], 3, 256
  results = []
  for size in args.sizes:
    r = run(int(size), args.num_microbatches, args.rows, args.features, args.calls)
    results.append(r)
    cells = "  ".join(f"{name} {ms:.1f}" for name, ms in r["ms"].items())
    print(
      f"n={r['num_params']:,} K={r['num_microbatches']}: ms {cells}; fit {r['fit_ms']:.1f} ms"
      f" of check_equivalence {r['check_equivalence_s']:.2f} s",
      file=sys.stderr,
    )
  report = {"benchmark": "preflight", "machine": machine(), "args": vars(args), "results": results}
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
