"""Sphinx configuration of the documentation site (Read the Docs: .readthedocs.yaml).

Build it from a clone with the ``docs`` extra (``pip install -e ".[docs]"``)::

  sphinx-build -W -n -b html docs docs/_build/html

The pages are the Markdown files of ``docs/`` (MyST) and the README (the home page); the
notebooks of ``notebooks/`` (``docs/notebooks`` links to them) are rendered from their stored
outputs, never executed here; the API reference is written from each public module's
``__all__`` (``_ext/api_pages.py``). tests/test_site.py builds it with warnings as errors, nitpicky
(``-n``: a cross-reference to nothing warns).
"""

import inspect
import os
import pathlib
import sys

from docutils import nodes
from sphinx import addnodes
from sphinx.util import logging

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, also when it is not installed
sys.path.insert(0, str(HERE / "_ext"))

import optax_accum  # noqa: E402

logger = logging.getLogger(__name__)

project = "optax_accum"
author = "optax_accum developers"
copyright = "optax_accum developers"
release = optax_accum.__version__
version = release

REPOSITORY = "https://github.com/optax-accum/optax_accum"
SITE = "https://optax-accum.readthedocs.io/en/latest/"  # the README links here
html_baseurl = SITE

extensions = [
  "myst_nb",  # Markdown pages (MyST) and notebooks
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",  # Google-style docstrings
  "sphinx.ext.intersphinx",
  "sphinx.ext.linkcode",
  "api_pages",
]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "_ext", "notebooks/figures", "**/.ipynb_checkpoints"]

# -- Markdown and notebooks ------------------------------------------------------------------
myst_heading_anchors = 4  # GitHub's anchors: [x](aggregation.md#fp8-with-flax)
nb_execution_mode = "off"  # rendered from their stored outputs (CI runs them: test_notebooks)

# -- API reference ---------------------------------------------------------------------------
autodoc_typehints = "description"  # the types beside each argument's text, not in one long line
autodoc_typehints_description_target = "documented"
autodoc_member_order = "bysource"
autosummary_generate = False  # _ext/api_pages.py writes the pages
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# accumulate's docstring lists the arguments of the update it returns, like Args.
napoleon_custom_sections = [("Update args", "params_style")]

# Cross-references (tests/test_site.py builds with -n, nitpicky: a reference to nothing warns).
# The private classes public factories return (``Accumulation``, ``TokenBudget``, ``Metrics``,
# ...) have no page (the API is each public ``__all__``): their names in signatures show as
# plain text, and docstrings name them as ``code``, never as a link.
nitpick_ignore_regex = [("py:class", r"optax_accum\.(\w+\.)*(_\w+|testing)\.[A-Z]\w*")]


# Links to the libraries' own references. Their inventories are fetched from the web, which CI's
# machine cannot reach: there OPTAX_ACCUM_DOCS_OFFLINE=1 leaves them out (the pages still build,
# the names of jax, optax and flax show as plain text).
intersphinx_mapping = {
  "python": ("https://docs.python.org/3", None),
  "numpy": ("https://numpy.org/doc/stable/", None),
  "jax": ("https://docs.jax.dev/en/latest/", None),
  "optax": ("https://optax.readthedocs.io/en/latest/", None),
  "flax": ("https://flax.readthedocs.io/en/latest/", None),
}
if os.environ.get("OPTAX_ACCUM_DOCS_OFFLINE"):
  intersphinx_mapping = {}
  # Without the inventories no name of these libraries resolves: plain text, as said above.
  nitpick_ignore_regex.append(
    ("py:.*", r"(python|collections|typing|numpy|jax|jaxlib|optax|flax)(\..*)?")
  )


def linkcode_resolve(domain, info):
  """The [source] link of a documented name: its lines on GitHub."""
  if domain != "py" or not info["module"]:
    return None
  obj = sys.modules.get(info["module"])
  for part in info["fullname"].split("."):
    obj = getattr(obj, part, None)
  try:
    obj = inspect.unwrap(obj)
    path = pathlib.Path(inspect.getsourcefile(obj)).resolve().relative_to(ROOT)
    lines, first = inspect.getsourcelines(obj)
  except (TypeError, OSError, ValueError):
    return None  # a constant, or not our source
  return f"{REPOSITORY}/blob/main/{path}#L{first}-L{first + len(lines) - 1}"


# -- HTML --------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "optax_accum"
html_theme_options = {
  "repository_url": REPOSITORY,
  "repository_branch": "main",
  "path_to_docs": "docs",
  "use_repository_button": True,
  "use_issues_button": True,
  "use_source_button": True,
  "launch_buttons": {"colab_url": "https://colab.research.google.com"},
  "show_toc_level": 2,
}


# -- Links that leave docs/ ----------------------------------------------------------------
# The Markdown pages and notebooks are written for GitHub: they link to files of the repository
# by relative paths (../notebooks/01_quickstart.ipynb, ../benchmarks/results/microstep.json), and
# the README links to the site's pages by their URLs. In the site, a link to a file that a page
# renders goes to that page; a link to any other file of the repository goes to it on GitHub.
INCLUDED = {"README.md": "index", "CHANGELOG.md": "changelog"}  # files a page includes


def _pages(app) -> dict[pathlib.Path, str]:
  """Each page's source file, symbolic links resolved and suffix dropped -> the page's docname.

  docs/notebooks links to ../notebooks, so notebooks/01_quickstart.ipynb is a page.
  """
  pages = {ROOT / name.removesuffix(".md"): doc for name, doc in INCLUDED.items()}
  for docname in app.env.found_docs:
    pages[pathlib.Path(app.env.doc2path(docname)).resolve().with_suffix("")] = docname
  return pages


def _page_link(app, node, docname: str, anchor: str | None) -> addnodes.pending_xref:
  """A link to a page of the site (and an anchor in it), as MyST makes one for ``[x](page.md)``."""
  ref = addnodes.pending_xref(
    "",
    refdomain="doc",
    reftype="myst",
    reftarget=docname,
    reftargetid=anchor,
    refdoc=app.env.docname,
    refexplicit=True,
  )
  ref += nodes.inline("", "", *(child.deepcopy() for child in node.children))
  return ref


def resolve_repository_links(app, doctree) -> None:
  """Rewrites the links that leave docs/ (see above); a link to a page the site lacks warns."""
  pages = _pages(app)
  here = pathlib.Path(app.env.doc2path(app.env.docname)).parent
  # MyST made a link to a page of a path outside docs/ (Sphinx resolves symbolic links).
  for node in doctree.findall(addnodes.pending_xref):
    target = pathlib.Path(node.get("reftarget", ""))
    if node.get("reftype") == "myst" and node.get("refdomain") == "doc" and target.is_absolute():
      node["reftarget"] = pages.get(target, node["reftarget"])  # else MyST warns
  # MyST made a download of a file outside docs/.
  for node in list(doctree.findall(addnodes.download_reference)):
    path = (here / node["reftarget"]).resolve()
    if HERE in path.parents:
      continue  # a file of docs/: a download, as Sphinx makes it
    if path.with_suffix("") in pages:
      node.replace_self(_page_link(app, node, pages[path.with_suffix("")], None))
    else:
      url = f"{REPOSITORY}/blob/main/{path.relative_to(ROOT).as_posix()}"
      node.replace_self(nodes.reference("", "", *node.children, refuri=url))
  # The README's links to the site.
  for node in list(doctree.findall(nodes.reference)):
    uri = node.get("refuri", "")
    if not uri.startswith(SITE):
      continue
    page, _, anchor = uri.removeprefix(SITE).partition("#")
    docname = page.removesuffix(".html") or "index"
    if docname not in app.env.found_docs:
      logger.warning(f"a link to {uri}: the site has no page {docname!r}", location=node)
      continue
    node.replace_self(_page_link(app, node, docname, anchor or None))


def notebook_buttons(app, pagename, templatename, context, doctree) -> None:
  """The buttons of a notebook's page name its file in the repository (Colab opens it there).

  The theme builds them from ``path_to_docs`` and the page's name: docs/notebooks/x.ipynb, a
  path through the symbolic link, which GitHub does not follow; the file is notebooks/x.ipynb.
  """
  if not pagename.startswith("notebooks/"):
    return
  stack = list(context.get("header_buttons", []))
  while stack:
    button = stack.pop()
    stack.extend(button.get("buttons", []))
    if "url" in button:
      button["url"] = button["url"].replace("/docs/notebooks/", "/notebooks/")


def setup(app):
  app.connect("doctree-read", resolve_repository_links, priority=400)
  app.connect("html-page-context", notebook_buttons, priority=600)  # after the theme's buttons
