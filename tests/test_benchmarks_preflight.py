"""benchmarks/preflight.py runs with --quick and writes the JSON that docs/in_step.md renders."""

import json
import pathlib
import subprocess
import sys

import _xla
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import render_tables  # noqa: E402


@pytest.mark.slow
def test_quick_preflight_benchmark(tmp_path):
  out = tmp_path / "preflight.json"
  env = _xla.env()  # one CPU device, as a user would run it
  cmd = [sys.executable, str(ROOT / "benchmarks" / "preflight.py"), "--quick", "--out", str(out)]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["benchmark"] == "preflight" and report["machine"]["jax"]
  (res,) = report["results"]
  assert res["num_microbatches"] == 4 and res["num_params"] >= 2**18 - 512
  assert set(res["ms"]) == {"gram", "solve", "residuals", "allowance"}
  assert all(0 < ms < 1e5 for ms in res["ms"].values())
  parts = res["ms"]["gram"] + res["ms"]["solve"] + res["ms"]["residuals"]
  assert abs(res["fit_ms"] - parts) < 1e-9 * parts
  assert abs(res["fit_over_check"] - res["fit_ms"] / (1e3 * res["check_equivalence_s"])) < 1e-12
  # A mean over rows: the check passes and the fit finds equal weights at float32 rounding.
  assert res["passed"] and res["loss_weights_residual"] < 1e-5
  assert max(abs(w - 0.25) for w in res["loss_weights"]) < 1e-5
  render_tables.render_preflight(report)  # the quick report renders too
