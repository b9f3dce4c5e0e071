"""Tests of the demo: its training function against hand-built references, and the CLI."""

import json
import re
import subprocess
import sys

import _xla
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from optax_accum.__main__ import main
from optax_accum.demo import console
from optax_accum.demo import train as demo
from optax_accum.demo.data import stdlib_lines
from optax_accum.demo.model import token_loss


def _real_bytes(lines, seq_len):
  """Real target bytes of a line: it is cut to seq_len + 1 bytes, and the first has no target."""
  return [min(len(line), seq_len + 1) - 1 for line in lines]


def _tiny_config(train_lines, **fields):
  """A one-file, one-block demo whose training split is the first ``train_lines`` lines."""
  total = len(stdlib_lines(max_files=1))
  return demo.DemoConfig(
    seq_len=16, dim=8, depth=1, heads=2, max_files=1, eval_lines=total - train_lines, **fields
  )


def _reference(cfg):
  """The demo model's initial params and a jitted ``value_and_grad`` of its token loss."""
  graphdef, params, rest = nnx.split(demo.make_model(cfg), nnx.Param, ...)
  loss = lambda p, b: token_loss(nnx.merge(graphdef, p, rest), b)
  return params, jax.jit(jax.value_and_grad(loss))


def _physical_sgd(params, value_and_grad, mbs, windows, lr):
  """Plain SGD with each window as one physical batch of exactly its microbatches."""
  losses = []
  for w in windows:
    batch = {k: np.concatenate([mbs[i][k] for i in w]) for k in mbs[0]}
    loss, g = value_and_grad(params, batch)
    params = jax.tree.map(lambda x, y: x - lr * y, params, g)
    losses.append(loss)
  return params, losses


@pytest.mark.slow  # about 20 s: compiles the demo's step
def test_train_equals_physical_batches_with_epoch_end_flush():
  # 20 training lines in microbatches of 8: [8, 8, 4 + 4 padding rows]. With every_k=2
  # the windows are [mb0, mb1] and [mb2], the second flushed at the epoch's end.
  cfg = _tiny_config(  # windows of every_k microbatches (no token budget)
    20, microbatch_size=8, every_k=2, tokens_per_update=None, updates=2
  )
  lr = 0.5
  result = demo.train(cfg, out=None, progress=False, check=False, inner=optax.sgd(lr))

  train_lines, _ = demo.split_lines(cfg)
  assert len(train_lines) == 20
  mbs = demo.microbatches(train_lines, cfg.seq_len, cfg.microbatch_size)
  assert [len(mb["mask"]) for mb in mbs] == [8, 8, 8]
  assert result.metrics["num_updates"] == 2
  assert result.metrics["num_microbatches"] == 3
  assert result.metrics["num_skipped"] == 0
  assert result.flushed_windows == 1
  assert result.tokens == sum(_real_bytes(train_lines, cfg.seq_len))

  # Reference: plain SGD on the windows as single physical batches, one jax.grad each.
  params, value_and_grad = _reference(cfg)
  expected, losses = _physical_sgd(params, value_and_grad, mbs, [[0, 1], [2]], lr)
  trained = nnx.state(result.model, nnx.Param)
  chex.assert_trees_all_close(trained, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.losses, losses, rtol=1e-5)

  def sgd(p, g):
    return jax.tree.map(lambda x, y: x - lr * y, p, g)

  # The test can tell: the mean of the two microbatch means gives other params.
  g_mom = jax.tree.map(
    lambda a, b: (a + b) / 2, value_and_grad(params, mbs[0])[1], value_and_grad(params, mbs[1])[1]
  )
  params1_mom = sgd(params, g_mom)
  wrong = sgd(params1_mom, value_and_grad(params1_mom, mbs[2])[1])
  gap = max(jax.tree.leaves(jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), wrong, expected)))
  assert gap > 1e-4


def _budget_windows(counts, budget):
  """The microbatch indices of each window: closed at `budget` tokens or at the epoch's end."""
  windows, current, pending = [], [], 0
  for i, n in enumerate(counts):
    current.append(i)
    pending += n
    if pending >= budget or i == len(counts) - 1:
      windows.append(current)
      current, pending = [], 0
  return windows


@pytest.mark.slow  # about 20 s: compiles the demo's step
def test_token_budget_windows_equal_physical_batches_of_their_microbatches():
  # 28 training lines in 7 microbatches of 4 holding [52, 62, 50, 62, 64, 64, 63] real bytes.
  # A budget of 115 closes windows of 3, 2 and 2 microbatches (164, 126 and 127 bytes);
  # every_k=1 would close 7.
  cfg = _tiny_config(28, microbatch_size=4, every_k=1, tokens_per_update=115, updates=3)
  lr = 0.5
  result = demo.train(cfg, out=None, progress=False, check=False, inner=optax.sgd(lr))

  train_lines, _ = demo.split_lines(cfg)
  mbs = demo.microbatches(train_lines, cfg.seq_len, cfg.microbatch_size)
  counts = [int(mb["mask"].sum()) for mb in mbs]
  windows = _budget_windows(counts, cfg.tokens_per_update)
  assert [len(w) for w in windows] == [3, 2, 2]  # the budget, not every_k, sets the lengths
  assert result.window_tokens.tolist() == [sum(counts[i] for i in w) for w in windows]
  assert result.metrics["num_updates"] == 3 and result.metrics["num_microbatches"] == 7
  assert result.metrics["weight_seen"] == sum(counts) == result.tokens

  # Reference: plain SGD on each window as one physical batch of exactly its microbatches.
  params, losses = _physical_sgd(*_reference(cfg), mbs, windows, lr)
  chex.assert_trees_all_close(nnx.state(result.model, nnx.Param), params, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.losses, losses, rtol=1e-5)


def test_cli_rejects_bad_options_with_the_demo_usage(capsys):
  with pytest.raises(SystemExit) as e:
    main(["demo", "--updates", "0"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("usage: optax-accum demo ")
  assert "optax-accum demo: error: --updates must be >= 1, got 0" in err
  with pytest.raises(SystemExit):
    main([])


def test_cli_help_shows_the_defaults_of_both_configurations(capsys):
  with pytest.raises(SystemExit) as e:
    main(["demo", "--help"])
  assert e.value.code == 0
  # Undo argparse's line wrapping (which also breaks after hyphens).
  text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
  full, quick = demo.DemoConfig(), demo.QUICK
  assert f"lines per microbatch (default: {full.microbatch_size}; {quick.microbatch_size} with" in (
    text
  )
  # The same in both; with the token budget on (the default) --every-k does not close windows.
  assert f"sets only the pre-flight's window (default: {full.every_k})" in text
  assert f"(default: {full.updates}; {quick.updates} with --quick)" in text


def test_cli_top_level_help_is_plain_text_and_version_names_the_versions(capsys):
  import importlib.metadata

  import optax_accum

  with pytest.raises(SystemExit):
    main(["--help"])
  out = capsys.readouterr().out
  assert "demo" in out and "``" not in out and ":func:" not in out
  with pytest.raises(SystemExit) as e:
    main(["--version"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(f"optax-accum {optax_accum.__version__} ")
  assert f"jax {importlib.metadata.version('jax')}" in out


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
@pytest.mark.parametrize("rule", ["seconds", "fraction"])
def test_train_without_a_terminal_prints_the_plan_an_estimate_and_plain_progress_lines(
  monkeypatch, rule
):
  import io

  monkeypatch.setattr(console, "LONG_RUN_SECONDS", 0.0)  # any run is "long": the warning shows
  # "seconds": the timing's seconds are up at once, so the estimate comes at the first window's
  # end; "fraction": they never are, so it comes at the first window's end a tenth into the run.
  monkeypatch.setattr(demo, "TIMING_SECONDS", 0.0 if rule == "seconds" else float("inf"))
  cfg = demo.DemoConfig(
    microbatch_size=4,
    every_k=3,
    tokens_per_update=None,  # windows of every_k microbatches (the timing counts them)
    updates=12,
    seq_len=8,
    dim=8,
    depth=1,
    heads=2,
    max_files=1,
    eval_lines=8,
  )
  buf = io.StringIO()  # not a terminal
  result = demo.train(cfg, out=buf, progress=True, check=False)
  text = buf.getvalue()
  assert "\r" not in text
  (planned,) = _number(r"updates = ([\d,]+) microbatches", text)
  assert planned == result.metrics["num_microbatches"]
  (timed,) = _number(r"timing: (\d+) microbatches in", text)
  # From the end of the first microbatch to a window's end (every every_k microbatches).
  first_end = cfg.every_k
  if rule == "fraction":
    while first_end - 1 < 0.1 * planned:
      first_end += cfg.every_k
  assert timed == first_end - 1
  assert "estimated training time" in text and "warning: a long run" in text
  lines = re.findall(r"^update (\d+)/12: loss", text, flags=re.M)
  assert [int(n) for n in lines] == list(range(1, 13))  # updates // 10 = 1: every update


def _number(pattern, text):
  match = re.search(pattern, text)
  assert match, f"{pattern!r} not found in the demo's output:\n{text}"
  return [float(x.replace(",", "")) for x in match.groups()]


@pytest.mark.slow
def test_quick_demo_runs_and_learns(tmp_path):
  env = _xla.env()  # one CPU device, not conftest's 8 fake ones: as a user runs it
  record_path = tmp_path / "demo.json"
  proc = subprocess.run(
    [sys.executable, "-m", "optax_accum", "demo", "--quick", "--record", str(record_path)],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out

  # Pre-flight on the real text: accumulated == one physical batch, mean of means is not.
  (acc,) = _number(r"accumulated vs physical batch max rel diff = (\S+)", out)
  (mom,) = _number(r"mean-of-means gradient max rel diff = (\S+)", out)
  assert acc < 1e-4
  assert mom > 1e-3 and mom > 100 * acc
  cfg = demo.QUICK
  train_lines, _ = demo.split_lines(cfg)
  window = train_lines[: cfg.every_k * cfg.microbatch_size]
  per_row = np.array(_real_bytes(window, cfg.seq_len)).reshape(cfg.every_k, -1)
  weights = ", ".join(str(int(w)) for w in per_row.sum(axis=1))
  # The weights the loss implies (the fit) are the real bytes, as passed.
  implied = ", ".join(f"{w:.3g}" for w in per_row.sum(axis=1) / per_row.sum())
  assert (
    f"weights: you passed unmasked ['mask'] ({weights}); the loss implies the same: ({implied})"
  ) in out
  assert len(set(per_row.sum(axis=1))) > 1  # microbatches hold different numbers of tokens
  assert "updates applied: 1" in out
  assert "\nPASS: the accumulated window equals one physical batch" in out
  # The record (--record) holds exactly what the demo printed, and its numbers.
  record = json.loads(record_path.read_text())
  assert record["output"] == proc.stdout and record["exit_code"] == 0
  assert record["command"] == "optax-accum demo --quick"
  assert record["summary"]["preflight"]["passed"] is True
  assert record["summary"]["metrics"]["num_updates"] == cfg.updates

  # Training: the plan, an estimate, plain progress lines (no terminal), the loss drops.
  assert "\r" not in out  # no tqdm frames
  (planned,) = _number(r"updates = ([\d,]+) microbatches", out)
  (timed,) = _number(r"timing: (\d+) microbatches in \S+ s; estimated training time", out)
  assert 0 < timed < planned  # a second or a tenth of the run, whichever first, to a window end
  assert len(re.findall(r"^update \d+/\d+: loss", out, flags=re.M)) == 10
  first, last = _number(r"training loss: (\S+) \(update 1\) -> (\S+)", out)
  before, after = _number(r"held-out loss: (\S+) -> (\S+) nats/byte", out)
  assert last < first - 1.0
  assert after < before - 1.0
  updates, skipped, microbatches = _number(
    r"num_updates=(\d+) num_skipped=(\d+) num_microbatches=(\d+)", out
  )
  assert (updates, skipped) == (cfg.updates, 0)
  # Windows close at the token budget and never straddle epochs (each epoch ends with a
  # flushed window): replayed here from the data, independently of the demo's own count.
  lines, rng = list(train_lines), np.random.default_rng(cfg.seed + 1)
  done, per_update = 0, []
  while len(per_update) < cfg.updates:
    counts = [
      int(mb["mask"].sum()) for mb in demo.microbatches(lines, cfg.seq_len, cfg.microbatch_size)
    ]
    windows = _budget_windows(counts, cfg.tokens_per_update)[: cfg.updates - len(per_update)]
    done += windows[-1][-1] + 1
    per_update += [sum(counts[i] for i in w) for w in windows]
    rng.shuffle(lines)
  assert microbatches == done == planned
  low, mean, high = _number(r"tokens per update: min (\d+), mean (\d+), max (\d+)", out)
  assert (low, high) == (min(per_update), max(per_update))
  assert mean == pytest.approx(np.mean(per_update), abs=0.5)


def _stub_training(monkeypatch, effect=None):
  """Replaces the (compiling) memory check and training with stubs; returns the configs trained."""
  from optax_accum.demo import plan

  trained = []

  def train(config, *, out, progress):
    trained.append(config)
    print("trained", file=out)
    if effect is not None:
      raise effect

  monkeypatch.setattr(plan, "check_fits", lambda config: None)
  monkeypatch.setattr(demo, "train", train)
  return trained


def test_ctrl_c_ends_the_demo_with_a_line_not_a_traceback(monkeypatch, capsys):
  _stub_training(monkeypatch, effect=KeyboardInterrupt())
  assert main(["demo", "--quick"]) == 130  # 128 + SIGINT, as a shell reports it
  err = capsys.readouterr().err
  assert err == "\noptax-accum demo: interrupted (Ctrl-C)\n"


def test_every_k_with_the_token_budget_says_it_sets_only_the_preflight(monkeypatch, capsys):
  trained = _stub_training(monkeypatch)
  assert main(["demo", "--quick", "--every-k", "8"]) == 0
  assert main(["demo", "--quick", "--every-k", "8", "--tokens-per-update", "0"]) == 0
  assert main(["demo", "--quick"]) == 0
  out = capsys.readouterr().out
  assert [(c.every_k, c.tokens_per_update) for c in trained] == [
    (8, demo.QUICK.tokens_per_update),
    (8, None),
    (demo.QUICK.every_k, demo.QUICK.tokens_per_update),
  ]
  note = (
    f"note: --every-k 8 sets only the pre-flight's window: windows close at --tokens-per-update "
    f"{demo.QUICK.tokens_per_update} real bytes (add --tokens-per-update 0 for windows of 8 "
    "microbatches)"
  )
  assert out.splitlines() == [note, "trained", "trained", "trained"]


def test_record_writes_the_output_and_the_command(monkeypatch, capsys, tmp_path):
  _stub_training(monkeypatch)
  path = tmp_path / "run.json"
  assert main(["demo", "--quick", "--updates", "3", "--record", str(path)]) == 0
  record = json.loads(path.read_text())
  assert record["output"] == capsys.readouterr().out == "trained\n"
  assert record["command"] == "optax-accum demo --quick --updates 3"
  assert record["machine"]["jax"] == jax.__version__ and record["summary"] is None


def test_a_flax_too_old_for_jax_names_both_versions_and_the_fix(monkeypatch, capsys):
  """flax 0.11.0 with jax 0.9.2 fails to import: the message names both and flax >= 0.12.2
  (pyproject.toml), not the install command that changes nothing."""
  import optax_accum.demo
  from optax_accum.demo import cli

  installed = {"jax": "0.9.2", "flax": "0.11.0", "tqdm": "4.67.1"}
  monkeypatch.setattr(cli, "_version", installed.get)
  # The import fails as it did: the demo's train module cannot be imported.
  monkeypatch.setitem(sys.modules, "optax_accum.demo.train", None)
  monkeypatch.delattr(optax_accum.demo, "train", raising=False)
  with pytest.raises(SystemExit) as e:
    main(["demo", "--quick"])
  assert e.value.code == 1
  err = capsys.readouterr().err
  assert err.startswith(
    "optax-accum demo: flax 0.11.0 is installed but does not run with jax 0.9.2: with jax >= "
    '0.8.2 use flax >= 0.12.2: pip install -U "flax>=0.12.2" (or keep flax 0.11.0 with pip '
    'install "jax<0.8.2")'
  )
  assert "optax_accum.demo.train" in err  # the import error itself

  # Missing packages get the install command; new enough ones get the error itself.
  installed.update(flax=None, tqdm=None)
  assert cli.install_hint(ImportError("x")).startswith(
    "optax-accum demo needs flax and tqdm: pip install"
  )
  installed.update(flax="0.12.8", tqdm="4.67.1", jax="0.10.2")
  assert cli.install_hint(ImportError("boom")) == (
    "optax-accum demo: flax 0.12.8, tqdm 4.67.1 and jax 0.10.2 are installed, but the demo's "
    "imports failed: boom"
  )
  installed.update(flax="0.11.0", jax="0.8.1")  # flax 0.11 runs with jax < 0.8.2
  assert "does not run" not in cli.install_hint(ImportError("boom"))


def test_the_timing_line_goes_above_the_progress_bar_not_into_it(monkeypatch):
  import io

  class Terminal(io.StringIO):  # stdout and stderr on one screen, as in a terminal
    def isatty(self):
      return True

  screen = Terminal()
  monkeypatch.setattr(sys, "stdout", screen)
  monkeypatch.setattr(sys, "stderr", screen)
  cfg = demo.DemoConfig(updates=10)
  shown = console.Progress(screen, cfg, progress=True)
  assert not shown.bar.disable  # the bar is on
  shown.bar.update(3)
  shown.bar.refresh()
  console.estimate(shown.write, 1.0, (0.0, 0), 5, 50)
  shown.bar.close()
  text = screen.getvalue()
  before, line, after = text.partition("timing: 5 microbatches in")
  assert line and "3/10" in before and "3/10" in after  # the bar, drawn again below the line
  # The bar was cleared (carriage return, no bar text) right before the line started.
  assert before.endswith("\r") and before.rstrip("\r ").endswith(("]", "\r"))


def test_cli_adaptive_needs_a_token_budget(capsys):
  with pytest.raises(SystemExit) as e:
    main(["demo", "--adaptive", "--tokens-per-update", "0"])
  assert e.value.code == 2
  assert "--adaptive sizes windows in tokens: give --tokens-per-update" in capsys.readouterr().err


@pytest.mark.slow  # about 10 s: compiles the demo's step
def test_adaptive_windows_grow_and_each_equals_a_physical_batch_at_its_scaled_lr():
  """--adaptive (issue 40): the windows grow past the smallest budget as B_simple is measured;
  each update is plain SGD on its window as one physical batch, at the learning rate times
  sqrt(window tokens / tokens_per_update)."""
  cfg = _tiny_config(
    28, microbatch_size=2, every_k=1, tokens_per_update=40, updates=40, adaptive=True
  )
  lr = 0.5
  result = demo.train(cfg, out=None, progress=False, check=False, inner=optax.sgd(lr))
  # The stream as the loop reads it: epochs of the training lines, reshuffled after each.
  train_lines, _ = demo.split_lines(cfg)
  rng, mbs = np.random.default_rng(cfg.seed + 1), []
  while len(mbs) < result.metrics["num_microbatches"]:
    mbs += demo.microbatches(train_lines, cfg.seq_len, cfg.microbatch_size)
    rng.shuffle(train_lines)
  counts = [int(mb["mask"].sum()) for mb in mbs]
  windows, start = [], 0
  for tokens in result.window_tokens.tolist():  # consecutive microbatches holding these tokens
    end = start + 1
    while sum(counts[start:end]) < tokens:
      end += 1
    assert sum(counts[start:end]) == tokens
    windows.append(range(start, end))
    start = end
  assert start == result.metrics["num_microbatches"] and len(windows) == 40
  # At the smallest budget a window holds < 40 + one microbatch's tokens; later ones hold more.
  assert max(result.window_tokens) > 40 + max(counts) and result.metrics["window_budget"] > 40
  params, value_and_grad = _reference(cfg)
  for w in windows:
    batch = {k: np.concatenate([mbs[i][k] for i in w]) for k in mbs[0]}
    _, g = value_and_grad(params, batch)
    step = lr * np.sqrt(sum(counts[i] for i in w) / 40)
    params = jax.tree.map(lambda x, y, step=step: x - step * y, params, g)
  # float32 rounding grows over 40 steps of SGD at lr up to 0.9 (1e-6 after 12 updates, 5e-5
  # after 40); the learning rate without its scaling would be off by up to 1.8x.
  got = nnx.state(result.model, nnx.Param)
  chex.assert_trees_all_close(got, params, rtol=1e-4, atol=2e-4)
