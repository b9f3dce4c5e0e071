"""Type checking: pyrefly finds no error in optax_accum/ and in the public API as users call it
(tests/_typed_usage.py), and every public signature is annotated.

pyrefly is configured in pyproject.toml ([tool.pyrefly]) and pinned in .ci/constraints.txt; it
reads JAX's, optax's and Flax's own annotations from the environment that runs the tests, so both
CI legs (the oldest and the newest supported stack) check the package against their versions.
"""

import importlib
import inspect
import subprocess
import sys
import typing

import optax
import pytest
from _markdown import ROOT

import optax_accum
from optax_accum._accumulate import Accumulation
from optax_accum._metrics import Metrics
from optax_accum._token_budget import TokenBudget

PUBLIC_MODULES = (
  "optax_accum",
  "optax_accum.sharding",
  "optax_accum.testing",
  "optax_accum.flax",
  "optax_accum.pitfalls",
)


def test_pyrefly_finds_no_type_errors():
  pytest.importorskip("pyrefly", reason="the type checker comes with the test extra")
  proc = subprocess.run(
    [sys.executable, "-m", "pyrefly", "check", "--python-interpreter-path", sys.executable],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=300,
  )
  assert proc.returncode == 0, (
    f"pyrefly check (run it from the repository root) reports:\n{proc.stdout}\n{proc.stderr}"
  )
  assert " 0 errors" in proc.stderr, proc.stderr  # it checked the project, and found nothing


def _unannotated(fn: typing.Callable[..., typing.Any], name: str) -> list[str]:
  sig = inspect.signature(fn)
  missing = [
    f"{name}: parameter {p.name}"
    for p in sig.parameters.values()
    if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty
  ]
  if sig.return_annotation is inspect.Signature.empty and fn.__name__ != "__init__":
    missing.append(f"{name}: return")
  return missing


def _methods(cls: type) -> list[tuple[str, typing.Callable[..., typing.Any]]]:
  """The public methods and properties ``cls`` itself defines in optax_accum (and ``__init__``)."""
  found = []
  for key, value in vars(cls).items():
    if key.startswith("_") and key != "__init__":
      continue
    fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
    if inspect.isfunction(fn) and fn.__module__.startswith("optax_accum"):
      found.append((f"{cls.__qualname__}.{key}", fn))
  return found


def test_public_api_is_annotated():
  """Each name of each public ``__all__``, the classes their factories return (a loss scale, a
  token budget, the metrics, ...) and the transformation ``accumulate`` returns, with its
  ``update`` and ``update_and_apply``: every parameter and every return annotated."""
  missing, returned = [], set()
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    for name in module.__all__:
      obj = getattr(module, name)
      if inspect.isclass(obj):
        for method_name, fn in _methods(obj):
          missing += _unannotated(fn, f"{module_name}.{method_name}")
      else:
        missing += _unannotated(obj, f"{module_name}.{name}")
        ret = typing.get_type_hints(obj).get("return")
        for cls in (ret, *typing.get_args(ret)):
          if inspect.isclass(cls) and cls.__module__.startswith("optax_accum"):
            returned.add(cls)
  assert {Accumulation, Metrics, TokenBudget} <= returned, returned  # found from the annotations
  for cls in returned:
    for method_name, fn in _methods(cls):
      missing += _unannotated(fn, f"{cls.__module__}.{method_name}")
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  missing += _unannotated(tx.update, "accumulate(...).update")
  missing += _unannotated(tx.update_and_apply, "accumulate(...).update_and_apply")
  assert not missing, missing
