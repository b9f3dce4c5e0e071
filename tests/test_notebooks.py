"""Every notebook in notebooks/ runs top to bottom on CPU in SMOKE mode.

The kernel is this interpreter (a temporary kernelspec pointing at
``sys.executable``), so the notebooks use the package and venv under test; a
failing cell fails the test. 8 fake CPU devices exercise the sharded paths.
"""

import json
import pathlib
import sys

import _xla
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
KERNEL = "optax-accum-tests"


def test_there_are_notebooks():
  assert [p.stem for p in NOTEBOOKS][:4] == [
    "01_quickstart",
    "02_flax_nnx_language_model",
    "03_mixed_precision",
    "04_tpu_scaling",
  ]


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
  spec_dir = tmp_path / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  spec = {
    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
    "display_name": "optax_accum tests",
    "language": "python",
  }
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))  # searched before user/system paths
  monkeypatch.setenv("OPTAX_ACCUM_SMOKE", "1")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("XLA_FLAGS", _xla.flags(8))
  monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_smoke_mode(path, kernel_env):
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb,
    kernel_name=KERNEL,
    timeout=600,
    resources={"metadata": {"path": str(path.parent)}},
  )
  client.execute()  # raises CellExecutionError on the first failing cell
  first_code = next(c for c in nb.cells if c.cell_type == "code")
  assert "google.colab" in first_code.source and "%pip install" in first_code.source
  assert "colab.research.google.com/github/optax-accum/optax_accum/blob/main/notebooks/" + (
    path.name
  ) in "".join(c.source for c in nb.cells if c.cell_type == "markdown")
  outputs = "".join(
    o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
  )
  assert "SMOKE=True" in outputs and "devices=8" in outputs


def test_notebook_accelerator_matches_its_subject():
  # Colab opens a notebook on the accelerator its metadata names: fp16 loss scaling is for GPUs.
  expected = {"03_mixed_precision": "GPU", "04_tpu_scaling": "TPU"}
  for path in NOTEBOOKS:
    if path.stem in expected:
      assert json.loads(path.read_text())["metadata"]["accelerator"] == expected[path.stem], path
