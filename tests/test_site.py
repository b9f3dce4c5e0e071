"""The documentation site (docs/conf.py, .readthedocs.yaml) builds with warnings as errors, every
cross-reference resolved (nitpicky), and has what a reader of optax's or flax's site expects: a
page per docs/*.md, the README as the home page, every notebook rendered from its stored outputs
with a Colab button, and an API page for every name of every public ``__all__`` with its signature
and its example.

The build runs offline (``OPTAX_ACCUM_DOCS_OFFLINE=1``: no intersphinx inventories, which CI's
machine cannot fetch) and executes no notebook.
"""

import html
import inspect
import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from _api import public_names
from _markdown import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

DOCS = ROOT / "docs"
SITE = re.search(r'^SITE = "(.+?)"', (DOCS / "conf.py").read_text(), flags=re.M)[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _site_links(text: str) -> list[str]:
  return re.findall(rf"\]\(({re.escape(SITE)}[^)]*)\)", text)


def test_readme_links_to_the_site_pages_that_exist():
  """PyPI shows the README without the repository: its links to docs and notebooks are URLs."""
  readme = (ROOT / "README.md").read_text()
  assert not re.findall(r"\]\((?:docs|notebooks)/[^)]*\.(?:md|ipynb)\)", readme)
  pages = {"", "api/index.html"}
  pages |= {f"{p.stem}.html" for p in DOCS.glob("*.md")}
  pages |= {f"notebooks/{p.stem}.html" for p in NOTEBOOKS}
  links = _site_links(readme)
  assert len(links) >= 10
  for link in links:
    assert link.removeprefix(SITE).partition("#")[0] in pages, link


def test_project_urls_and_read_the_docs_build_this_site():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert project["urls"]["Documentation"] == SITE
  extras = project["optional-dependencies"]
  assert "optax_accum[docs]" in extras["test"]  # CI installs only the test extra
  rtd = yaml.safe_load((ROOT / ".readthedocs.yaml").read_text())
  assert rtd["sphinx"]["configuration"] == "docs/conf.py"
  installs = rtd["python"]["install"]
  assert [i.get("extra_requirements") for i in installs if i.get("path") == "."] == [["docs"]]
  assert (DOCS / "notebooks").resolve() == ROOT / "notebooks"  # the link the site reads them by


def test_every_public_name_has_an_example():
  """Its page shows a ``>>>`` example (run as a doctest by the suite: --doctest-modules)."""
  names = public_names()
  assert len(names) >= 29
  assert [n for n, obj in names if ">>>" not in (inspect.getdoc(obj) or "")] == []


@pytest.mark.slow  # builds the site once (about 15 s on 2 cores), then reads it
def test_site_builds_without_warnings_with_every_page(tmp_path):
  out = tmp_path / "site"
  env = dict(os.environ, OPTAX_ACCUM_DOCS_OFFLINE="1")
  sphinx = [sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-q", "-b", "html"]
  proc = subprocess.run(
    [*sphinx, str(DOCS), str(out)],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=600,
  )
  assert proc.returncode == 0, (
    "the documentation site does not build without warnings (python -m sphinx -W -n -b html docs "
    f"docs/_build/html reproduces this):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
  )
  _check_pages(out)
  _check_links(out)
  _check_api(out)


def _check_pages(site):
  for page in DOCS.glob("*.md"):
    assert (site / f"{page.stem}.html").is_file(), page.name
  home = (site / "index.html").read_text()
  assert "What it is for" in home  # the README is the home page
  for nb in NOTEBOOKS:
    text = (site / "notebooks" / f"{nb.stem}.html").read_text()
    colab = f"https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/notebooks/{nb.name}"
    assert f'href="{colab}"' in text, f"{nb.name}: no Colab launch button for {colab}"
    outputs = sum(
      len(c.get("outputs", []))
      for c in json.loads(nb.read_text())["cells"]
      if c["cell_type"] == "code"
    )
    assert outputs and text.count('class="cell_output') >= 1, nb.name  # stored outputs shown


def _check_links(site):
  """Links between pages resolve to pages: no href to a .md or .ipynb file of the checkout."""
  for page in site.rglob("*.html"):
    for href in re.findall(r'href="([^"]+)"', page.read_text()):
      if href.startswith(("http://", "https://", "#", "mailto:")) or "_sources/" in href:
        continue
      assert not re.search(r"\.(md|ipynb)(#|$)", href), (page.relative_to(site), href)


def _check_api(site):
  names = public_names()
  assert len(names) >= 29  # 0.4's public surface (CHANGELOG)
  for fullname, obj in names:
    page = site / "api" / f"{fullname}.html"
    assert page.is_file(), f"no API page for {fullname}"
    text = page.read_text()
    assert f'id="{fullname}"' in text, f"{fullname}: no documented object on its page"
    doc = inspect.getdoc(obj) if callable(obj) else None
    if doc and ">>>" in doc:
      assert "&gt;&gt;&gt;" in text, f"{fullname}: its docstring's example is not on its page"
    module_page = (site / "api" / f"{fullname.rsplit('.', 1)[0]}.html").read_text()
    assert f'href="{html.escape(fullname)}.html' in module_page, (
      f"{fullname}: not in its module's table"
    )
