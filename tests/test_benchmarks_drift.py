"""benchmarks/float32_drift.py (issue 49, item 4): an accumulated run drifts from the physical run
only as far as optax.MultiSteps' does; the docs' drift table is the committed JSON, and its
float32 row is what this test measures again."""

import json
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("flax")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import float32_drift  # noqa: E402
import render_tables  # noqa: E402

RECORDED = json.loads(render_tables.DRIFT_JSON.read_text())


def _rounding(loss: float) -> float:
  """A few float32 steps of a loss of this size: the float32 row's allowance."""
  return 8 * float(np.spacing(np.float32(loss)))


def _run(dtype: str) -> dict:
  (run,) = [r for r in RECORDED["runs"] if r["config"]["compute_dtype"] == dtype]
  return run


def test_the_recorded_runs_say_what_the_porting_guide_says():
  """docs/porting.md's reading of its table, checked against the JSON the table renders."""
  assert [r["config"]["compute_dtype"] for r in RECORDED["runs"]] == ["float32", "bfloat16"]
  f32, bf16 = _run("float32"), _run("bfloat16")
  for name in ("adam", "sgd"):
    gap32, gap16 = f32["results"][name]["gap"], bf16["results"][name]["gap"]
    loss = f32["results"][name]["physical_loss"][-1]
    # float32: within a few float32 steps of the loss, accumulate and MultiSteps alike.
    assert max(gap32.values()) <= _rounding(loss), (name, gap32)
    # bfloat16 compute: orders of magnitude larger, and accumulate within a factor of MultiSteps.
    assert min(gap16.values()) > 100 * max(gap32.values()), (name, gap16, gap32)
    assert 1 / 3 < gap16["accumulate"] / gap16["multisteps"] < 3, (name, gap16)
  # SGD is no cleaner control at these learning rates: its gap is not below Adam's.
  for run in RECORDED["runs"]:
    adam, sgd = run["results"]["adam"]["gap"], run["results"]["sgd"]["gap"]
    assert sgd["accumulate"] >= adam["accumulate"] / 2, run["config"]["compute_dtype"]


@pytest.mark.slow  # two optimizers, three runs each, 30 updates: about 25 s on 2 cores
def test_float32_row_is_measured_again_and_matches_multisteps():
  recorded = _run("float32")
  c = recorded["config"]
  live = float32_drift.drift(
    c["updates"], c["every_k"], c["microbatch_size"], seed=c["seed"], compute_dtype="float32"
  )
  assert live["config"] == c  # the same model, data and sizes as the docs' row
  for name, res in live["results"].items():
    rounding = _rounding(res["physical_loss"][-1])
    # The runs train: the physical run's held-out loss falls, in the recorded way.
    assert res["physical_loss"][-1] < res["physical_loss"][0] - 1.0
    np.testing.assert_allclose(res["physical_loss"], recorded["results"][name]["physical_loss"],
                               atol=1e-4)  # fmt: skip
    gap = res["gap"]
    assert gap["accumulate"] <= max(3 * gap["multisteps"], rounding), (name, gap)
    assert max(gap.values()) <= rounding, (name, gap)
    for run, value in gap.items():  # the docs' number, within float32's own steps
      assert abs(value - recorded["results"][name]["gap"][run]) <= rounding, (name, run, value)


@pytest.mark.slow  # compiles the three runs of both optimizers: about 10 s
def test_quick_run_writes_the_report_the_table_renders(tmp_path):
  out = tmp_path / "drift.json"
  float32_drift.main(["--quick", "--dtypes", "float32", "--out", str(out)])
  report = json.loads(out.read_text())
  assert report["benchmark"] == "float32_drift" and report["machine"]["jax"]
  (run,) = report["runs"]
  assert run["config"]["updates"] == 3 and set(run["results"]) == {"adam", "sgd"}
  assert all(len(r["physical_loss"]) == 3 for r in run["results"].values())
  assert "| float32 |" in render_tables.render_drift(report)
