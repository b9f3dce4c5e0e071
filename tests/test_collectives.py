"""Counting collectives in compiled HLO (optax_accum/_collectives.py, testing.count_collectives)."""

import _compat
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
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
