"""benchmarks/adaptive_windows.py --quick writes the JSON and the plot it promises (issue 40)."""

import json
import math
import pathlib
import subprocess
import sys

import _xla
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import render_tables  # noqa: E402


@pytest.mark.slow  # about 30 s: four short training runs of the demo's smallest model
def test_quick_adaptive_windows_benchmark(tmp_path):
  out = tmp_path / "adaptive.json"
  env = _xla.env()  # one CPU device, as a user would run it
  cmd = [sys.executable, str(ROOT / "benchmarks" / "adaptive_windows.py"), "--quick", "--out"]
  proc = subprocess.run([*cmd, str(out)], cwd=ROOT, env=env, capture_output=True, timeout=600)
  assert proc.returncode == 0, proc.stderr.decode()[-3000:]
  report = json.loads(out.read_text())
  runs, summary, s = report["runs"], report["summary"], report["setting"]
  assert report["benchmark"] == "adaptive_windows" and report["machine"]["jax"]
  assert list(runs) == ["adaptive", "adaptive_same_lr", "fixed", "fixed_mean"]
  adaptive = runs["adaptive"]
  low, high = s["min_tokens"], s["min_tokens"] * s["range"]
  for arm, r in runs.items():
    curve, w = r["curve"], r["windows"]
    assert [p["tokens"] for p in curve] == sorted({p["tokens"] for p in curve}), arm
    assert curve[-1]["tokens"] == r["tokens"] == w["tokens"][-1] == sum(w["weight"]), arm
    assert curve[-1]["updates"] == r["updates"] == len(w["weight"]), arm
    assert all(math.isfinite(p["eval_loss"]) for p in curve), arm
    assert r["eval_loss"] < curve[0]["eval_loss"], arm  # it learned
    budgets = w["budget"] if r["budget"] is None else [r["budget"]] * len(w["weight"])
    assert all(low <= b <= high for b in budgets), arm
    # Every window reaches the budget it closed at (the one before its close's update).
    assert all(x >= b for x, b in zip(w["weight"], [low, *budgets[:-1]], strict=True)), arm
  for arm in ("fixed", "fixed_mean"):  # the fixed arms run to the adaptive arm's tokens
    assert runs[arm]["tokens"] >= adaptive["tokens"] > runs[arm]["tokens"] - runs[arm]["budget"]
  assert runs["fixed"]["budget"] == low
  assert runs["fixed_mean"]["budget"] == round(adaptive["tokens"] / adaptive["updates"])
  at = summary["eval_loss_at_equal_updates"]
  assert at["updates"] == adaptive["updates"] and at["adaptive"] == adaptive["eval_loss"]
  (fixed_at,) = [p["eval_loss"] for p in runs["fixed"]["curve"] if p["updates"] == at["updates"]]
  assert at["fixed"] == fixed_at
  assert summary["eval_loss_at_equal_tokens"] == {a: r["eval_loss"] for a, r in runs.items()}
  assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  render_tables.render_adaptive(report)  # the quick report renders too
