"""Where the inner optimizer runs at the boundary: on the whole window, or ZeRO-1 on 1/n shards.

``accumulate(..., axis_name="data", shard_optimizer=True)`` inside ``shard_map`` over ``n``
devices: each device still sums its own microbatches into its own window; at the boundary, one
reduce-scatter (instead of the all-reduce) gives each device the summed window of ``1/n`` of every
leaf (flattened, zero-padded to a multiple of ``n``; the window's scalars ride in the same
collective), the inner optimizer runs on that shard with its ``1/n`` of the inner state, and one
all-gather returns the updates: the bytes of one ring all-reduce, and ``1/n`` of Adam's
8 bytes per parameter per device (ZeRO stage 1, Rajbhandari et al. 2020; Megatron's distributed
optimizer).

The inner optimizer is traced on the full shapes and evaluated on the shards
(:func:`run_on_shards`): elementwise operations act on the shard; a reduction over all elements
of a leaf (a global norm: ``optax.clip_by_global_norm``, lamb's trust ratio) is a local reduction
of the shard's real elements and one scalar collective; an operation that moves elements between
positions (a transpose, a reduction over some axes, a matmul: factored ``adafactor``, ``muon``)
cannot run on shards and is refused, naming it.

:data:`REPLICATED` is the default placement (every device runs the inner optimizer on the whole
window after one all-reduce); :class:`Sharded` the ZeRO-1 one. The microstep (``_step.close``)
calls the same methods on either.

Experimental: :func:`run_on_shards` is a jaxpr interpreter that reads JAX's primitive names
(``ELEMENTWISE`` and the reductions); a JAX release that renames or adds a primitive an inner
optimizer uses makes it refuse that optimizer by name (``ShardError``), never run it wrongly
(``tests/test_zero.py``). Reached only through ``accumulate(..., shard_optimizer=True)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _numerics, _vma

PyTree = Any


# --------------------------------------------------------------------------- the replicated default


class _Replicated:
  """The inner optimizer on the whole window, on every device (after one all-reduce)."""

  sharded = False

  def reduce(self, agg, grads, rest, axis_name):
    if axis_name is None:
      return grads, rest, None
    return (*agg.all_reduce(grads, rest, rest.weight_sum > 0, axis_name), None)

  def norm_and_finite(self, split, g_sum, d, scale, like, parts):
    del parts
    norm, finite = split.norm_and_finite(g_sum, d, scale)
    return norm, finite, split.fits(g_sum, d, scale, norm, like)

  def init(self, inner, params):
    return inner.init(params)

  def like(self, tree):
    return tree

  def update(self, inner, mean, inner_state, params, args):
    return inner.update(mean, inner_state, params, **args)

  def all_true(self, flag):
    return flag

  def gather(self, updates, like):
    del like
    return updates

  def local(self, params):
    return params

  def wrap(self, inner_state):
    return inner_state

  def unwrap(self, inner_state):
    return inner_state

  def whole(self, inner, inner_state, like):
    """The inner state as the inner optimizer sees it (here: the state itself)."""
    del inner, like
    return inner_state

  def check_bound(self):
    pass


REPLICATED = _Replicated()


# --------------------------------------------------------------------------- ZeRO-1


class Layout(NamedTuple):
  """How a leaf is cut: ``n`` devices over ``axis_name``, this one at ``index``; in HSDP the
  mesh's other (compiler-managed) axes ``auto`` (``k`` devices) shard each piece further."""

  n: int
  index: jax.Array
  auto: tuple[str, ...]
  k: int

  @classmethod
  def here(cls, axis_name) -> Layout:
    """The layout inside the ``shard_map`` over ``axis_name`` being traced."""
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()))
    auto = tuple(a for a in names if a not in axes)
    k = math.prod(mesh.shape[a] for a in auto) if auto else 1
    return cls(jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name), auto, k)

  def m(self, size: int) -> int:
    """Elements of a leaf of ``size`` per device: ``ceil(size / n)``, a multiple of ``k``."""
    return max(1, math.ceil(size / (self.n * self.k))) * self.k

  def constrain(self, x: jax.Array) -> jax.Array:
    """``x`` (a shard) sharded over the other axes too (HSDP: 1/replica, then 1/fsdp)."""
    if not self.auto:
      return x
    if not hasattr(jax.lax, "pcast"):  # JAX < 0.8 cannot constrain an Auto axis in shard_map
      raise ValueError(
        f"shard_optimizer=True inside a shard_map manual over some axes only (HSDP: the other "
        f"axes {self.auto} left to the compiler) needs jax >= 0.8, which can shard each piece "
        "over them too. Upgrade jax, or use shard_optimizer=False (the inner state stays "
        "sharded over those axes, replicated over the manual one)."
      )
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(self.auto))

  def slice(self, x: jax.Array) -> jax.Array:
    """This device's piece of ``x``, flattened and zero-padded: shape ``(m(size),)``."""
    m = self.m(x.size)
    flat = jnp.pad(jnp.ravel(x), (0, self.n * m - x.size))
    return self.constrain(jax.lax.dynamic_slice_in_dim(flat, self.index * m, m))


def _valid(size: int, m: int, index: jax.Array) -> jax.Array:
  """Which of this device's ``m`` shard elements are real (not padding)."""
  return index * m + jnp.arange(m) < size


class UnboundAxisError(ValueError):
  """A ZeRO-1 ``accumulate`` made or updated outside a ``shard_map`` over its ``axis_name``."""


class Sharded(NamedTuple):
  """ZeRO-1 over ``axis_name`` (``n`` devices): the inner optimizer on ``1/n`` of every leaf."""

  axis_name: Any

  sharded = True

  def init(self, inner, params):
    """The inner optimizer's state for this device's shard (its non-scalar leaves ``1/n``)."""
    self.check_bound()
    return run_on_shards(inner.init, (params,), self.axis_name, Layout.here(self.axis_name))

  def local(self, params):
    """This device's shard of each (replicated) param."""
    if params is None:
      return None
    layout = Layout.here(self.axis_name)
    return jax.tree.map(lambda p: layout.slice(p) if jnp.ndim(p) else p, params)

  def wrap(self, inner_state):
    from optax_accum._state import Shards

    return Shards(inner_state)

  def unwrap(self, inner_state):
    return inner_state.inner

  def whole(self, inner, inner_state, like):
    """The inner state's full shapes (what the inner optimizer is traced on)."""
    del inner_state
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), like)
    return jax.eval_shape(inner.init, shapes)

  def check_bound(self):
    """Raises unless the ZeRO-1 axis is bound here (``init`` and ``update`` in ``shard_map``)."""
    if not _vma.bound(self.axis_name):
      raise UnboundAxisError(
        f"accumulate(..., axis_name={self.axis_name!r}, shard_optimizer=True) keeps 1/n of the "
        "inner state on each device, so its state is made and updated inside jax.shard_map "
        "over that axis: make it with optax_accum.sharding.init_sharded(tx, params) (params "
        "placed on the mesh) and run the step inside the shard_map (docs/scaling.md, ZeRO-1)."
      )

  def reduce(self, agg, grads, rest, axis_name):
    """One reduce-scatter of the window: this device's shard of each summed leaf; then one
    scalar all-reduce of the window's other sums with the shards' squares and non-finite counts
    per leaf group (the global norm and finite check need nothing else)."""
    leaves, treedef = jax.tree.flatten(grads)
    layout = Layout.here(self.axis_name)
    pieces = [i for i, x in enumerate(leaves) if x.ndim]  # scalar leaves stay whole
    blocks = []
    for i in pieces:
      x, m = leaves[i], layout.m(leaves[i].size)
      blocks.append(jnp.pad(jnp.ravel(x), (0, layout.n * m - x.size)).reshape(layout.n, m))
    out = list(leaves)
    for i, o in zip(pieces, _reduce_scatter_by_dtype(blocks, self.axis_name), strict=True):
      out[i] = layout.constrain(o)
    split = agg.split(grads)
    sharded = lambda idx: [out[i] for i in idx if leaves[i].ndim]  # whole scalars: added later
    local = [_squares_and_bad(sharded(idx)) for idx, _ in split.groups]
    scalars = [out[i] for i, x in enumerate(leaves) if not x.ndim]
    rest, parts, scalars = jax.lax.psum((rest, local, scalars), self.axis_name)
    for i, s in zip([i for i, x in enumerate(leaves) if not x.ndim], scalars, strict=True):
      out[i] = s
    return jax.tree.unflatten(treedef, out), rest, parts

  def norm_and_finite(self, split, g_sum, d, scale, like, parts):
    """The global norm and finite check from the all-reduced parts; the fit of the mean in a
    16-bit dtype (only then) from one more scalar all-reduce."""
    sq = jnp.zeros((), _numerics.scalar_dtype())
    finite = jnp.ones((), jnp.bool_)
    leaves = jax.tree.leaves(g_sum)
    for (idx, kind), (sq_g, bad_g) in zip(split.groups, parts, strict=True):
      whole = [leaves[i] for i in idx if leaves[i].ndim == 0]  # the same on every device
      sq_w, bad_w = _squares_and_bad(whole)
      div = split._divisor(kind, d, scale).astype(sq_g.dtype)
      sq = sq + (sq_g + sq_w) / jnp.square(div)
      finite = finite & (bad_g == 0) & (bad_w == 0)
    norm = jnp.sqrt(sq)
    finite = finite & jnp.isfinite(norm)
    narrow = [
      jnp.finfo(t.dtype).max < jnp.finfo(a.dtype).max
      for t, a in zip(jax.tree.leaves(like), jax.tree.leaves(g_sum), strict=True)
    ]
    if not any(narrow):
      return norm, finite, jnp.ones((), jnp.bool_)
    mean = split.window_values(g_sum, d, scale, like)
    unfit = sum(jnp.sum(~jnp.isfinite(x)) for x in jax.tree.leaves(mean))
    return norm, finite, jax.lax.psum(unfit, self.axis_name) == 0

  def like(self, tree):
    """Shapes and dtypes of ``tree``'s leaves as this device's flat shards."""
    layout = Layout.here(self.axis_name)
    piece = lambda x: (layout.m(math.prod(x.shape)),) if len(x.shape) else ()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(piece(x), x.dtype), tree)

  def update(self, inner, mean, inner_state, params, args):
    """``inner.update`` traced on the full shapes, run on this device's shards."""
    logical = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    fn = lambda g, s, p: inner.update(g, s, p, **args)
    return run_on_shards(
      fn,
      (mean, inner_state, params),
      self.axis_name,
      Layout.here(self.axis_name),
      logical=(logical, jax.eval_shape(inner.init, logical), logical),
      pre_sharded=(True, True, False),
    )

  def all_true(self, flag):
    """``flag`` true on every device (the inner updates finite everywhere)."""
    return jax.lax.psum((~flag).astype(jnp.int32), self.axis_name) == 0

  def gather(self, updates, like):
    """One all-gather of the update shards: the full updates, the same on every device."""
    leaves, treedef = jax.tree.flatten(updates)
    targets = jax.tree.leaves(like)
    # A scalar leaf is whole on every device (but typed per device, from the per-device state):
    # its copies ride in the same all-gather, and every device takes the first.
    pieces = [jnp.reshape(x, (-1,)) for x in leaves]
    full = _all_gather_by_dtype(pieces, self.axis_name)
    out = [
      x.reshape(-1)[: math.prod(t.shape)].reshape(t.shape) if len(t.shape) else x[0]
      for x, t in zip(full, targets, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def _squares_and_bad(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """The sum of squares of the leaves' elements and how many are not finite (float scalars,
  so that both ride in the window's one all-reduce with its other float sums)."""
  dtype = _numerics.scalar_dtype()
  sq = sum((jnp.sum(jnp.square(x.astype(dtype))) for x in leaves), jnp.zeros((), dtype))
  bad = sum((jnp.sum(~jnp.isfinite(x)).astype(dtype) for x in leaves), jnp.zeros((), dtype))
  return sq, bad


def _by_dtype(blocks: list[jax.Array]) -> dict[Any, list[int]]:
  groups: dict[Any, list[int]] = {}
  for i, b in enumerate(blocks):
    groups.setdefault(jnp.dtype(b.dtype), []).append(i)
  return groups


def _reduce_scatter_by_dtype(blocks: list[jax.Array], axis_name) -> list[jax.Array]:
  """Each ``(n, k_i)`` block summed over the devices, this device's row: one reduce-scatter per
  dtype (the blocks side by side, ``tiled``)."""
  out: list[Any] = [None] * len(blocks)
  for _, idx in _by_dtype(blocks).items():
    widths = [blocks[i].shape[1] for i in idx]
    buf = jnp.concatenate([blocks[i] for i in idx], axis=1).reshape(-1)
    mine = jax.lax.psum_scatter(buf, axis_name, scatter_dimension=0, tiled=True)
    for i, part in zip(idx, jnp.split(mine, np.cumsum(widths)[:-1]), strict=True):
      out[i] = part
  return out


def _all_gather_invariant(x: jax.Array, axis_name) -> jax.Array:
  """``all_gather(tiled=True)`` typed the same on every device (``check_vma``), so the updates
  can leave ``shard_map`` with ``P()``. JAX keeps this variant in ``jax._src`` in 0.7-0.10
  (feature-detected; without it, a ``psum`` of each shard in place: twice the bytes)."""
  public = getattr(jax.lax, "all_gather_invariant", None)
  if public is None:
    from jax._src.lax import parallel

    public = getattr(parallel, "all_gather_invariant", None)
  if public is not None:
    return public(x, axis_name, tiled=True)
  n, index = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
  placed = jax.lax.dynamic_update_slice_in_dim(
    jnp.zeros((n * x.shape[0],), x.dtype), x, index * x.shape[0], 0
  )
  return jax.lax.psum(placed, axis_name)


def _all_gather_by_dtype(shards: list[jax.Array], axis_name) -> list[jax.Array]:
  """Each shard gathered over the devices, ``(n * m_i,)`` in device order: one all-gather per
  dtype."""
  n = jax.lax.axis_size(axis_name)
  out: list[Any] = [None] * len(shards)
  for _, idx in _by_dtype(shards).items():
    widths = [shards[i].shape[0] for i in idx]
    gathered = _all_gather_invariant(jnp.concatenate([shards[i] for i in idx]), axis_name)
    rows = gathered.reshape(n, sum(widths))
    for i, part in zip(idx, jnp.split(rows, np.cumsum(widths)[:-1], axis=1), strict=True):
      out[i] = part.reshape(-1)
  return out


# --------------------------------------------------------------------------- the shard evaluator


class _Shard(NamedTuple):
  """A value of full (logical) shape ``shape`` held as this device's flat shard ``data``."""

  data: jax.Array
  shape: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.shape)


ELEMENTWISE = frozenset(
  "abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj convert_element_type "
  "copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow "
  "is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real "
  "reduce_precision rem round rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan "
  "tanh xor".split()
)
# Placement annotations: the values are unchanged, and so are the shards.
_IDENTITY = frozenset({"reshard", "sharding_constraint", "mesh_cast", "optimization_barrier"})
_REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


class ShardError(TypeError):
  """The inner optimizer does something that cannot run on ``1/n`` shards."""


def run_on_shards(
  fn: Callable[..., Any],
  args: tuple,
  axis_name: Any,
  layout: Layout,
  logical: tuple | None = None,
  pre_sharded: tuple | None = None,
) -> Any:
  """``fn(*args)`` traced on the full shapes and evaluated on this device's shards.

  ``args``: trees of full arrays (``pre_sharded`` False: sliced here) or of shards already
  (True: their full shapes in ``logical``). Every non-scalar leaf is a shard; scalars are
  whole. Returns ``fn``'s output with each non-scalar leaf as this device's shard.

  Raises:
    ShardError: naming the operation, if ``fn`` moves elements between positions.
  """
  pre_sharded = pre_sharded or (False,) * len(args)
  logical = logical or tuple(
    jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), a) for a in args
  )
  closed = jax.make_jaxpr(fn)(*logical)
  flat_args = []
  for arg, shapes, done in zip(args, logical, pre_sharded, strict=True):
    for x, s in zip(jax.tree.leaves(arg), jax.tree.leaves(shapes), strict=True):
      if len(s.shape) == 0:
        flat_args.append(x)
      else:
        flat_args.append(_Shard(x if done else layout.slice(x), tuple(s.shape)))
  ctx = _Context(axis_name, layout)
  outs = ctx.eval(closed.jaxpr, closed.consts, flat_args)
  outs = [ctx.to_shard(o) if jnp.ndim(_data(o)) and not isinstance(o, _Shard) else o for o in outs]
  outs = [o.data if isinstance(o, _Shard) else o for o in outs]
  return jax.tree.unflatten(jax.tree.structure(jax.eval_shape(fn, *logical)), outs)


class _Partial(NamedTuple):
  """This device's part of a sum over all devices (``psum`` of it is the value)."""

  local: jax.Array


def _is_zero(x: Any) -> bool:
  """Whether ``x`` is a constant 0 (a literal, not a traced value)."""
  if isinstance(x, jax.core.Tracer) or isinstance(x, (_Shard, _Partial)):
    return False
  try:
    return bool(np.all(np.asarray(x) == 0))
  except (TypeError, ValueError):
    return False


def _data(x: Any) -> Any:
  return x.data if isinstance(x, _Shard) else x


def _agree(values: list[Any]) -> list[Any]:
  """Operands typed alike for a primitive's ``bind`` under ``shard_map(check_vma=True)``: each
  varying over every axis any of them varies over (``jnp`` does this itself; ``bind`` not)."""
  axes = frozenset().union(*(_vma.varying(x) for x in values if isinstance(x, jax.Array)))
  if not axes:
    return values
  return [_vma.vary(jnp.asarray(x), axes) if _is_array_like(x) else x for x in values]


def _is_array_like(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool))


def _bind_params(eqn) -> tuple[list, dict]:
  """``(subfuns, params)`` to bind ``eqn`` again: JAX < 0.8 returns both, later the params."""
  out = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], list):
    return out
  return [], out


class _Context(NamedTuple):
  axis_name: Any
  layout: Layout

  def to_shard(self, x: jax.Array, shape: tuple[int, ...] | None = None) -> _Shard:
    """A whole (replicated) value as this device's shard of it."""
    x = jnp.asarray(x)
    if shape is not None and tuple(x.shape) != tuple(shape):
      x = jnp.broadcast_to(x, shape)
    return _Shard(self.layout.slice(x), tuple(x.shape))

  def eval(self, jaxpr, consts, args) -> list[Any]:
    from jax.extend.core import Literal

    env: dict[Any, Any] = {}
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    for v, c in zip(jaxpr.constvars, consts, strict=True):
      env[v] = c
    for v, a in zip(jaxpr.invars, args, strict=True):
      env[v] = a
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      partial = self.keep_partial(eqn, ins)
      if partial is not None:
        env[eqn.outvars[0]] = partial
        continue
      ins = [self.total(x) for x in ins]
      if any(isinstance(x, _Shard) for x in ins):
        outs = self.rule(eqn, ins)
      else:
        subfuns, params = _bind_params(eqn)
        outs = eqn.primitive.bind(*subfuns, *_agree(ins), **params)
      outs = outs if eqn.primitive.multiple_results else [outs]
      for v, o in zip(eqn.outvars, outs, strict=True):
        env[v] = o
    return [self.total(read(v)) for v in jaxpr.outvars]

  def keep_partial(self, eqn, ins: list[Any]) -> _Partial | None:
    """Sums of per-device partial sums stay partial (``psum(a) + psum(b) = psum(a + b)``): a
    global norm over many leaves costs one scalar all-reduce. Adding a literal 0 keeps one too;
    a cast keeps one (its rounding then applies before the sum over devices)."""
    if not any(isinstance(x, _Partial) for x in ins):
      return None
    name = eqn.primitive.name
    if name == "add" and all(isinstance(x, _Partial) or _is_zero(x) for x in ins):
      parts = [x.local for x in ins if isinstance(x, _Partial)]
      dtype = eqn.outvars[0].aval.dtype
      return _Partial(sum((p.astype(dtype) for p in parts[1:]), parts[0].astype(dtype)))
    if name == "convert_element_type":
      return _Partial(ins[0].local.astype(eqn.params["new_dtype"]))
    return None

  def total(self, x: Any) -> Any:
    """A partial sum's value: one ``psum`` over the devices."""
    return jax.lax.psum(x.local, self.axis_name) if isinstance(x, _Partial) else x

  def rule(self, eqn, ins: list[Any]) -> Any:
    """One equation with a sharded operand."""
    name = eqn.primitive.name
    sub = next((eqn.params[k] for k in _CALLS if k in eqn.params), None)
    if sub is not None and eqn.primitive.multiple_results:  # jit, custom_jvp/vjp, remat
      jaxpr = getattr(sub, "jaxpr", sub)
      return self.eval(jaxpr, getattr(sub, "consts", ()), ins)
    if name in ELEMENTWISE:
      shape = next(x.shape for x in ins if isinstance(x, _Shard))
      data = _agree([self._operand(x, shape, name) for x in ins])
      out = eqn.primitive.bind(*data, **eqn.params)
      return _Shard(out, shape)
    if name in _IDENTITY and len(ins) == 1:
      return ins[0]
    if name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims"):
      (x, *rest) = ins
      new_shape = tuple(eqn.outvars[0].aval.shape)
      if name == "reshape" and eqn.params.get("dimensions") is not None:
        raise self._refuse(name, "reorders the elements")
      if name == "broadcast_in_dim" and math.prod(new_shape) != x.size:
        raise self._refuse(name, "broadcasts a leaf to a larger shape")
      return _Shard(x.data, new_shape)  # row-major order kept: the same flat shard
    if name in _REDUCTIONS:
      (x,) = ins
      if sorted(eqn.params["axes"]) != list(range(len(x.shape))):
        raise self._refuse(name, "reduces over some axes of a leaf (a factored statistic)")
      return self._reduce(_REDUCTIONS[name], x)
    if name == "dot_general" and all(isinstance(x, _Shard) for x in ins):  # a full vdot
      a, b = ins
      (ca, cb), (ba, bb) = eqn.params["dimension_numbers"]
      full = list(range(len(a.shape)))
      if a.shape == b.shape and sorted(ca) == full == sorted(cb) and not ba and not bb:
        prod = a.data.astype(eqn.outvars[0].aval.dtype) * b.data.astype(eqn.outvars[0].aval.dtype)
        return self._reduce("sum", _Shard(prod, a.shape))
    raise self._refuse(name, "moves elements between positions of a leaf")

  def _operand(self, x: Any, shape: tuple[int, ...], name: str) -> Any:
    if isinstance(x, _Shard):
      if x.shape != shape:
        raise self._refuse(name, f"combines leaves of shapes {x.shape} and {shape}")
      return x.data
    if jnp.ndim(x) == 0:
      return x
    if tuple(jnp.shape(x)) == shape:
      return self.to_shard(x).data
    raise self._refuse(name, f"combines a leaf of shape {shape} with one of {jnp.shape(x)}")

  def _reduce(self, kind: str, x: _Shard) -> Any:
    """A reduction over every element of ``x``: over the shard's real elements, then across the
    devices (a sum stays a partial sum until it is used)."""
    m = x.data.shape[0]
    valid = _valid(x.size, m, self.layout.index)
    dtype = x.data.dtype
    if kind == "sum":
      return _Partial(jnp.sum(jnp.where(valid, x.data, jnp.zeros((), dtype))))
    fill = jnp.finfo(dtype).min if kind == "max" else jnp.finfo(dtype).max
    if not jnp.issubdtype(dtype, jnp.floating):
      fill = jnp.iinfo(dtype).min if kind == "max" else jnp.iinfo(dtype).max
    reduce = jnp.max if kind == "max" else jnp.min
    local = reduce(jnp.where(valid, x.data, jnp.asarray(fill, dtype)))
    collective = jax.lax.pmax if kind == "max" else jax.lax.pmin
    return collective(local, self.axis_name)

  def _refuse(self, name: str, what: str) -> ShardError:
    return ShardError(
      f"accumulate(..., shard_optimizer=True) runs the inner optimizer on 1/{self.layout.n} of "
      f"each leaf, but it applies {name!r}, which {what}: it cannot run on shards (factored "
      "adafactor and muon, for example). Use shard_optimizer=False for this inner optimizer "
      "(every device then runs it on the whole window), or one that treats elements "
      "independently (adam, adamw, sgd, lion) with global norms (clip_by_global_norm)."
    )


def check_config(shard_optimizer: Any, axis_name: Any, aggregation: Any) -> Any:
  """The placement of ``accumulate(shard_optimizer=...)``, checked: REPLICATED or Sharded."""
  if not isinstance(shard_optimizer, (bool, np.bool_)):
    raise TypeError(f"shard_optimizer must be True or False, got {shard_optimizer!r}.")
  if not shard_optimizer:
    return REPLICATED
  if axis_name is None:
    raise ValueError(
      "shard_optimizer=True shards the inner optimizer over the devices of a shard_map axis, "
      "but accumulate has no axis_name. Pass accumulate(inner, every_k, axis_name='data', "
      "shard_optimizer=True) and run the step inside jax.shard_map over that axis "
      "(docs/scaling.md, ZeRO-1)."
    )
  if aggregation.reduce is not None or not aggregation.overwrite:
    raise ValueError(
      "shard_optimizer=True supports the weighted mean and a fixed denominator; per-leaf rules "
      "(aggregate(reduce=...)) are not sharded. Use shard_optimizer=False with them."
    )
  return Sharded(axis_name)
