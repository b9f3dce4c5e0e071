"""JAX and Flax APIs that older supported versions spell differently, by feature detection."""

import functools
import inspect

import jax
import jax.experimental
import pytest
from jax.sharding import PartitionSpec as P

# `jax.set_mesh` exists since JAX 0.7.1; `jax.sharding.use_mesh` before it.
set_mesh = jax.set_mesh if hasattr(jax, "set_mesh") else jax.sharding.use_mesh
# `jax.enable_x64` exists since JAX 0.8; `jax.experimental.enable_x64` before it.
enable_x64 = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64


# XLA before JAX 0.10 keeps one gradient-sized temporary in the fused step (measured with
# tests/test_buffers.py on 0.7.0, 0.8.3 and 0.9.2: 264,400 bytes for 262,144 bytes of params);
# from 0.10 it writes the inner optimizer's output in place. (A version tuple, not a string.)
FUSED_STEP_IN_PLACE = jax.__version_info__ >= (0, 10)


def requires(module, name: str, since: str) -> pytest.MarkDecorator:
  """Skips a test where ``module`` lacks ``name`` (a feature added in ``since``).

  Example: ``@_compat.requires(jax.lax, "pcast", "JAX 0.8")``.
  """
  return pytest.mark.skipif(
    not hasattr(module, name), reason=f"needs {module.__name__}.{name} ({since} or newer)"
  )


def pcast_varying(x, axes):
  """``jax.lax.pcast(x, axes, to="varying")``; ``jax.lax.pvary`` on JAX < 0.8 (no ``pcast``)."""
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axes, to="varying")
  return jax.lax.pvary(x, axes)


def make_mesh(shape, names, **kwargs):
  """``jax.make_mesh`` with Explicit axes unless told (the default since JAX 0.9; 0.8 warns)."""
  kwargs.setdefault("axis_types", (jax.sharding.AxisType.Explicit,) * len(names))
  return jax.make_mesh(shape, names, **kwargs)


def merge_copy_kwargs() -> dict:
  """``{'copy': True}`` where ``nnx.merge`` has it (older Flax always makes fresh Variables)."""
  from flax import nnx

  return {"copy": True} if "copy" in inspect.signature(nnx.merge).parameters else {}


def one_psum(n: int) -> dict[str, int]:
  """The collectives of one ``psum`` of ``n`` arrays, as ``count_collectives`` counts them."""
  return {"all-reduce": all_reduces_per_psum(n)}


@functools.cache
def all_reduces_per_psum(n: int) -> int:
  """How many all-reduces one ``psum`` of ``n`` arrays compiles to: 1, or ``n`` on JAX 0.7."""
  from optax_accum import testing

  d = len(jax.devices())
  mesh = make_mesh((d,), ("probe",), axis_types=(jax.sharding.AxisType.Auto,))
  f = lambda *xs: jax.lax.psum(xs, "probe")
  f = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("probe"), out_specs=P()))
  text = f.lower(*[jax.numpy.ones((d, k + 1)) for k in range(n)]).compile().as_text()
  return testing.count_collectives(text)["outside"]["all-reduce"]
