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
