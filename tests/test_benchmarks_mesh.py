"""Smoke test: benchmarks/train_step.py --quick --devices 8 writes the rows it promises."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
REDUCTIONS = ("all-reduce", "reduce-scatter")


def reductions(row, where):
  return sum(row["collectives"][where].get(op, 0) for op in REDUCTIONS)


@pytest.mark.slow
def test_train_step_mesh_rows(tmp_path):
  out = tmp_path / "train.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)  # the script sets its 8 fake devices itself
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
  # The same window from the same params: the same token-weighted loss on every path.
  losses = [v["first_window_loss"] for v in [*rows.values(), *report["variants"].values()]]
  assert max(losses) - min(losses) < 1e-5 * abs(losses[0])
