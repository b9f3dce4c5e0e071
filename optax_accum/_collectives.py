"""``count_collectives``: how often a compiled step communicates, read from its HLO text.

XLA's text format can change between releases: ``tests/test_testing.py`` checks the parser
on programs whose counts are known.
"""

from __future__ import annotations

import collections
import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
# The opcode: the first lowercase ``name(`` right of ``=`` (types hold none).
_OPCODE = re.compile(r"(?<![\w%.\-])([a-z][\w\-]*)\(")
_BRANCHES = re.compile(
  r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)"
  r"|false_computation=%?([\w.\-]+))"
)
_LOOP_PARTS = re.compile(r"(?:body|condition)=%?([\w.\-]+)")
_CALLEES = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _computations(hlo_text: str) -> dict[str, list[str]]:
  bodies: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match and "=" not in line.split("{")[0].split("(")[0]:
      current = match.group(1)
      bodies[current] = []
    elif current is not None:
      bodies[current].append(line)
  return bodies


def _branches(line: str) -> list[str]:
  names = []
  for match in _BRANCHES.finditer(line):
    group = match.group(1) or match.group(2) or match.group(3)
    names.extend(n.strip().lstrip("%") for n in group.split(","))
  return names


def _reachable(roots: set[str], bodies: dict[str, list[str]]) -> set[str]:
  """The computations ``roots`` run, directly or through calls, loops and branches."""
  seen: set[str] = set()
  todo = list(roots)
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    for line in bodies.get(name, ()):
      todo.extend(_CALLEES.findall(line))
      todo.extend(_branches(line))
  return seen


def count_collectives(hlo_text: str) -> dict[str, collections.Counter]:
  """Counts the collectives of a compiled program: outside, in conditionals, in loop bodies.

  ``accumulate``'s boundary is a ``lax.cond`` (once per window); the in-step ``lax.scan`` is
  a ``while`` loop (once per microbatch). Async pairs (``all-reduce-start``/``-done``) and a
  variadic all-reduce of several arrays count once.

  Args:
    hlo_text: ``jax.jit(step).lower(*args).compile().as_text()``.

  Returns:
    ``{'outside': Counter, 'in_conditional': Counter, 'in_loop': Counter}``
    keyed by opcode (``'all-reduce'``, ``'all-gather'``, ``'reduce-scatter'``,
    ``'all-to-all'``, ``'collective-permute'``); a conditional inside a loop body counts as
    ``'in_loop'``. Text without HLO computations gives three empty counters.

  Examples:
    >>> from optax_accum.testing import count_collectives
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> def f(x):  # one psum per loop iteration, one after the loop
    ...   y = jax.lax.fori_loop(0, 3, lambda i, c: c + jax.lax.psum(c, 'data'), x)
    ...   return jax.lax.psum(y, 'data')
    >>> f = jax.shard_map(f, mesh=mesh, in_specs=P('data'), out_specs=P())
    >>> x = jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, P('data')))
    >>> c = count_collectives(jax.jit(f).lower(x).compile().as_text())
    >>> c['in_loop']['all-reduce'], c['outside']['all-reduce'], c['in_conditional']['all-reduce']
    (1, 1, 0)
  """
  bodies = _computations(hlo_text)
  loop_roots: set[str] = set()
  branch_roots: set[str] = set()
  for lines in bodies.values():
    for line in lines:
      if " while(" in line:
        loop_roots.update(_LOOP_PARTS.findall(line))
      branch_roots.update(_branches(line))
  in_loop = _reachable(loop_roots, bodies)
  in_branch = _reachable(branch_roots, bodies) - in_loop
  counts = {key: collections.Counter() for key in ("outside", "in_conditional", "in_loop")}
  for name, lines in bodies.items():
    where = "in_loop" if name in in_loop else "in_conditional" if name in in_branch else "outside"
    for line in lines:
      _, eq, rhs = line.partition(" = ")
      match = _OPCODE.search(rhs) if eq else None
      if match is None:
        continue
      op = match.group(1).removesuffix("-start")
      if op in COLLECTIVES:
        counts[where][op] += 1
  return counts
