"""The API reference, written from the code: a page per public module and per public name.

A public module is the package or one of its submodules whose name has no leading underscore and
that declares ``__all__`` (``optax_accum.demo``, the command line, declares none). Each name of its
``__all__`` gets its own page (autodoc: signature, docstring with its example, cross-links); the
module's page shows its docstring and a table of its names. Nothing here lists a name by hand:
a name added to (or removed from) an ``__all__`` appears in (or leaves) the site on the next
build. The pages are written into ``docs/api/`` (not in git) when the build starts.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pkgutil
import re
from types import ModuleType

from sphinx.ext.napoleon import Config
from sphinx.ext.napoleon.docstring import GoogleDocstring

PACKAGE = "optax_accum"
OUT = "api"  # under the source directory


def public_modules(package: str = PACKAGE) -> list[ModuleType]:
  """The package, then its public submodules with an ``__all__``, by name."""
  root = importlib.import_module(package)
  found = [root]
  for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
    if any(part.startswith("_") for part in info.name.split(".")):
      continue
    if info.name.split(".")[1] == "demo":  # the command line's code: no public API
      continue
    module = importlib.import_module(info.name)
    if hasattr(module, "__all__"):
      found.append(module)
  return sorted(found, key=lambda m: (m is not root, m.__name__))


def _title(text: str) -> str:
  return f"{text}\n{'=' * len(text)}\n"


def _attributes(cls: type) -> list[str]:
  """The names a class's docstring documents under ``Attributes:`` (as napoleon reads it)."""
  text = str(GoogleDocstring(inspect.getdoc(cls) or "", Config(), what="class"))
  return re.findall(r"^\.\. attribute:: (\w+)", text, flags=re.M)


def _directive(module: ModuleType, name: str) -> str:
  """The autodoc directive that documents ``module.name`` by its kind."""
  obj = getattr(module, name)
  if inspect.isclass(obj):
    # What the docstring's ``Attributes:`` documents (a NamedTuple's fields, say) autodoc would
    # document a second time ("Alias for field number 0", a duplicate description).
    known = dict.fromkeys([*_attributes(obj), *getattr(obj, "_fields", ())])
    kind = "autoexception" if issubclass(obj, BaseException) else "autoclass"
    options = "   :members:\n   :show-inheritance:\n"
    if known:
      options += f"   :exclude-members: {', '.join(known)}\n"
    return f".. {kind}:: {name}\n{options}"
  if callable(obj):
    return f".. autofunction:: {name}\n"
  return f".. autodata:: {name}\n"


def write_pages(srcdir: pathlib.Path) -> list[str]:
  """Writes ``api/index.rst`` and the module and name pages; returns the names documented."""
  out = srcdir / OUT
  out.mkdir(exist_ok=True)
  pages: dict[str, str] = {}
  modules = public_modules()
  documented = []
  index = [
    _title("API reference"),
    "Every public name, one page each, grouped by the module that exports it. ``import",
    f"{PACKAGE}`` needs only JAX and Optax; ``{PACKAGE}.flax`` needs the ``flax`` extra.\n",
    ".. toctree::\n   :maxdepth: 1\n",
    *(f"   {m.__name__}" for m in modules),
    "",
  ]
  pages["index"] = "\n".join(index)
  for module in modules:
    names = list(module.__all__)
    page = [
      _title(module.__name__),
      f".. automodule:: {module.__name__}\n",
      f".. currentmodule:: {module.__name__}\n",
      ".. autosummary::\n",
      *(f"   {name}" for name in names),
      "",
      ".. toctree::\n   :hidden:\n",
      *(f"   {module.__name__}.{name}" for name in names),
      "",
    ]
    pages[module.__name__] = "\n".join(page)
    for name in names:
      text = [
        _title(f"{module.__name__}.{name}"),
        f".. currentmodule:: {module.__name__}\n",
        _directive(module, name),
      ]
      pages[f"{module.__name__}.{name}"] = "\n".join(text)
      documented.append(f"{module.__name__}.{name}")
  for path in out.glob("*.rst"):  # a name gone from an __all__ leaves the site
    if path.stem not in pages:
      path.unlink()
  for stem, text in pages.items():  # unchanged pages keep their time: Sphinx rereads none
    path = out / f"{stem}.rst"
    if not path.exists() or path.read_text() != text:
      path.write_text(text)
  return documented


def _builder_inited(app) -> None:
  write_pages(pathlib.Path(app.srcdir))


def setup(app):
  app.connect("builder-inited", _builder_inited)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
