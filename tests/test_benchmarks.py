"""Smoke test: the benchmark scripts run with --quick and write the JSON they promise."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _start(script, out):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)  # one CPU device, as a user would run it
  cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out)]
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_quick_benchmarks(tmp_path):
  micro_out, train_out = tmp_path / "micro.json", tmp_path / "train.json"
  procs = [_start("microstep.py", micro_out), _start("train_step.py", train_out)]
  for proc in procs:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err.decode()[-3000:]

  micro = json.loads(micro_out.read_text())
  assert micro["benchmark"] == "microstep" and micro["machine"]["jax"]
  (res,) = micro["results"]
  assert res["every_k"] == 4 and res["inner"] == "adam"
  assert set(res["variants"]) == {
    "floor",
    "plain",
    "multisteps",
    "accumulate",
    "accumulate_gated",
    "accumulate_fused",
  }
  for v in res["variants"].values():
    for key in ("non_boundary_ms", "boundary_ms", "window_avg_ms", "all_ms", "temp_bytes"):
      assert v[key] >= 0, key
    assert {"argument_bytes", "output_bytes", "alias_bytes", "param_sized_copies"} <= set(v)
  assert set(res["ratios"]) >= {
    "non_boundary_gated_over_floor",
    "boundary_gated_over_plain_plus_floor",
    "window_avg_gated_over_multisteps",
    "non_boundary_fused_over_floor",
    "boundary_fused_over_plain_plus_floor",
    "window_avg_fused_over_multisteps",
  }
  # Structural facts that do not depend on timing noise: the accumulate state is the
  # inner state + one accumulator + scalars (< 100 bytes), and the gated step compiles
  # without parameter-sized copies.
  assert 0 <= res["ratios"]["state_extra_bytes_over_inner_plus_acc"] < 100
  assert res["variants"]["accumulate_gated"]["param_sized_copies"] == 0
  assert res["variants"]["accumulate_fused"]["param_sized_copies"] == 0

  train = json.loads(train_out.read_text())
  assert train["benchmark"] == "train_step"
  assert {"physical", "across_step"} <= set(train["variants"])
  assert "in_step" in train["variants"] or train["skipped"]
  losses = [v["first_window_loss"] for v in train["variants"].values()]
  # The same first window from the same params: the same token-weighted loss.
  assert max(losses) - min(losses) < 1e-2 * abs(losses[0])
  for v in train["variants"].values():
    assert v["window_ms"] > 0 and v["temp_bytes"] >= 0
