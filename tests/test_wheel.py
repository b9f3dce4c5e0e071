"""The package a user installs: the sdist and wheel ``python -m build`` makes, their metadata
(``twine check``), and the wheel installed (not this checkout) in a fresh virtual environment.

First with its own requirements only (jax and optax: ``import optax_accum`` and the README's first
example run, Flax is absent and ``optax_accum.flax`` says how to install it), then with the
``flax`` extra added (every module of the installed package imports, and the ``optax-accum``
command answers; tests/test_demo.py runs the demo itself). The environment has no access to the
system's or this test's packages; pip resolves the wheel's requirements under the same
constraints as the test run (``PIP_CONSTRAINT``) and takes them from its cache when it can.
"""

import email
import os
import re
import shutil
import subprocess
import sys
import zipfile

import _xla
import pytest
from _markdown import ROOT, python_blocks

VERSION = re.search(
  r'^__version__ = "(.+?)"', (ROOT / "optax_accum/__init__.py").read_text(), re.M
)[1]


def _run(cmd, what, **kwargs):
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
  assert proc.returncode == 0, (
    f"{what} failed ({' '.join(map(str, cmd))}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
  )
  return proc.stdout + proc.stderr


def _checkout_copy(dest):
  """The files git would commit (tracked, and untracked but not ignored): no build leftovers."""
  listed = _run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    "git ls-files",
    cwd=ROOT,
  )
  for name in filter(None, listed.split("\0")):
    src = ROOT / name
    if src.is_file() or src.is_symlink():
      (dest / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, dest / name, follow_symlinks=False)
  return dest


def _check_wheel_contents(wheel):
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    info = f"optax_accum-{VERSION}.dist-info"
    meta = email.message_from_string(z.read(f"{info}/METADATA").decode())
    entry_points = z.read(f"{info}/entry_points.txt").decode()
  stray = [n for n in names if not n.startswith(("optax_accum/", info))]
  assert not stray, f"the wheel ships files outside the package: {stray}"
  assert "optax_accum/py.typed" in names and "optax_accum/demo/cli.py" in names
  assert meta["Version"] == VERSION and meta["License-Expression"] == "Apache-2.0"
  requires = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
  assert sorted(requires) == ["jax>=0.7", "optax>=0.2.5"], requires  # never jaxlib (README)
  assert {"flax", "docs", "test"} <= set(meta.get_all("Provides-Extra"))
  assert "optax-accum = optax_accum.demo.cli:main" in entry_points


# The fresh environment with jax and optax only: the wheel is what imports, and Flax is absent.
JAX_ONLY = """
import importlib.util, sys
import optax_accum
assert optax_accum.__file__.startswith(sys.prefix), optax_accum.__file__  # the wheel
assert importlib.util.find_spec("flax") is None
try:
  import optax_accum.flax
except ModuleNotFoundError as e:
  assert 'pip install "optax_accum[flax]"' in str(e), e
else:
  raise AssertionError("optax_accum.flax imported without Flax")
"""


# With the flax extra: every module the wheel ships imports (a module missing from the package,
# or one importing what the wheel does not require, fails here), and the command's entry point runs.
ALL_MODULES = """
import importlib, pkgutil
import optax_accum
names = [m.name for m in pkgutil.walk_packages(optax_accum.__path__, "optax_accum.")]
for name in names:
  importlib.import_module(name)
assert "optax_accum.flax" in names and "optax_accum.demo.cli" in names, names
print(len(names), "modules")
"""


@pytest.mark.slow  # builds, then installs jax, optax and flax from pip's cache: about 40 s
def test_wheel_installs_and_runs_in_a_fresh_environment(tmp_path):
  src = _checkout_copy(tmp_path / "src")
  dist = tmp_path / "dist"
  _run([sys.executable, "-m", "build", "--outdir", dist, src], "python -m build")
  wheel = dist / f"optax_accum-{VERSION}-py3-none-any.whl"
  sdist = dist / f"optax_accum-{VERSION}.tar.gz"
  assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in dist.iterdir())
  _run([sys.executable, "-m", "twine", "check", "--strict", wheel, sdist], "twine check")
  _check_wheel_contents(wheel)

  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", venv], "python -m venv")
  python, bin_dir = venv / "bin" / "python", venv / "bin"
  user = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env = _xla.env(base=user)  # one CPU device, not conftest's 8 fake ones: as a user runs it
  pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
  _run([*pip, wheel], "pip install <wheel>", env=env)
  run = {"env": env, "cwd": tmp_path}  # not the checkout: nothing of it on sys.path
  _run([python, "-W", "error", "-c", JAX_ONLY], "import optax_accum (jax and optax only)", **run)
  example = python_blocks(ROOT / "README.md")[0][0]
  out = _run([python, "-W", "error", "-c", example], "the README's first example", **run)
  assert "2 updates, 0 microbatches pending" in out, out

  _run([*pip, f"{wheel}[flax]"], "pip install <wheel>[flax]", env=env)
  out = _run([python, "-W", "error", "-c", ALL_MODULES], "import every module", **run)
  assert re.search(r"^\d+ modules$", out, re.M), out
  out = _run([bin_dir / "optax-accum", "--version"], "optax-accum --version", **run)
  assert VERSION in out, out
  out = _run([bin_dir / "optax-accum", "demo", "--help"], "optax-accum demo --help", **run)
  assert "--quick" in out, out
