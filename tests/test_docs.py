"""Each docs/*.md page's Python blocks run in order, as written, in one fresh interpreter.

Per page: 8 fake CPU devices, warnings as errors. A block preceded by the line
``<!-- sketch -->`` is an excerpt that needs context the page does not give (a
cluster, a checkpoint directory, the demo's source) and is skipped; every
other block runs. After some blocks a check recomputes the page's claim.
"""

import ast
import re

import pytest
from _markdown import ROOT, python_blocks, run_blocks

PAGES = sorted((ROOT / "docs").glob("*.md"))
RUNNABLE = [p for p in PAGES if any(not sketch for _, sketch in python_blocks(p))]

# page -> [(a string of the block to check after, the check)]
CHECKS = {
  "window_weight.md": [
    (  # each window reaches the budget, by less than one microbatch (< 400 tokens) more
      "window_weight=1000",
      "assert len(sizes) >= 4 and all(1000 <= w < 1400 for _, w in sizes), sizes\n",
    ),
  ],
  "aggregation.md": [
    (  # the FP8 window equals the physical batch: Flax's TrainState, one grad per window
      "Fp8DirectDotGeneralOp",
      "from flax.training import train_state\n"
      "ref = train_state.TrainState.create(apply_fn=model.apply, params=variables,"
      " tx=optax.adam(1e-2))\n"
      "phys = jax.jit(lambda s, x, y: s.apply_gradients(grads=jax.grad(loss_fn)(s.params, x, y,"
      " len(y))))\n"
      "for i in range(0, len(data), K):\n"
      "  ref = phys(ref, *(np.concatenate(p) for p in zip(*data[i:i + K])))\n"
      "ours, theirs = state.params, ref.params  # meta and params, to float32 rounding\n"
      "for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):\n"
      "  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)\n",
    ),
  ],
  "noise_scale.md": [
    (  # issue 40: the windows start at the minimum and grow to about B_simple = 16 examples
      "adaptive_window(4, 256",
      "assert w[:5].mean() < 9 and 10 < w[len(w) // 2 :].mean() < 32, w\n"
      "assert float(optax_accum.metrics(state).window_budget) > 8\n",
    ),
  ],
  "scaling.md": [
    (
      "init_sharded",
      "assert opt_state.window.grad_sum['w'].sharding.is_equivalent_to(params['w'].sharding, 2)\n"
      "assert len(params['w'].sharding.device_set) == 8\n"
      "assert int(optax_accum.metrics(opt_state).mini_step) == 1\n",
    ),
    (
      "shard_map",  # each device added its own 4 rows; the window sums are per device
      "m = optax_accum.metrics(opt_state)\n"
      "w = np.asarray(m.pending_weight)\n"
      "assert w.shape == (8,) and w.sum() == np.asarray(batch['mask']).sum()\n",
    ),
  ],
}
# page -> the lines its blocks print (regular expressions), in order, as the page says.
PRINTS = {
  "window_weight.md": [
    r"\[\(\d, \d{4}\)(, \(\d, \d{4}\)){3}\]",
    r"\[500, 500, 500, 500, 500, 500, 2000, 2000, 2000\]",
    r"1\.0 2\.0",
    r"1103806595079",
  ],
  "mixed_precision.md": [r"3 3 8192\.0"],
  "aggregation.md": [
    r"\[-0\.5 -0\.5\]",
    "2",
    r"\[4\. 5\. 3\.\] \[-0\.1 -0\.1 -0\.1\]",
    r"3 \(16,\)",
  ],
  "flax.md": [r"update 1: grad_norm \d+\.\d{3}", r"update 2: grad_norm \d+\.\d{3}", "20 3", "3"],
  "guards.md": ["29 1 0", "1"],
  "porting.md": [
    r"1 \d\.\d{3}",
    r"2 \d\.\d{3}",
    r"3 \d\.\d{3}",  # optimizer.step counts updates: 1, 2, 3
    r"\d\.\d{3}",
    "2",
    "The restored optimizer state was written by a run without optax_accum.accumulate, and tx "
    "is with it",
  ],
  "noise_scale.md": [
    r"B_simple [3-5]\.\d examples \(true 4\.0\)",
    r"\d+ windows: \d+\.\d examples for the first 5, \d+\.\d for the last half "
    r"\(B_simple 16, plus the overshoot\)",
  ],
}


def test_sketches_are_the_exception():
  blocks = [sketch for p in PAGES for _, sketch in python_blocks(p)]
  assert 0 < sum(blocks) < len(blocks) / 2


@pytest.mark.slow  # each page compiles a few small steps: 10 to 40 s on 2 cores
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_docs_page_python_blocks_run_in_order(page, tmp_path):
  blocks = [code for code, sketch in python_blocks(page) if not sketch]
  checks = [""] * len(blocks)
  for marker, check in CHECKS.get(page.name, []):
    i = next(i for i, code in enumerate(blocks) if marker in code)
    checks[i] = check
  out = run_blocks(page, blocks, checks, tmp_path)
  assert out.count("ran]") == len(blocks)
  printed = [line for line in out.splitlines() if not line.endswith("ran]")]
  if page.name in PRINTS:
    assert len(printed) == len(PRINTS[page.name]), out
    for pattern, line in zip(PRINTS[page.name], printed, strict=True):
      assert re.fullmatch(pattern, line), (pattern, line)


def _design_rows() -> dict[str, set[str]]:
  """docs/design.md's module table: module path -> the package modules its imports column names."""
  rows = {}
  for line in (ROOT / "docs" / "design.md").read_text().splitlines():
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
    if len(cells) == 3 and re.fullmatch(r"`[\w/]+\.py`", cells[0]):
      rows[cells[0].strip("`")] = set(re.findall(r"`([\w.]+)`", cells[2]))
  return rows


def _package_imports(path) -> set[str]:
  """The optax_accum modules ``path`` imports, named relative to the package (``_state``)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("optax_accum"):
      if node.module == "optax_accum":
        found.update(a.name for a in node.names)
      else:
        found.add(node.module.removeprefix("optax_accum.").removeprefix("flax."))
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names if a.name.startswith("optax_accum.")]
      found.update(n.removeprefix("optax_accum.") for n in names)
  return {m for m in found if m.split(".")[0] != "demo"}


def test_design_module_map_is_true_to_the_imports():
  """Every module of the package has a row in docs/design.md whose imports column is its imports."""
  pkg = ROOT / "optax_accum"
  skip = {"__main__.py", "flax/__init__.py"}  # the demo's command; the flax re-exports
  modules = {
    str(p.relative_to(pkg)): p
    for p in pkg.rglob("*.py")
    if "demo" not in p.relative_to(pkg).parts and str(p.relative_to(pkg)) not in skip
  }
  rows = _design_rows()
  assert sorted(rows) == sorted(modules)
  above: set[str] = set()
  for name in rows:  # in the table's order
    imports = _package_imports(modules[name])
    assert rows[name] == imports, name
    assert imports <= above, (name, imports - above)  # imports point up the table
    above.add(name.removesuffix(".py").removeprefix("flax/"))
