"""``count_collectives``: how often a compiled step communicates, read from its HLO text.

Experimental: XLA's HLO text format is not a stable interface and can change between
releases; a line the parser cannot read raises (``cannot read the device groups``) rather than
being skipped, and ``tests/test_collectives.py`` checks it on programs whose counts are known.
Reached only through ``optax_accum.testing.count_collectives``.
"""

from __future__ import annotations

import collections
import math
import re

import jax
import numpy as np

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
# The opcode: the first lowercase ``name(`` right of ``=`` (types hold none).
_BRANCHES = re.compile(
  r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)"
  r"|false_computation=%?([\w.\-]+))"
)
_LOOP_PARTS = re.compile(r"(?:body|condition)=%?([\w.\-]+)")
_CALLEES = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_COLLECTIVE_OP = re.compile(
  r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start|-done)?\("
)
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(
  r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
  r" \{([^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_INTS = lambda text: [int(t) for t in text.split(",") if t]


def _iota(dims: str, perm: str | None) -> np.ndarray:
  """XLA's iota device list ``[dims]T(perm)``: ``arange`` reshaped to ``dims``, transposed."""
  ids = np.arange(math.prod(_INTS(dims))).reshape(_INTS(dims))
  return ids.transpose(_INTS(perm)) if perm else ids


def _groups(line: str) -> list[list[int]] | None:
  """The device groups of one collective, as logical ids; ``None`` for every device."""
  if match := _EXPLICIT.search(line):
    groups = [_INTS(g) for g in re.findall(r"\{([\d,]*)\}", match.group(1))]
    return [g for g in groups if g] or None
  if match := _IOTA.search(line):
    return _iota(match.group(2), match.group(3)).reshape(_INTS(match.group(1))).tolist()
  if match := _MESH.search(line):  # mesh['axis_0'=2,'axis_1'=4] {'axis_1'}: vary the listed axes
    axes = re.findall(r"'([^']+)'=(\d+)", match.group(1))
    names, shape = [a for a, _ in axes], [int(n) for _, n in axes]
    grid = np.arange(math.prod(shape)) if match.group(2) is None else _iota(*match.group(2, 3))
    grid = grid.reshape(shape)
    listed = [names.index(a) for a in re.findall(r"'([^']+)'", match.group(4))]
    rest = [i for i in range(len(names)) if i not in listed]
    size = math.prod(shape[i] for i in listed)
    return grid.transpose(rest + listed).reshape(-1, size).tolist()
  if match := _PAIRS.search(line):
    return [_INTS(p) for p in re.findall(r"\{(\d+,\d+)\}", match.group(1))]
  if "replica_groups={}" in line:
    return None
  raise ValueError(
    "count_collectives: cannot read the device groups of this HLO instruction (an XLA text "
    f"format this version does not know; count without mesh=, or report it): {line.strip()[:300]}"
  )


def _axes(line: str, mesh: jax.sharding.Mesh) -> tuple[str, ...]:
  """The mesh axes a collective runs over: those along which the devices of a group differ."""
  shape = mesh.devices.shape
  groups = _groups(line)
  if groups is None:
    return tuple(name for name, n in zip(mesh.axis_names, shape, strict=True) if n > 1)
  ids = np.asarray([i for g in groups for i in g])
  if ids.size and ids.max() >= mesh.size:
    raise ValueError(
      f"count_collectives: a device group names logical id {ids.max()}, but mesh= has "
      f"{mesh.size} devices; pass the mesh the program was compiled for."
    )
  varying: set[int] = set()
  for group in groups:
    coords = np.stack(np.unravel_index(np.asarray(group), shape))
    varying.update(int(a) for a in np.flatnonzero((coords != coords[:, :1]).any(axis=1)))
  return tuple(mesh.axis_names[a] for a in sorted(varying))


def _bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    width = re.match(r"[a-z]+(\d+)", dtype)  # none in token[]: no data
    bits = 8 if dtype == "pred" else int(width.group(1)) if width else 0
    total += math.prod(_INTS(dims)) * bits // 8
  return total


def _operands(rhs: str, start: int) -> str:
  """The text inside the parentheses that open at ``rhs[start]``."""
  depth = 0
  for i in range(start, len(rhs)):
    depth += {"(": 1, ")": -1}.get(rhs[i], 0)
    if depth == 0:
      return rhs[start + 1 : i]
  return rhs[start + 1 :]


def _data_bytes(rhs: str, match: re.Match) -> int:
  """The collective's data size: the array reduced, gathered result or scattered input."""
  result = _bytes(rhs[: match.start()])
  if match.group(2) == "-done":  # an async pair: the -done result is the collective's output
    return result
  return max(result, _bytes(_operands(rhs, match.end() - 1)))


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


def count_collectives(
  hlo_text: str, mesh: jax.sharding.Mesh | None = None, *, unit: str = "count"
) -> dict[str, collections.Counter]:
  """Counts the collectives of a compiled program: outside, in conditionals, in loop bodies.

  ``accumulate``'s boundary is a ``lax.cond`` (once per window); the in-step ``lax.scan`` is
  a ``while`` loop (once per microbatch). Async pairs (``all-reduce-start``/``-done``) and a
  variadic all-reduce of several arrays count once.

  Args:
    hlo_text: ``jax.jit(step).lower(*args).compile().as_text()``.
    mesh: the mesh the program was compiled for. Given, each collective is keyed by
      ``(opcode, axes)``: ``axes`` is the tuple of mesh axis names (in mesh order) along
      which the devices of its replica groups (or ``collective-permute`` pairs) differ, read
      from every group format XLA prints (explicit lists, iota ``[2,4]<=[8]``, ``mesh[...]``).
      Logical ids are positions in ``mesh.devices.flat`` (the device assignment of a
      ``jax.jit`` over that mesh).
    unit: ``'count'`` (instructions) or ``'bytes'``: the data size of each collective, as
      NCCL's tests report it: the arrays all-reduced, the gathered result, the scattered
      input (the larger of operands and result; for async pairs, the ``-done`` result).

  Returns:
    ``{'outside': Counter, 'in_conditional': Counter, 'in_loop': Counter}``
    keyed by opcode (``'all-reduce'``, ``'all-gather'``, ``'reduce-scatter'``,
    ``'all-to-all'``, ``'collective-permute'``), or by ``(opcode, axes)`` with ``mesh``;
    a conditional inside a loop body counts as ``'in_loop'``. Text without HLO computations
    gives three empty counters.

  Raises:
    ValueError: ``unit`` is neither ``'count'`` nor ``'bytes'``; with ``mesh``, a group
      names a logical id outside the mesh, or its format is unknown to this version.

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
    >>> mesh = jax.make_mesh((2, 4), ('replica', 'fsdp'))
    >>> f = jax.shard_map(lambda x: jax.lax.psum(x, 'replica'), mesh=mesh,
    ...                   in_specs=P(('replica', 'fsdp')), out_specs=P('fsdp'))
    >>> x = jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, P(('replica', 'fsdp'))))
    >>> text = jax.jit(f).lower(x).compile().as_text()
    >>> dict(count_collectives(text, mesh)['outside'])
    {('all-reduce', ('replica',)): 1}
    >>> dict(count_collectives(text, mesh, unit='bytes')['outside'])  # one float32 per device
    {('all-reduce', ('replica',)): 4}
  """
  if unit not in ("count", "bytes"):
    raise ValueError(f"count_collectives: unit={unit!r}; pass 'count' or 'bytes'.")
  skip = "-done" if unit == "count" else "-start"
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
      match = _COLLECTIVE_OP.search(rhs) if eq else None
      if match is None or match.group(2) == skip:
        continue
      key = match.group(1) if mesh is None else (match.group(1), _axes(line, mesh))
      counts[where][key] += 1 if unit == "count" else _data_bytes(rhs, match)
  return counts
