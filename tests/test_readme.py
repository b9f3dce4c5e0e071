"""The README's commands and links hold, and its Python blocks run in order as written.

The blocks run top to bottom in one fresh interpreter (8 fake CPU devices,
warnings as errors), exactly as a reader would paste them; after some blocks a
check recomputes what the block claims another way (full-batch ``jax.grad``
and plain optax).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _finite import assert_state_finite
from _markdown import ROOT, python_blocks, run_blocks

import optax_accum

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

README = ROOT / "README.md"
URL = "https://github.com/optax-accum/optax_accum"

# After block 1: 8 microbatches made 2 AdamW steps, each on the token mean of its 4 microbatches.
CHECK_EXAMPLE = """
ref = {"w": jnp.zeros(3)}
ref_tx = optax.adamw(1e-3, weight_decay=1e-2)
ref_state = ref_tx.init(ref)
for w in range(2):
  window = {k: np.concatenate([mb[k] for mb in microbatches[4 * w : 4 * w + 4]])
            for k in microbatches[0]}
  u, ref_state = ref_tx.update(jax.grad(loss_fn)(ref, window), ref_state, ref)
  ref = optax.apply_updates(ref, u)
np.testing.assert_allclose(params["w"], ref["w"], rtol=1e-5, atol=1e-8)
assert abs(params["w"]).min() > 1e-4  # two real steps were taken
"""
# After block 2: the in-step helper returns what jax.value_and_grad of the whole batch does.
CHECK_IN_STEP = """
ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, batch)
np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5, atol=1e-7)
"""
# After the mixed-precision block: the gradient is of loss * scale, the loss unscaled.
CHECK_SCALED = """
scale = float(optax_accum.metrics(opt_state).loss_scale)
assert scale > 1
ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, batch)
np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
np.testing.assert_allclose(grads["w"], scale * ref_grads["w"], rtol=1e-4)
"""
# After the scaling block: the state is placed like the params, the batch split 8 ways.
CHECK_SHARDED = """
assert len(batch["x"].sharding.device_set) == jax.device_count() == 8
assert opt_state.window.grad_sum["w"].sharding.is_equivalent_to(params["w"].sharding, 1)
assert int(optax_accum.metrics(opt_state).mini_step) == 1
"""


def _commands():
  block = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1)
  return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_setup_commands_name_what_pyproject_and_ci_define():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  commands = _commands()
  assert len(commands) == 3  # install-and-run, install-and-test (fast), everything
  for command in commands:
    for extra in re.findall(r'pip install -e "\.\[(\w+)\]"', command):
      assert extra in project["optional-dependencies"], command
  assert commands[0].endswith("optax-accum demo") and "optax-accum" in project["scripts"]
  ci = (ROOT / ".ci" / "run").read_text()
  assert commands[1].endswith('-m "not slow"') and commands[1] in ci  # CI runs both commands
  assert commands[2] == "python -m pytest -n 2" and f"&& {commands[2]}'" in ci


def test_project_urls_are_the_readme_clone_url():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert f"git clone {URL}" in README.read_text()
  urls = project["urls"]
  assert {"Homepage", "Repository", "Documentation", "Issues", "Changelog"} <= set(urls)
  repository = {k: u for k, u in urls.items() if k != "Documentation"}  # the site: test_site.py
  assert all(u == URL or u.startswith(URL + "/") for u in repository.values()), urls
  assert (ROOT / "CHANGELOG.md").exists() and urls["Changelog"].endswith("CHANGELOG.md")
  assert project["license"] == "Apache-2.0"
  assert all((ROOT / f).is_file() for f in project["license-files"])


# The token-budget block: windows close at the first microbatch reaching 24 tokens (issue 15).
CHECK_TOKEN_BUDGET = """
closed, pending = [], 0
for b in microbatches:
  pending += int(np.asarray(b["mask"]).sum())
  if pending >= 24:
    closed, pending = closed + [pending], 0
assert len(closed) >= 2 and int(m.num_updates) == len(closed), (closed, m)
assert int(m.weight_seen) == sum(closed) and int(m.window_weight) == closed[-1]
"""


@pytest.mark.slow  # compiles a few dozen small steps: about 20 s on 2 cores
def test_readme_python_blocks_run_in_order(tmp_path):
  blocks = python_blocks(README)
  assert not any(sketch for _, sketch in blocks), "the README has no sketches: all of it runs"
  code = [c for c, _ in blocks]
  checks = [""] * len(code)
  # Each check goes after the block that makes the claim it tests.
  for marker, check in (
    ("def train_step", CHECK_EXAMPLE),
    ("microbatched_value_and_grad", CHECK_IN_STEP),
    ("loss_scale=scale", CHECK_SCALED),
    ("init_sharded", CHECK_SHARDED),
    ("token_budget(24)", CHECK_TOKEN_BUDGET),
  ):
    i = next(i for i, c in enumerate(code) if marker in c)
    checks[i] = check
  # The pre-flight is a line of the first example, before its training loop (issue 49).
  assert code[0].index("testing.check_equivalence(") < code[0].index("for batch in microbatches")
  out = run_blocks(README, code, checks, tmp_path)
  assert out.count("ran]") == len(code)
  # What the text says the blocks print.
  assert "2 updates, 0 microbatches pending" in out
  assert "optax_accum pre-flight: one window of 4 microbatches" in out
  # The planning block prints what its comments say (up to a colon's explanation).
  planning = next(c for c in code if "plan_microbatch" in c)
  for said in re.findall(r"^print\(.*\)  # ([^:\n]+)", planning, flags=re.M):
    assert said in out.splitlines(), (said, out)
  grad = re.search(r"gradient, in-step +\S+ +(\S+)", out)
  mean_of_means = re.search(r"mean of means would give \(grad\) +\S+ +(\S+)", out)
  assert float(grad.group(1)) < 1e-5 < 1e-2 < float(mean_of_means.group(1))
  text = README.read_text()
  verdict = re.search(r"^(PASS|FAIL): ", out, flags=re.M).group(1)
  assert f"prints a verdict (here `{verdict}`" in text and verdict == "PASS"
  claimed = re.search(r"here ([\d.]+) of the gradient's largest element", text).group(1)
  assert claimed == mean_of_means.group(1)  # the number the table prints (3 digits)
  # The comment after each print(...) of the planning block is the line it prints.
  printed = out.splitlines()
  for line in next(c for c in code if "plan_microbatch" in c).splitlines():
    if line.startswith("print(") and "  # " in line:
      assert line.split("  # ", 1)[1] in printed, (line, out)


def _compiled_bytes(step, *args):
  """What XLA reports for ``step(*args)``: arguments + outputs + temporaries - aliased."""
  stats = step.lower(*args).compile().memory_analysis()
  used = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
  return used - stats.alias_size_in_bytes


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
def test_readme_planning_block_runs_after_the_example():
  blocks = [code for code, _ in python_blocks(README)]
  planning_block = next(b for b in blocks if "plan_microbatch" in b)
  ns: dict = {}
  exec(compile(blocks[0], "README.md", "exec"), ns)
  exec(compile(planning_block, "README.md", "exec"), ns)
  plan, make_args = ns["plan"], ns["make_args"]
  # Settled: the planned size fits 64 MB and the next one, compiled again here, does not.
  assert plan.peak_bytes == _compiled_bytes(ns["step"], *make_args(plan.size)) <= 64 * 10**6
  assert _compiled_bytes(ns["step"], *make_args(plan.size + 1)) > 64 * 10**6
  assert plan.num_compilations <= 2 + 20
  # Each row holds x (512 float32) at least: the line's slope counts it.
  assert plan.bytes_per_row >= 512 * 4


def _weight_table() -> list[tuple[str, str, str]]:
  """The README's weight table: (loss name, the loss's expression, the weight's expression)."""
  text = README.read_text()
  table = text.split("<!-- weight-table -->\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
  rows = []
  for line in table:
    loss, _, weight = (c.strip() for c in line.strip().strip("|").split(" | "))
    name, code = re.fullmatch(r"([\w -]+?) `([^`]+)`", loss).groups()
    rows.append((name, code, re.fullmatch(r"`([^`]+)`", weight).group(1)))
  return rows


def _weight_table_loss(code: str):
  """The row's loss of a linear token model: ``per_token`` of ``x`` ``[rows, tokens, 3]``."""

  def loss_fn(params, batch):
    mask = batch["mask"]
    per_token = (batch["x"] @ params["w"] - batch["y"]) ** 2
    per_example = (per_token * mask).sum(1)  # any per-row loss
    names = {"per_token": per_token, "per_example": per_example, "mask": mask, "batch": batch}
    return eval(code, {"jnp": jnp}, names)

  return loss_fn


def _weight_of(code: str, batch) -> float:
  return float(eval(code, {"jnp": jnp}, {"batch": batch, "mask": batch["mask"]}))


def test_readme_weight_table_names_the_three_common_losses():
  assert [name for name, _, _ in _weight_table()] == [
    "per-example mean",
    "masked token mean",
    "row mean of token means",
  ]


@pytest.mark.parametrize(("name", "loss_code", "weight_code"), _weight_table(), ids=lambda v: v)
@pytest.mark.slow
def test_readme_weight_table_row_accumulates_to_the_physical_batch(name, loss_code, weight_code):
  """Issue 49, item 1: each loss of the README's table, accumulated over microbatches of unequal
  rows and tokens with the table's weight, is one step on ``jax.grad`` of the loss over all rows
  at once, and on the same gradient worked by hand in float64; the other count (rows for
  tokens, tokens for rows) is visibly off."""
  rng = np.random.default_rng(49)
  sizes = (2, 5, 3, 6)  # rows per microbatch
  microbatches = []
  for n in sizes:
    mask = (rng.random((n, 4)) < 0.5).astype(np.float32)
    mask[:, 0] = 1  # every row has a token: a row mean of token means is defined
    microbatches.append(
      {
        "x": rng.normal(size=(n, 4, 3)).astype(np.float32),
        "y": rng.normal(size=(n, 4)).astype(np.float32),
        "mask": mask,
      }
    )
  physical = {k: np.concatenate([mb[k] for mb in microbatches]) for k in microbatches[0]}
  loss_fn = _weight_table_loss(loss_code)
  params = {"w": jnp.asarray([0.3, -0.2, 0.1], jnp.float32)}
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=len(sizes))

  def window(weights):
    state, total = tx.init(params), jnp.zeros(3)
    for mb, w in zip(microbatches, weights, strict=True):
      updates, state = tx.update(jax.grad(loss_fn)(params, mb), state, params, weight=w)
      total = total + updates["w"]
    assert int(optax_accum.metrics(state).num_updates) == 1
    return -total  # sgd(1.0): minus the window's gradient

  expected = jax.grad(loss_fn)(params, physical)["w"]
  given = [_weight_of(weight_code, mb) for mb in microbatches]
  got = window(given)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
  # The same gradient in float64, by hand: d/dw of the table's loss of the physical batch.
  x, y, m = (physical[k].astype(np.float64) for k in ("x", "y", "mask"))
  r = x @ np.asarray(params["w"], np.float64) - y  # [rows, tokens]
  d_token = 2 * r[..., None] * x  # d per_token / dw: [rows, tokens, 3]
  by_rows = np.mean((m[..., None] * d_token).sum(1), axis=0)  # mean over rows of each row's sum
  by_tokens = (m[..., None] * d_token).sum((0, 1)) / m.sum()
  row_means = np.mean((m[..., None] * d_token).sum(1) / m.sum(1)[:, None], axis=0)
  by_hand = {"per-example mean": by_rows, "masked token mean": by_tokens}
  by_hand["row mean of token means"] = row_means
  np.testing.assert_allclose(got, by_hand[name], rtol=1e-5, atol=1e-7)

  rows = [mb["x"].shape[0] for mb in microbatches]
  tokens = [float(mb["mask"].sum()) for mb in microbatches]
  assert given in (rows, tokens)
  wrong = window(tokens if given == rows else rows)
  assert np.max(np.abs(wrong - expected)) > 1e-2 * np.max(np.abs(expected)), (wrong, expected)


def test_readme_finiteness_sentence_holds():
  """Issue 49, item 5: the params and the state after a boundary never hold NaN; a NaN gradient
  fed in mid-window sits in the accumulator until the boundary skips the window."""
  text = " ".join(README.read_text().split())
  assert "The params, and the optimizer state after a boundary, never hold NaN" in text
  assert "a NaN or Inf gradient fed in mid-window sits in the accumulator" in text
  assert "the state never holds NaN" not in text
  tx = optax_accum.accumulate(optax.adam(1e-2), every_k=3)
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  grads = [jnp.asarray([1.0, np.nan, 2.0, 0.5]), jnp.ones(4), jnp.full(4, 2.0)]
  for i, g in enumerate(grads):
    params, state = optax_accum.update_and_apply(tx, {"w": g}, state, params, weight=2.0)
    m = optax_accum.metrics(state)
    if i < len(grads) - 1:  # mid-window: the NaN is in the accumulator, nowhere else
      assert int(m.mini_step) == i + 1
      assert np.isnan(np.asarray(state.window.grad_sum["w"])).any()
      assert_state_finite(state.inner_state)
  assert int(m.mini_step) == 0 and int(m.num_skipped) == 1 and int(m.num_updates) == 0
  assert_state_finite(state)  # after the boundary: every float leaf
  np.testing.assert_array_equal(params["w"], np.ones(4))  # the window was skipped
