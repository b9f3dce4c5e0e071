"""Shared test helper: the public names, as the API reference (docs/_ext/api_pages.py) has them."""

import importlib
import sys

from _markdown import ROOT


def public_names() -> list[tuple[str, object]]:
  """``(module.name, object)`` for every name of every public module's ``__all__``."""
  ext = str(ROOT / "docs" / "_ext")
  sys.path.insert(0, ext)
  try:
    api_pages = importlib.import_module("api_pages")
  finally:
    sys.path.remove(ext)
  return [
    (f"{m.__name__}.{n}", getattr(m, n)) for m in api_pages.public_modules() for n in m.__all__
  ]
