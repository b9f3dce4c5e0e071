"""Benchmark scripts run with --quick and write the JSON they promise; README tables match it."""

import json
import pathlib
import subprocess
import sys

import _xla
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import microstep  # noqa: E402
import render_tables  # noqa: E402


def test_readme_table_is_rendered_from_the_json():
  """README.md's (and the docs') performance tables are exactly what the committed JSON renders
  to."""
  for path, markers, table in render_tables.tables():
    assert render_tables.block(path.read_text(), markers) == table, (path.name, markers[0])
  assert "benchmarks/results/microstep.json" in (ROOT / "docs" / "performance.md").read_text()


def _start(script, out):
  env = _xla.env()  # one CPU device, as a user would run it
  cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out)]
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_quick_benchmarks(tmp_path):
  """microstep.py --quick (train_step.py --quick runs in tests/test_benchmarks_mesh.py)."""
  micro_out = tmp_path / "micro.json"
  _, err = (proc := _start("microstep.py", micro_out)).communicate(timeout=600)
  assert proc.returncode == 0, err.decode()[-3000:]

  micro = json.loads(micro_out.read_text())
  assert micro["benchmark"] == "microstep" and micro["machine"]["jax"]
  (res,) = micro["results"]
  assert res["every_k"] == 4 and res["inner"] == "adam"
  assert set(res["variants"]) == set(dict(render_tables.ROWS))
  k = res["every_k"]
  for v in res["variants"].values():
    assert 0 < v["non_boundary_ms"] < 1e4 and 0 < v["boundary_ms"] < 1e4
    expect = ((k - 1) * v["non_boundary_ms"] + v["boundary_ms"]) / k
    assert abs(v["window_avg_ms"] - expect) < 1e-9 * expect
    assert {"argument_bytes", "output_bytes", "alias_bytes", "param_sized_copies"} <= set(v)
  assert set(res["ratios"]) >= {key for key, _, _ in render_tables.GOALS}
  # Structural facts that do not depend on timing noise: the accumulate state is the
  # inner state + one accumulator + scalars (< 160 bytes); the fused steps compile no
  # parameter-sized copy; the default path's only ones are the boundary's copy of the
  # updates into the accumulator (one per leaf); its temporaries are the plain step's
  # plus at most one gradient-sized buffer (the boundary's updates).
  # The plain configuration's 14 scalars: 5 int32 (mini_step, num_microbatches,
  # num_updates, num_skipped, every_k), 5 float32 (the window's weight, value and value
  # weight sums, window_loss, grad_norm) and 4 bools (updated, has_window_loss,
  # has_grad_norm, flush_pending): 44 bytes (optional features off).
  assert 0 < res["ratios"]["state_extra_bytes_over_inner_plus_acc"] < 64
  leaves = len(microstep.make_params(2**18))
  fused = ("accumulate_fused", "accumulate_fused_noise", "accumulate_fused_guard")
  for name in (*fused, "nnx_optimizer", "train_state"):
    assert res["variants"][name]["param_sized_copies"] == 0, name
  for name in ("accumulate", "accumulate_noise"):
    assert res["variants"][name]["param_sized_copies"] <= leaves, name
  assert res["variants"]["multisteps"]["param_sized_copies"] > 0
  assert res["ratios"]["temp_minus_plain_in_grad_buffers"] <= 1.01
  assert res["ratios"]["temp_fused_minus_plain_in_grad_buffers"] <= 0.5
  render_tables.render(micro)  # the quick report renders too


@pytest.mark.slow
def test_quick_eager_benchmark(tmp_path):
  """eager.py --quick: every entry point timed, ratios against adam from the same run."""
  out = tmp_path / "eager.json"
  _, err = (proc := _start("eager.py", out)).communicate(timeout=600)
  assert proc.returncode == 0, err.decode()[-3000:]
  report = json.loads(out.read_text())
  (res,) = report["results"]
  assert set(res["ms"]) == {key for key, _ in render_tables.EAGER_ROWS}
  for name, ms in res["ms"].items():
    assert 0 < ms < 1e5 and abs(res["over_adam"][name] - ms / res["ms"]["adam"]) < 1e-9
  render_tables.render_eager(report)  # the quick report renders too


@pytest.mark.slow
def test_quick_compile_benchmark(tmp_path):
  """compile.py --quick: every variant of each model timed in its own process, the ratios from the
  same run, the fusion counts of tests/_hlo.py."""
  out = tmp_path / "compile.json"
  _, err = (proc := _start("compile.py", out)).communicate(timeout=600)
  assert proc.returncode == 0, err.decode()[-3000:]
  report = json.loads(out.read_text())
  assert report["benchmark"] == "compile" and report["machine"]["jax"] and report["date"]
  (leaves,) = report["results"]  # --quick: no transformer (six processes, not twelve, in CI)
  assert (leaves["model"], leaves["leaves"]) == ("leaves", 16)
  for res in (leaves,):
    v = res["variants"]
    assert set(v) == {key for key, _ in render_tables.COMPILE_ROWS}
    for row in v.values():
      assert row["repeats"] == 1 and 0 < row["fusions"] and 0 < row["distinct_fusions"]
      assert row["distinct_fusions"] <= row["fusions"]
      for phase in ("trace", "lower", "compile"):
        assert 0 < row[f"{phase}_s"] < 600 and row[f"{phase}_samples_s"] == [row[f"{phase}_s"]]
    r = res["ratios"]
    for name, ref in [("accumulate", "multisteps"), ("all_features", "multisteps_clip")]:
      assert (
        abs(r[f"{name}_over_{ref}"]["compile"] - v[name]["compile_s"] / v[ref]["compile_s"]) < 1e-9
      )
    extra = {name: v[name]["compile_s"] - v["adam"]["compile_s"] for name in v if name != "adam"}
    assert r["extra_compile_over_adam_s"] == pytest.approx(extra, abs=1e-12)
  # A plain adam step on equal leaves: its kernels do not depend on the number of leaves.
  assert leaves["variants"]["adam"]["distinct_fusions"] < leaves["leaves"]
  render_tables.render_compile(report)  # the quick report renders too
  render_tables.render_compile_summary(report)
