"""Shared test helper: run the Python blocks of a Markdown page in one fresh interpreter.

A block is a ```` ```python ```` fence (indented fences inside list items
included, dedented). A block whose fence is preceded, on the line before, by
``<!-- sketch -->`` is a sketch (an excerpt that needs context the page does
not give) and is not run.
"""

import ast
import io
import json
import pathlib
import re
import subprocess
import sys
import textwrap
import tokenize

import _xla

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKETCH = "<!-- sketch -->"
_FENCE = re.compile(
  r"^(?P<marker>[ ]*<!-- sketch -->\n)?(?P<indent>[ ]*)```python\n(?P<body>.*?)^(?P=indent)```",
  re.S | re.M,
)

# Runs each block in one namespace, then the test's check for that block (if any), and prints
# a line per block so a failure names the block.
_RUNNER = """
import json, sys
with open(sys.argv[1]) as f:
  blocks, checks, name = json.load(f)
ns = {"__name__": "__main__"}
for i, (block, check) in enumerate(zip(blocks, checks), start=1):
  exec(compile(block, f"{name}, python block {i}", "exec"), ns)
  if check:
    exec(compile(check, f"check of {name} block {i}", "exec"), ns)
  print(f"[{name}: block {i} ran]", flush=True)
"""


def python_blocks(path: pathlib.Path) -> list[tuple[str, bool]]:
  """``(code, is_sketch)`` for each Python block of ``path``, in order."""
  return [
    (textwrap.dedent(m["body"]), bool(m["marker"])) for m in _FENCE.finditer(path.read_text())
  ]


def section_blocks(path: pathlib.Path, word: str) -> list[str]:
  """The runnable Python blocks of the section of ``path`` whose heading contains ``word``.

  The section runs from its heading to the next heading of the same or a higher level.
  """
  lines = path.read_text().splitlines(keepends=True)
  levels, in_fence = [], False  # a comment line inside a code block is no heading
  for line in lines:
    fence = line.lstrip().startswith("```")
    heading = re.match(r"(#{1,6}) ", line)
    levels.append(len(heading[1]) if heading and not (in_fence or fence) else 0)
    in_fence ^= fence
  start = next(i for i, line in enumerate(lines) if levels[i] and word in line)
  end = next((i for i in range(start + 1, len(lines)) if 0 < levels[i] <= levels[start]), None)
  text = "".join(lines[start:end])
  return [textwrap.dedent(m["body"]) for m in _FENCE.finditer(text) if not m["marker"]]


def run_blocks(path, blocks, checks, tmp_path, timeout=600):
  """Runs ``blocks`` (with ``checks[i]`` after block i) in a fresh interpreter; returns stdout.

  The interpreter sees this checkout (``PYTHONPATH``), 8 fake CPU devices and
  warnings as errors; its working directory is ``tmp_path``. A failure raises
  ``AssertionError`` with the block's traceback.
  """
  job = tmp_path / "blocks.json"
  job.write_text(json.dumps([blocks, checks, path.name]))
  env = _xla.env(8, PYTHONPATH=str(ROOT))
  proc = subprocess.run(
    [sys.executable, "-W", "error", "-c", _RUNNER, str(job)],
    capture_output=True,
    text=True,
    env=env,
    cwd=tmp_path,
    timeout=timeout,
  )
  assert proc.returncode == 0, f"{path.name}:\n{proc.stdout}\n{proc.stderr}"
  return proc.stdout


_COMPOUND = (
  ast.FunctionDef,
  ast.AsyncFunctionDef,
  ast.ClassDef,
  ast.For,
  ast.AsyncFor,
  ast.While,
  ast.If,
  ast.With,
  ast.AsyncWith,
  ast.Try,
  *((ast.TryStar, ast.Match) if sys.version_info >= (3, 11) else ()),
)


def repl_problems(code: str) -> list[str]:
  """Where pasting ``code`` into the plain Python REPL (``python``, line by line) breaks.

  The REPL ends a compound statement (``def``, ``for``, ``with``, ...) at the first blank line
  outside brackets and strings, and refuses an unindented statement that follows one without a
  blank line. Returns one message per place (line numbers from 1), ``[]`` when it pastes.
  """
  tree = ast.parse(code)
  blank, depth = set(), 0  # blank lines at statement level (not inside brackets or strings)
  for tok in tokenize.generate_tokens(io.StringIO(code).readline):
    if tok.type == tokenize.OP and tok.string in "([{":
      depth += 1
    elif tok.type == tokenize.OP and tok.string in ")]}":
      depth -= 1
    elif tok.type == tokenize.NL and not tok.line.strip() and depth == 0:
      blank.add(tok.start[0])
  lines = code.splitlines()
  problems = []
  body = tree.body
  for node, after in zip(body, [*body[1:], None], strict=True):
    if not isinstance(node, _COMPOUND):
      continue
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    inside = sorted(n for n in blank if first < n <= node.end_lineno)
    if inside:
      problems.append(f"line {inside[0]}: a blank line inside the statement of line {first}")
    if after is not None and lines[node.end_lineno].strip():
      problems.append(
        f"line {node.end_lineno + 1}: no blank line after the statement of line {first}"
      )
  return problems


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def commented_sample(code: str, marker: str) -> list[str]:
  """The ``# `` comment lines right after the line of ``code`` containing ``marker``: the
  output a page shows for that line, one comment line per printed line."""
  lines = code.splitlines()
  start = next(i for i, line in enumerate(lines) if marker in line) + 1
  sample = []
  for line in lines[start:]:
    if not line.startswith("#"):
      break
    sample.append(line[2:] if line.startswith("# ") else line[1:])
  return sample


def same_output(printed: list[str], sample: list[str], rounding: float = 1e-5) -> list[str]:
  """The lines where ``printed`` differs from a page's ``sample``; ``[]`` when it matches.

  Text and numbers must be equal, except numbers below ``rounding`` in magnitude in the sample
  (float32 rounding differences, which vary with the machine's vector width): those only need
  to be below ``rounding`` in the printed line too.

  Examples:
    >>> same_output(["max 3.1e-08 of 0.25"], ["max 5e-08 of 0.25"])
    []
    >>> same_output(["max 3.1e-08 of 0.26"], ["max 5e-08 of 0.25"])
    ['line 1: printed max 3.1e-08 of 0.26 | page max 5e-08 of 0.25']
  """

  def parts(line: str) -> tuple[list[str], list[str]]:
    return _NUMBER.split(line), _NUMBER.findall(line)

  def small(number: str) -> bool:
    return abs(float(number.replace(",", ""))) < rounding

  diffs = (
    [f"lines: printed {len(printed)}, page {len(sample)}"] if len(printed) != len(sample) else []
  )
  for i, (got, want) in enumerate(zip(printed, sample, strict=False), start=1):
    (got_text, got_nums), (want_text, want_nums) = parts(got), parts(want)
    same = got_text == want_text and len(got_nums) == len(want_nums)
    same = same and all(
      g == w or (small(w) and small(g)) for g, w in zip(got_nums, want_nums, strict=True)
    )
    if not same:
      diffs.append(f"line {i}: printed {got} | page {want}")
  return diffs
