"""Counting collectives in compiled HLO (optax_accum/_collectives.py, testing.count_collectives)."""

import _compat
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import testing

HAND_WRITTEN_HLO = """
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%inner (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  %ars = f32[4] all-reduce-start(f32[4] %p), replica_groups={}, to_apply=%add
  ROOT %ard = f32[4] all-reduce-done(f32[4] %ars)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %c = f32[4] call(f32[4] %x), to_apply=%inner
  ROOT %t2 = (s32[], f32[4]) tuple(s32[] %i, f32[4] %c)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

%branch (x: f32[4]) -> f32[4] {
  ROOT %rs = f32[1] reduce-scatter(f32[4] %x), dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]) while((s32[], f32[4]) %t), condition=%cond, body=%body
  %k = f32[4] conditional(s32[] %b, f32[4] %x), branch_computations={%branch, %inner}
  ROOT %ag = f32[32] all-gather(f32[4] %x), dimensions={0}
}
"""


def test_count_collectives_places_each_collective_by_how_often_it_runs():
  """psum in a cond in a loop: per iteration; all_gather in a cond after it: per branch taken."""
  mesh = _compat.make_mesh((8,), ("data",))

  def f(x):
    def body(i, c):
      return jax.lax.cond(c.sum() > 0, lambda c: c + jax.lax.psum(c, "data"), lambda c: c, c)

    y = jax.lax.fori_loop(0, 3, body, x)
    gather = lambda y: jax.lax.all_gather(y, "data", tiled=True)[: y.shape[0]]
    return jax.lax.psum(jax.lax.cond(y.sum() > 0, gather, lambda y: y, y), "data")

  g = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())
  x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))
  counts = testing.count_collectives(jax.jit(g).lower(x).compile().as_text())
  assert {k: dict(v) for k, v in counts.items()} == {
    "outside": {"all-reduce": 1},
    "in_conditional": {"all-gather": 1},
    "in_loop": {"all-reduce": 1},
  }


def test_count_collectives_on_hand_written_hlo():
  """Async pairs count once; a computation both in a loop and in a branch counts in the loop."""
  counts = testing.count_collectives(HAND_WRITTEN_HLO)
  assert counts["in_loop"] == {"all-reduce": 1}  # %inner, called from %body (and a branch)
  assert counts["in_conditional"] == {"reduce-scatter": 1}
  assert counts["outside"] == {"all-gather": 1}
  assert testing.count_collectives("no hlo here") == {
    "outside": {},
    "in_conditional": {},
    "in_loop": {},
  }


def _axes_of(line, mesh):
  """The axes ``count_collectives`` reads from one hand-written instruction."""
  text = f"ENTRY %main (x: f32[4]) -> f32[4] {{\n  {line}\n}}\n"
  (key,) = testing.count_collectives(text, mesh)["outside"]
  return key[1]


def test_every_replica_group_format_maps_to_the_hand_worked_mesh_axes():
  """A (2, 2, 2) mesh ('a', 'b', 'c'): logical id 4a + 2b + c; each group varies some axes."""
  mesh = _compat.make_mesh((2, 2, 2), ("a", "b", "c"))
  ar = "%r = f32[4]{0} all-reduce(f32[4]{0} %x), channel_id=1, replica_groups="
  cases = {
    "{{0,4},{1,5},{2,6},{3,7}}": ("a",),  # 0 and 4 differ in a only
    "{{0,1,2,3},{4,5,6,7}}": ("b", "c"),
    "{}": ("a", "b", "c"),
    "[4,2]<=[8]": ("c",),  # rows {0,1}, {2,3}, ...
    "[4,2]<=[2,4]T(1,0)": ("a",),  # arange(8).reshape(2,4).T rows: {0,4}, {1,5}, ...
    "[4,2]<=[2,2,2]T(0,2,1)": ("b",),  # rows {0,2}, {1,3}, {4,6}, {5,7}
    "[2,4]<=[8]": ("b", "c"),
    "mesh['axis_0'=2,'axis_1'=4] {'axis_0'}": ("a",),
    "mesh['axis_0'=2,'axis_1'=4] {'axis_1'}": ("b", "c"),
    # the grid arange(8).reshape(2,4).T = [[0,4],[1,5],[2,6],[3,7]] reshaped to (4,1,2):
    # axis_0 varies 0,1,2,3 (b and c), axis_2 varies 0,4 (a).
    "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}": ("b", "c"),
    "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_2'}": ("a",),
  }
  for groups, axes in cases.items():
    assert _axes_of(ar + groups + ", to_apply=%add", mesh) == axes, groups
  perm = "%p = f32[4]{0} collective-permute(f32[4]{0} %x), source_target_pairs={{0,2},{2,0}}"
  assert _axes_of(perm, mesh) == ("b",)
  with pytest.raises(ValueError, match="logical id 8, but mesh= has 8 devices"):
    _axes_of(ar + "{{0,8}}", mesh)
  with pytest.raises(ValueError, match="cannot read the device groups"):
    _axes_of(ar + "somethingnew", mesh)
  with pytest.raises(ValueError, match="unit='rows'"):
    testing.count_collectives("", unit="rows")


def test_compiled_programs_report_the_axes_they_reduce_over():
  """Whatever group format this XLA prints: manual psums and compiler-inserted reductions."""
  mesh = _compat.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
  spec = P(("a", "b", "c"))
  x = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, spec))
  for axes in [("a",), ("b",), ("c",), ("a", "c"), ("a", "b", "c")]:
    psum = lambda x, axes=axes: jax.lax.psum(x, axes)
    f = jax.shard_map(psum, mesh=mesh, in_specs=spec, out_specs=spec)
    counts = testing.count_collectives(jax.jit(f).lower(x).compile().as_text(), mesh)
    assert counts["outside"] == {("all-reduce", axes): 1}, axes
  z = jax.device_put(jnp.ones((4, 4, 4)), NamedSharding(mesh, P("a", "b", "c")))
  for dim, axis in enumerate("abc"):  # summing a sharded dimension reduces over its axis
    text = jax.jit(lambda z, d=dim: z.sum(d)).lower(z).compile().as_text()
    assert testing.count_collectives(text, mesh)["outside"] == {("all-reduce", (axis,)): 1}


def test_bytes_are_the_data_size_of_each_collective():
  """Hand-worked: a variadic all-reduce of f32[] and bf16[4,8]; all-gather f32[2] -> f32[8]."""
  text = """ENTRY %main (x: f32[2]) -> f32[8] {
  %r = (f32[], bf16[4,8]{1,0}) all-reduce(f32[] %a, bf16[4,8]{1,0} %b), replica_groups={}
  %s = (f32[2]{0}, f32[8]{0}) all-gather-start(f32[2]{0} %x), replica_groups={}, dimensions={0}
  %d = f32[8]{0} all-gather-done((f32[2]{0}, f32[8]{0}) %s)
  ROOT %rs = f32[2]{0} reduce-scatter(f32[8]{0} %x), replica_groups={}, dimensions={0}
}
"""
  data = testing.count_collectives(text, unit="bytes")["outside"]
  assert data == {"all-reduce": 4 + 2 * 32, "all-gather": 4 * 8, "reduce-scatter": 4 * 8}
  assert testing.count_collectives(text)["outside"] == {
    "all-reduce": 1,
    "all-gather": 1,
    "reduce-scatter": 1,
  }
