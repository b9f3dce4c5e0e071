"""Smoke test: benchmarks/train_step.py --quick --devices 8 writes the rows it promises.

Also: benchmarks/hsdp_device.py (the HSDP rows on real accelerators) answers --help and
--dry-run.
"""

import json
import pathlib
import subprocess
import sys

import _compat
import _xla
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
REDUCTIONS = ("all-reduce", "reduce-scatter")


def reductions(row, where):
  return sum(row["collectives"][where].get(op, 0) for op in REDUCTIONS)


@pytest.mark.slow
def test_train_step_mesh_rows(tmp_path):
  out = tmp_path / "train.json"
  env = _xla.env()  # one device: the script sets its 8 fake devices itself
  cmd = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--quick", "--devices", "8"]
  proc = subprocess.run(
    [*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, timeout=900
  )
  assert proc.returncode == 0, proc.stderr.decode()[-3000:]
  report = json.loads(out.read_text())
  # The single-device rows (one run of the script serves both checks).
  assert report["benchmark"] == "train_step"
  assert {"physical", "across_step"} <= set(report["variants"])
  assert "in_step" in report["variants"] or report["skipped"]
  for v in report["variants"].values():
    assert v["window_ms"] > 0 and v["temp_bytes"] >= 0
  mesh = report["mesh"]
  assert mesh["devices"] == 8
  rows = mesh["variants"]
  k = report["args"]["every_k"]
  assert set(rows) == {
    "physical",
    "across_step_shard_map",
    "across_step_shard_map_zero1",
    "in_step_jit_per_microbatch",
    "in_step_jit",
    "in_step_shard_map",
  }
  # Before: the compiler reduces in the scan body, every microbatch.
  assert reductions(rows["in_step_jit_per_microbatch"], "in_loop") >= 1
  # After: nothing in the loop body, the reduction once after it.
  for name in ("in_step_jit", "in_step_shard_map"):
    assert reductions(rows[name], "in_loop") == 0, rows[name]
    assert reductions(rows[name], "outside") >= 1, rows[name]
    before = rows["in_step_jit_per_microbatch"]["collectives_per_window"]
    assert rows[name]["collectives_per_window"] < before
  # Across-step: nothing between boundaries, one all-reduce in the boundary branch.
  across = rows["across_step_shard_map"]["collectives"]
  assert across["outside"] == {} and across["in_conditional"] == {"all-reduce": 1}
  assert rows["across_step_shard_map"]["collectives_per_window"] == 1
  assert rows["in_step_jit_per_microbatch"]["collectives_per_window"] >= k
  # ZeRO-1 (issue 39): a reduce-scatter and an all-gather at the boundary, the ring bytes of the
  # all-reduce (within 1%), 1/8 of the inner state per device (plus padding and Adam's count).
  zero = rows["across_step_shard_map_zero1"]
  boundary = zero["collectives"]["in_conditional"]
  assert (boundary["reduce-scatter"], boundary["all-gather"]) == (1, 1)
  assert zero["collectives"]["outside"] == {}
  replicated = rows["across_step_shard_map"]
  ratio = zero["ring_bytes_per_window"] / replicated["ring_bytes_per_window"]
  assert abs(ratio - 1) < 0.01, ratio
  per_device = zero["inner_state_bytes_per_device"] / replicated["inner_state_bytes_per_device"]
  assert 1 / 8 <= per_device < 1 / 8 + 0.01, per_device
  # HSDP: replica 2 x fsdp 4.
  hsdp = report["hsdp"]
  assert hsdp["mesh"] == {"replica": 2, "fsdp": 4}
  h = hsdp["variants"]
  assert set(h) == {"physical", "across_step_jit", "across_step_shard_map", "in_step"}
  spans = lambda row, axis: sum(
    n for a, n in row["collectives_per_window_by_axis"].items() if axis in a.split("+")
  )
  # Before: plain jit reduces over replica on every microstep (w's shard, and the rest).
  before = h["across_step_jit"]
  assert before["calls_per_window"] == k
  assert before["collectives"]["outside"].get("all-reduce replica", 0) >= 1
  assert spans(before, "replica") >= k
  # After: nothing over replica between boundaries, one all-reduce (combined) in the boundary.
  after = h["across_step_shard_map"]
  for where in ("outside", "in_loop"):
    assert not [key for key in after["collectives"][where] if "replica" in key], after
  replica = {
    key: n for key, n in after["collectives"]["in_conditional"].items() if "replica" in key
  }
  assert list(replica) == ["all-reduce replica"], after
  if _compat.all_reduces_per_psum(2) == 1:  # JAX 0.7 does not combine them
    assert replica["all-reduce replica"] == 1
    assert spans(after, "replica") == 1
  assert after["collectives_per_window_by_axis"]["fsdp"] >= k  # fsdp: every microbatch
  assert 0 < after["replica_bytes_per_window"] < before["replica_bytes_per_window"]
  # In-step: the reductions over replica once per step, after the scan.
  inst = h["in_step"]
  assert inst["collectives"]["outside"].get("all-reduce replica", 0) >= 1
  reductions_in_loop = [
    key for key in inst["collectives"]["in_loop"] if key.split()[0] in REDUCTIONS
  ]
  assert not [key for key in reductions_in_loop if "replica" in key], inst
  # The same window from the same params: the same token-weighted loss on every path.
  every = [*rows.values(), *report["variants"].values(), *h.values()]
  losses = [v["first_window_loss"] for v in every]
  assert max(losses) - min(losses) < 1e-5 * abs(losses[0])


def test_hsdp_device_script_answers_help():
  cmd = [sys.executable, str(ROOT / "benchmarks" / "hsdp_device.py"), "--help"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert "--dry-run" in proc.stdout and "--replica" in proc.stdout


@pytest.mark.slow
def test_hsdp_device_script_dry_run_plans_the_mesh():
  env = _xla.env(8)
  cmd = [sys.executable, str(ROOT / "benchmarks" / "hsdp_device.py"), "--dry-run"]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  plan = json.loads(proc.stdout)
  assert plan["devices"] == 8 and plan["processes"] == 1
  assert plan["mesh"] == {"replica": 2, "fsdp": 4}
