"""Reading compiled HLO text: the fused computations of an executable, compared by body.

XLA compiles each fusion into its own kernel; an optimizer step over ``n`` equal leaves that
builds ``n`` *different* fused computations (a per-leaf constant, an offset) compiles ``n``
kernels where one would do (issue 47). Two computations are the same when their bodies are, with
instruction, parameter and computation names and ``metadata`` stripped; a callee (a reduction's
``to_apply``) is compared by its own body. ``tests/test_hlo.py`` checks the reader on programs
whose counts are known (XLA's text format can change between releases).
"""

from __future__ import annotations

import collections
import re

from optax_accum._collectives import _computations

_NAME = re.compile(r"%([\w.\-]+)")
_DEFINED = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_FUSION_CALL = re.compile(r" fusion\(.*\bcalls=%([\w.\-]+)")


def _strip_metadata(line: str) -> str:
  """``line`` without its ``, metadata={...}`` (op names and source lines, braces balanced)."""
  start = line.find(", metadata={")
  if start < 0:
    return line
  depth = 0
  for end in range(line.index("{", start), len(line)):
    depth += {"{": 1, "}": -1}.get(line[end], 0)
    if depth == 0:
      return line[:start] + line[end + 1 :]
  return line[:start]  # unbalanced: the rest is metadata


class _Canonical:
  """Each computation's body with names replaced: locals by their order of definition, callees
  by the number of their own canonical body."""

  def __init__(self, hlo_text: str):
    self.bodies = _computations(hlo_text)
    self.ids: dict[str, int] = {}  # canonical body -> its number
    self.memo: dict[str, str] = {}

  def body(self, name: str) -> str:
    if name not in self.memo:
      lines = [_strip_metadata(line).rstrip() for line in self.bodies[name]]
      lines = [line for line in lines if line.strip() and line.strip() != "}"]
      local = {m.group(1): i for i, m in enumerate(filter(None, map(_DEFINED.match, lines)))}

      def rename(match: re.Match) -> str:
        token = match.group(1)
        if token in local:
          return f"%{local[token]}"
        if token in self.bodies:
          return f"@{self.ids.setdefault(self.body(token), len(self.ids))}"
        return match.group(0)

      self.memo[name] = "\n".join(_NAME.sub(rename, line) for line in lines)
    return self.memo[name]


def fused_computations(hlo_text: str) -> collections.Counter:
  """How many ``fusion`` instructions call each distinct fused computation.

  Args:
    hlo_text: ``jax.jit(f).lower(*args).compile().as_text()``.

  Returns:
    A ``Counter`` keyed by canonical body (names and metadata stripped); its length is the number
    of distinct fused computations, its total the number of fusion instructions (in every
    computation: the entry, conditional branches, loop bodies, other fusions).
  """
  canonical = _Canonical(hlo_text)
  found: collections.Counter = collections.Counter()
  for lines in canonical.bodies.values():
    for line in lines:
      if match := _FUSION_CALL.search(line):
        found[canonical.body(match.group(1))] += 1
  return found


def distinct_fusions(hlo_text: str) -> int:
  """The number of distinct fused computations in ``hlo_text`` (see :func:`fused_computations`)."""
  return len(fused_computations(hlo_text))
