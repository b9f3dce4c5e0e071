"""Installing never replaces the jax/jaxlib a user already has (an accelerator build, say).

``pip install --dry-run --report`` resolves this checkout's requirements against the
environment the tests run in (CI runs it on the newest and on the oldest supported
stack) and lists what it would install: neither jax nor jaxlib, nor flax with the
``flax`` extra. Each notebook's Colab cell installs exactly this package, so the same
resolution covers it.
"""

import json
import pathlib
import re
import subprocess
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEPT = {"jax", "jaxlib", "flax", "optax", "numpy"}  # what a prepared environment already has


def _would_install(requirement: str, tmp_path: pathlib.Path) -> dict[str, str]:
  report = tmp_path / "report.json"
  cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report)]
  result = subprocess.run([*cmd, requirement], cwd=ROOT, capture_output=True, text=True)
  if result.returncode != 0 and "No matching distribution" in result.stderr + result.stdout:
    pytest.skip(f"no package index reachable: {result.stderr[-300:]}")
  assert result.returncode == 0, result.stderr[-3000:]
  items = json.loads(report.read_text())["install"]
  return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}


@pytest.mark.slow  # CI's full run; the fast suite's 5 minutes
@pytest.mark.parametrize("extra", ["", "[flax]"])
def test_install_keeps_jax_jaxlib_and_flax(extra, tmp_path):
  installed = {name: _version(name) for name in KEPT}
  plan = _would_install(f".{extra}", tmp_path)
  assert "optax_accum" in plan or "optax-accum" in plan
  changed = {n: (installed[n], plan[n]) for n in KEPT & plan.keys()}
  assert not changed, f"pip would replace {changed} (installed -> new)"


def _version(name: str) -> str:
  from importlib import metadata

  return metadata.version(name)


def test_notebook_install_cells_install_only_this_package():
  """Colab cells ask for optax_accum[flax] alone: no jax pin, no --upgrade, no other package."""
  for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    first = next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    commands = re.findall(r"%pip install (.+)", first.source)
    assert commands == [
      '-q "optax_accum[flax] @ git+https://github.com/optax-accum/optax_accum"'
    ], (
      path.name,
      commands,
    )
