"""Smoke test: ``benchmarks/memory.py --quick`` runs and reports sensible JSON."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_memory_benchmark_quick(tmp_path):
  out = tmp_path / "memory.json"
  subprocess.run(
    [sys.executable, os.path.join(ROOT, "benchmarks", "memory.py"), "--quick", "--out", str(out)],
    check=True,
    cwd=ROOT,
    timeout=600,
    capture_output=True,
  )
  report = json.loads(out.read_text())
  k = report["config"]["num_microbatches"]
  steps = report["steps"]
  assert set(steps) == {"physical", "in_step", "across_step", "in_step_scaled"}
  for step in steps.values():
    assert set(step) == {
      "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "compile_seconds"
    }  # fmt: skip
    assert all(v >= 0 for v in step.values())
  # Params and optimizer state are donated: aliased outputs.
  assert steps["physical"]["alias_bytes"] >= report["grad_bytes"]
  # The in-step scan keeps one microbatch of activations alive, not the whole batch.
  phys, in_step = steps["physical"]["temp_bytes"], steps["in_step"]["temp_bytes"]
  assert in_step < phys
  assert in_step <= phys / k + 3 * report["grad_bytes"]
  ratios = report["ratios"]
  assert abs(ratios["in_step_temp_vs_physical"] - in_step / phys) < 1e-9
  # every_k=1 keeps no accumulator: Adam's state plus a few scalars; every_k=K one accumulator.
  state = report["state_bytes"]
  assert 0 < state["accumulate_k1_loss_scale"] - state["adam"] < 256
  assert state["accumulate_k"] - state["adam"] - report["grad_bytes"] < 256
