"""The code is `ruff check` and `ruff format --check` clean (configured in pyproject.toml)."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args):
  ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).with_name("ruff"))
  result = subprocess.run([ruff, *args, "."], cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr


def _imports(path: pathlib.Path) -> set[str]:
  """The optax_accum modules that ``path`` imports (at any depth of the file)."""
  import ast

  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("optax_accum"):
      found.add(node.module)
      found.update(f"{node.module}.{a.name}" for a in node.names)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("optax_accum"))
  return found


def test_no_import_cycles():
  """No module of optax_accum imports a module that imports it back (docs/design.md)."""
  pkg = ROOT / "optax_accum"
  modules = {}
  for path in pkg.rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    modules[name] = path
  graph = {
    name: {m for m in _imports(path) if m in modules and m != name and not name.startswith(m)}
    for name, path in modules.items()
  }

  def reaches(start, goal, seen):
    for nxt in graph[start]:
      if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
        return True
    return False

  cycles = [name for name in graph if reaches(name, name, {name})]
  assert not cycles, cycles
