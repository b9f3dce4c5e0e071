"""The README's Python examples run, and its example trains as it says."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python_blocks() -> list[str]:
  text = (ROOT / "README.md").read_text()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_two_setup_commands_first():
  text = (ROOT / "README.md").read_text()
  first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
  commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
  assert commands == [
    'pip install -e ".[flax]" && optax-accum demo',
    'pip install -e ".[test]" && python -m pytest -n 2',
  ]
  ci = (ROOT / ".ci" / "run").read_text()
  assert commands[1] in ci


def test_readme_example_equals_one_physical_batch():
  ns: dict = {}
  exec(compile(_python_blocks()[0], "README.md", "exec"), ns)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 5, 3)).astype(np.float32)
  y = rng.normal(size=(4, 5)).astype(np.float32)
  mask = (rng.random((4, 5)) < 0.6).astype(np.float32)
  mask[:, 0] = 1.0
  params, opt_state = ns["params"], ns["opt_state"]
  for i in range(4):
    batch = {"x": jnp.asarray(x[i]), "y": jnp.asarray(y[i]), "mask": jnp.asarray(mask[i])}
    params, opt_state = ns["train_step"](params, opt_state, batch)
  # Reference: one AdamW step on the token mean over all 4 microbatches at once.
  full = {"x": x.reshape(20, 3), "y": y.reshape(20), "mask": mask.reshape(20)}
  grads = jax.grad(ns["loss_fn"])({"w": jnp.zeros(3)}, full)
  ref_tx = optax.adamw(1e-3, weight_decay=1e-2)
  zero = {"w": jnp.zeros(3)}
  updates, _ = ref_tx.update(grads, ref_tx.init(zero), zero)
  np.testing.assert_allclose(params["w"], updates["w"], rtol=1e-5, atol=1e-8)


def test_readme_planning_block_runs_after_the_example():
  blocks = _python_blocks()
  planning_block = next(b for b in blocks if "plan_microbatch" in b)
  ns: dict = {}
  exec(compile(blocks[0], "README.md", "exec"), ns)
  exec(compile(planning_block, "README.md", "exec"), ns)
  plan, make_args = ns["plan"], ns["make_args"]
  from optax_accum.planning import compiled_peak_bytes

  # Settled: the planned size fits 64 MB and the next one, compiled again here, does not.
  assert plan.peak_bytes == compiled_peak_bytes(ns["step"], *make_args(plan.size)) <= 64 * 10**6
  assert compiled_peak_bytes(ns["step"], *make_args(plan.size + 1)) > 64 * 10**6
  assert plan.num_compilations <= 2 + 20
  # Each row holds x (512 float32) at least: the line's slope counts it.
  assert plan.bytes_per_row >= 512 * 4
