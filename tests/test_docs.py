"""Each docs/*.md page's Python blocks run in order, as written, in one fresh interpreter.

Per page: 8 fake CPU devices, warnings as errors. A block preceded by the line
``<!-- sketch -->`` is an excerpt that needs context the page does not give (a
cluster, a checkpoint directory, the demo's source) and is skipped; every
other block runs. After some blocks a check recomputes the page's claim.
"""

import ast
import inspect
import re

import _compat
import jax
import numpy as np
import optax
import pytest
from _api import public_names
from _markdown import ROOT, commented_sample, python_blocks, run_blocks, same_output, section_blocks

from optax_accum.testing import count_collectives

PAGES = sorted((ROOT / "docs").glob("*.md"))
RUNNABLE = [p for p in PAGES if any(not sketch for _, sketch in python_blocks(p))]

# page -> [(a string of the block to check after, the check)]
CHECKS = {
  "token_budget.md": [
    (  # each window reaches the budget, by less than one microbatch (< 400 tokens) more
      "token_budget(1000)",
      "assert len(sizes) >= 4 and all(1000 <= w < 1400 for _, w in sizes), sizes\n",
    ),
  ],
  "aggregation.md": [
    (  # C14: both paths, weight 1 and denominator 1, give the batch's gradient (float64 by hand)
      "sum_of_shares",
      "x, m = batch['x'].astype(np.float64), batch['mask'].astype(np.float64)\n"
      "r = x @ np.asarray(params['w'], np.float64) - batch['y']\n"
      "g = 2 * x.T @ (m * r) / m.sum()  # d/dw of sum(m r^2) / sum(m)\n"
      "np.testing.assert_allclose(-updates['w'], g, rtol=1e-5)\n"
      "np.testing.assert_allclose(grads['w'], g, rtol=1e-5)\n"
      "assert abs(g).min() > 1e-3  # a gradient, not zeros\n",
    ),
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
  "porting.md": [
    (  # value= reaches the window's loss: the token-weighted mean of the last window's losses
      "seen = []",
      "last = seen[-K:]\n"
      "expected = sum(v * w for v, w in last) / sum(w for _, w in last)\n"
      "np.testing.assert_allclose(float(m.window_loss), expected, rtol=1e-5)\n"
      "assert len({round(v, 4) for v, _ in last}) > 1  # unequal losses: the weights matter\n",
    ),
  ],
  "equinox.md": [
    (  # two windows of 4 microbatches: two AdamW steps on one jax.grad of each window's rows
      "def train_step",
      "ref_params, ref_static = eqx.partition(start, eqx.is_array)\n"
      "ref_tx = optax.adamw(1e-2)\n"
      "ref_state = ref_tx.init(ref_params)\n"
      "for i in (0, 4):\n"
      "  rows = {k: np.concatenate([mb[k] for mb in microbatches[i:i + 4]]) for k in batch}\n"
      "  g = jax.grad(lambda p: loss_fn(eqx.combine(p, ref_static), rows))(ref_params)\n"
      "  u, ref_state = ref_tx.update(g, ref_state, ref_params)\n"
      "  ref_params = optax.apply_updates(ref_params, u)\n"
      "for a, b in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)),\n"
      "                jax.tree.leaves(ref_params), strict=True):\n"
      "  np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)\n",
    ),
    (
      "def fused_step",
      "for a, b in zip(jax.tree.leaves(eqx.filter(fused, eqx.is_array)),\n"
      "                jax.tree.leaves(eqx.filter(model, eqx.is_array)), strict=True):\n"
      "  np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)\n",
    ),
    (  # one AdamW step on one jax.grad of the 32 rows
      "def in_step",
      "p0, s0 = eqx.partition(start, eqx.is_array)\n"
      "ref_loss, g = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, s0), window))(p0)\n"
      "u, _ = optax.adamw(1e-2).update(g, optax.adamw(1e-2).init(p0), p0)\n"
      "np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)\n"
      "for a, b in zip(jax.tree.leaves(eqx.filter(stepped, eqx.is_array)),\n"
      "                jax.tree.leaves(optax.apply_updates(p0, u)), strict=True):\n"
      "  np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)\n",
    ),
  ],
  "in_step.md": [
    (  # optax.microbatching: SUM of a sum loss over the token count is the batch; MEAN is not
      "from optax import microbatching",
      "ref = jax.value_and_grad(loss_fn)(params, batch)\n"
      "for got in (by_hand, weighted):\n"
      "  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):\n"
      "    assert jnp.allclose(a, b, rtol=1e-5, atol=1e-7), (a, b)\n"
      "assert abs(mean_of_means[1]['w'] - ref[1]['w']).max() > 1e-2\n",
    ),
  ],
  "performance.md": [
    (  # one entry per window; each window's real tokens are its microbatches' unmasked tokens
      "PEAK_FLOPS",
      "assert len(windows) == 3 and int(optax_accum.metrics(opt_state).num_updates) == 3\n"
      "for w, i in zip(windows, range(0, 3 * K, K)):\n"
      "  assert w['real tokens'] == sum(int(mb['mask'].sum()) for mb in microbatches[i:i + K])\n"
      "  assert 0 < w['MFU'] < 1 and w['tokens/s'] > 0\n",
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


def _shown(page: str, after: str) -> list[str]:
  """Patterns for the output a page shows as ``# `` comment lines below the line containing
  ``after``: its first line exactly; in the others the words, and any number where the page
  shows one (the last digits of a rounding difference depend on the machine)."""
  lines = (ROOT / "docs" / page).read_text().splitlines()
  i = next(i for i, line in enumerate(lines) if after in line) + 1
  patterns = [re.escape(lines[i].removeprefix("# "))]
  for line in lines[i + 1 :]:
    if not line.startswith("# "):
      break
    parts = re.split(r"(\d[\d.e+-]*)", line.removeprefix("# "))
    words = [re.sub(r"\\ (\\ )+", r"\\s+", re.escape(p)) for p in parts[::2]]
    patterns.append(r"[\d.e+-]+".join(words))
  return patterns


# page -> the lines its blocks print (regular expressions), in order, as the page says.
PRINTS = {
  "token_budget.md": [
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
  "guards.md": ["29 1 0", "1", r"1 1 0 \[-2\. -2\.\]"],
  "performance.md": ["3 3"],
  "equinox.md": ["2 updates", r"accumulate\(\.\.\.\)\.init got an eqx\.Module whose leaf .*"],
  "porting.md": [
    r"1 \d\.\d{3}",
    r"2 \d\.\d{3}",
    r"3 \d\.\d{3}",  # optimizer.step counts updates: 1, 2, 3
    r"\d\.\d{3}",
    r"2 \d\.\d{3}",  # TrainState.step: 2 updates; the window's loss from value=
    "2 11 3",  # resuming: 2 updates, 11 microbatches, 3 in the open window
    r"\[1 1\]",  # one update per adapter (each checked against jax.grad in the block)
    re.escape(
      "weight= did not reach accumulate: tx takes no extra arguments (a plain "
      "optax.GradientTransformation)"
    ),
    "2",  # optax.lookahead: a full window and a flushed one
    "The restored optimizer state was written by a run without optax_accum.accumulate, and tx "
    "is with it",
    "2",  # pmap: two updates (the section's own test compares them with one device)
  ],
  "scaling.md": [r"\(8, 4\) \(1, 4\)"],  # ZeRO-1: each device holds 4 of w's 32 moments
  "noise_scale.md": [
    r"B_simple [3-5]\.\d examples \(true 4\.0\)",
    r"\d+ windows: \d+\.\d examples for the first 5, \d+\.\d for the last half "
    r"\(B_simple 16, plus the overshoot\)",
  ],
  "in_step.md": [  # optax.microbatching reduces in the loop; ours after it; then the report
    r"optax\.microbatching 1 0",
    r"optax_accum, axis_name 0 1",
    *_shown("in_step.md", "print(report)"),
  ],
}

# page -> the line whose printed output the page shows as the comment lines right below it.
SAMPLES = {"in_step.md": "print(report)"}


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
  if page.name in SAMPLES:  # the page's sample output is what its block prints
    i = next(i for i, code in enumerate(blocks) if SAMPLES[page.name] in code)
    block_out = out.split(f"block {i} ran]\n")[-1].split(f"[{page.name}: block {i + 1} ran]")[0]
    sample = commented_sample(blocks[i], SAMPLES[page.name])
    assert not same_output(block_out.splitlines(), sample), same_output(
      block_out.splitlines(), sample
    )


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


# The two lines docs/porting.md's pmap section changes, and how the program read before.
PMAP_CHANGES = (
  (', axis_name="batch")  # 1: axis_name', ")"),
  (
    '  # grads = jax.lax.pmean(grads, "batch")  # 2: deleted; the boundary reduces the window once',
    '  grads = jax.lax.pmean(grads, "batch")',
  ),
)


def _run_pmap_section(code: str) -> dict:
  namespace = {"__name__": "docs_porting_pmap"}
  exec(compile(code, "docs/porting.md, pmap section", "exec"), namespace)
  return namespace


def _pmap_collectives(ns: dict) -> dict:
  mb = ns["shard"](ns["microbatches"][0])
  return count_collectives(ns["p_train_step"].lower(ns["state"], mb).compile().as_text())


@pytest.mark.slow
def test_porting_pmap_section_equals_one_device_on_the_physical_batch():
  """Issue 49, item 3: the pmap section's program (8 devices) is, on every replica, one device's
  adamw on each window's rows as one batch; it all-reduces once per window, in the boundary,
  where the program before the two-line change does so on every microstep."""
  pytest.importorskip("flax")
  from flax import jax_utils

  (code,) = section_blocks(ROOT / "docs" / "porting.md", "`pmap` programs")
  ns = _run_pmap_section(code)
  assert ns["devices"] == jax.device_count() == 8
  k, microbatches, params, loss_fn = ns["K"], ns["microbatches"], ns["params"], ns["loss_fn"]
  state = ns["state"]
  assert int(jax_utils.unreplicate(state).step) == len(microbatches) // k == 2

  ref_tx = optax.adamw(1e-2)  # the block's inner optimizer, on one device
  ref, ref_state = params, ref_tx.init(params)
  for i in range(0, len(microbatches), k):
    window = {key: np.concatenate([mb[key] for mb in microbatches[i : i + k]])
              for key in microbatches[0]}  # fmt: skip
    updates, ref_state = ref_tx.update(jax.grad(loss_fn)(ref, window), ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  for got, want, start in zip(*map(jax.tree.leaves, (state.params, ref, params)), strict=True):
    assert got.shape == (8, *want.shape)
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-5, atol=1e-7)
    assert np.abs(want - start).min() > 1e-3  # two real steps
  counts = _pmap_collectives(ns)
  assert counts["outside"]["all-reduce"] == 0 and counts["in_loop"]["all-reduce"] == 0, counts
  # One psum per window: the gradient leaves and the window's three scalar sums (weight, value,
  # value weight); jax 0.7 compiles a psum of n arrays to n all-reduces.
  psum = _compat.all_reduces_per_psum(len(jax.tree.leaves(params)) + 3)
  assert counts["in_conditional"]["all-reduce"] == psum, counts

  before = code  # the program before the two-line change
  for after, was in PMAP_CHANGES:
    assert before.count(after) == 1, after
    before = before.replace(after, was)
  old = _run_pmap_section(before)
  assert _pmap_collectives(old)["outside"]["all-reduce"] >= 1  # on every microstep
  drifted = [np.abs(x - x[:1]).max() for x in jax.tree.leaves(old["state"].params)]
  assert max(drifted) > 1e-4, drifted  # the page's warning: the replicas drift apart


def _accumulate_parameters() -> list[str]:
  """``accumulate``'s named parameters (no ``*args`` or ``**kwargs`` catch-all)."""
  import optax_accum

  params = inspect.signature(optax_accum.accumulate).parameters.values()
  variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
  return [p.name for p in params if p.kind not in variadic]


def test_changelog_counts_are_the_codes():
  """Issue 49, item 5: the release notes' counts of public names and of accumulate's parameters
  are computed from the code here, never trusted as typed (they said 29 and 8 at 30 and 9)."""
  text = " ".join((ROOT / "CHANGELOG.md").read_text().split())
  release = text.split("## [", 2)[1]  # the newest release's section
  params = re.search(r"`accumulate` takes (\d+) named parameters", release)
  names = re.search(r"The public surface is (\d+) names", release)
  assert params and names, "the newest release no longer states its counts: update this test"
  assert int(params.group(1)) == len(_accumulate_parameters()), _accumulate_parameters()
  assert int(names.group(1)) == len(public_names()), [n for n, _ in public_names()]


def test_design_names_accumulates_parameters():
  """docs/design.md's signature of accumulate lists its parameters, in order."""
  text = " ".join((ROOT / "docs" / "design.md").read_text().split())
  listed = re.search(r"`accumulate\(([^)]*)\)` composes like optax", text).group(1)
  names = [n.strip() for n in listed.split(",") if n.strip() != "*"]
  assert names == _accumulate_parameters()
