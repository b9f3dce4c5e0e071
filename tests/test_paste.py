"""The README's and docs' Python blocks paste into the plain Python REPL as written.

A reader copies a block into ``python``: a loop or ``def`` needs a blank line after it before
the next unindented line, and no blank line inside it (the REPL ends the statement there).
Sketches too: they are read and copied like the rest.
"""

import pytest
from _markdown import ROOT, python_blocks, repl_problems

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_checker_finds_what_the_repl_refuses():
  assert repl_problems("for i in range(2):\n  x = i\nprint(x)\n") == [
    "line 3: no blank line after the statement of line 1"
  ]
  assert repl_problems("def f():\n  x = 1\n\n  return x\n") == [
    "line 3: a blank line inside the statement of line 1"
  ]
  # Blank lines inside brackets or strings, and a compound statement at the end, paste fine.
  assert repl_problems("for i in f(\n\n  1):\n  s = '''a\n\nb'''\n\ny = 2\nif y:\n  y = 3\n") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_paste_into_the_repl(page):
  problems = [
    f"{page.name}, python block {i}: {problem}"
    for i, (code, _) in enumerate(python_blocks(page), start=1)
    for problem in repl_problems(code)
  ]
  assert not problems, "\n".join(problems)
