"""The README's commands and links hold, and its Python blocks run in order as written.

The blocks run top to bottom in one fresh interpreter (8 fake CPU devices,
warnings as errors), exactly as a reader would paste them; after some blocks a
check recomputes what the block claims another way (full-batch ``jax.grad``
and plain optax).
"""

import re

import pytest
from _markdown import ROOT, python_blocks, run_blocks

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
