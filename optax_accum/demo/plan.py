"""The demo's memory planning: ``--memory-budget`` and the check of ``--microbatch-size``.

Both compile the demo's own train step (:func:`optax_accum.demo.train`'s, with
the optimizer state donated) for abstract arguments and read its bytes with
``compiled_peak_bytes``; nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import optax_accum
import optax_accum.flax
from optax_accum import _planning as planning
from optax_accum.demo.setup import DemoConfig, make_inner, make_model

RAM_FRACTION = 0.8
"""Share of the machine's physical RAM a CPU step may take (the rest: the OS, the data, Python)."""


def step_and_args(config: DemoConfig) -> tuple[Callable[..., Any], Callable[[int], tuple]]:
  """The demo's jitted train step and ``make_args(size)`` giving its abstract arguments.

  Args:
    config: the model and optimizer sizes (``microbatch_size`` is not used).

  Returns:
    ``(step, make_args)`` for :func:`optax_accum.plan_microbatch`: ``step`` is
    the training loop's step; ``make_args(size)`` returns ``(state, batch,
    flush)`` as ``jax.ShapeDtypeStruct`` trees for a microbatch of ``size`` lines.

  Examples:
    >>> cfg = DemoConfig(seq_len=8, dim=8, depth=1, heads=2)
    >>> step, make_args = step_and_args(cfg)
    >>> make_args(3)[1]['inputs']
    ShapeDtypeStruct(shape=(3, 8), dtype=int32)
  """
  from optax_accum.demo.train import _make_step  # the loop's own step

  def build():
    model = make_model(config)
    tx = optax_accum.accumulate(make_inner(config), config.every_k)
    return model, optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)

  graphdef, state = nnx.split(nnx.eval_shape(build))
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)

  def make_args(size: int) -> tuple:
    rows = (size, config.seq_len)
    batch = {
      "inputs": jax.ShapeDtypeStruct(rows, jnp.int32),
      "targets": jax.ShapeDtypeStruct(rows, jnp.int32),
      "mask": jax.ShapeDtypeStruct(rows, jnp.float32),
    }
    return state, batch, jax.ShapeDtypeStruct((), jnp.bool_)

  return _make_step(graphdef), make_args


def machine_budget() -> tuple[int, str]:
  """The bytes one demo step may use here, and where the number comes from.

  On an accelerator: ``default_budget`` (its
  ``bytes_limit`` less the safety margin). On CPU, which reports no limit:
  :data:`RAM_FRACTION` of the physical RAM
  (``os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')``).

  Examples:
    >>> budget, source = machine_budget()
    >>> budget > 0
    True
  """
  try:
    return planning.default_budget(), f"{jax.devices()[0].device_kind} memory limit less 10%"
  except ValueError:
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(ram * RAM_FRACTION), f"{RAM_FRACTION:.0%} of this machine's {_gb(ram)} of RAM"


def _gb(n: float) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def plan_config(config: DemoConfig, memory_budget: str) -> tuple[DemoConfig, str]:
  """Plans ``--memory-budget``: the largest microbatch of the same window that fits.

  Keeps the effective batch ``microbatch_size * every_k``: the candidates are
  its divisors, and :meth:`MicrobatchPlan.microbatches_for` gives the new
  ``microbatch_size`` and ``every_k``.

  Args:
    config: the run's configuration.
    memory_budget: bytes for the compiled step, e.g. ``"200MB"``.

  Returns:
    ``(config, line)``: the configuration with the planned sizes, and a line to print.

  Raises:
    ValueError: for an unreadable budget, or one that not even 1 line per microbatch fits.

  Examples:
    >>> cfg = DemoConfig(microbatch_size=4, every_k=2, seq_len=8, dim=8, depth=1, heads=2)
    >>> new, line = plan_config(cfg, "10MB")  # doctest: +SKIP
    >>> new.microbatch_size * new.every_k  # doctest: +SKIP
    8
  """
  step, make_args = step_and_args(config)
  global_batch = config.microbatch_size * config.every_k
  plan = planning.plan_microbatch(
    step, make_args, memory_budget=memory_budget, sizes=_divisors(global_batch)
  )
  split = plan.microbatches_for(global_batch)
  config = dataclasses.replace(config, microbatch_size=split.microbatch_size, every_k=split.every_k)
  line = (
    f"memory plan: microbatch_size={split.microbatch_size} every_k={split.every_k} (window of "
    f"{global_batch} lines kept); the compiled step needs {_gb(plan.peak_bytes)} of the "
    f"{_gb(plan.budget)} budget (about {_gb(plan.fixed_bytes)} + {plan.bytes_per_row / 1e3:.0f} kB "
    f"per line; {plan.num_compilations} compilations for {plan.num_candidates} candidates)"
  )
  return config, line


def check_fits(config: DemoConfig, budget: int | None = None) -> str | None:
  """Refuses, before anything is allocated, a microbatch the machine cannot hold.

  Args:
    config: the run's configuration.
    budget: bytes; default :func:`machine_budget`.

  Returns:
    ``None`` when the step at ``config.microbatch_size`` fits; otherwise the
    message to print, with the largest microbatch size that fits.

  Examples:
    >>> cfg = DemoConfig(microbatch_size=1000, seq_len=8, dim=8, depth=1, heads=2)
    >>> print(check_fits(cfg, budget=5_000_000))  # doctest: +SKIP
    --microbatch-size 1000 needs 35.4 MB for the compiled train step, more than 5.0 MB
    (the given budget); the largest that fits is --microbatch-size 146 (5.0 MB), or plan
    one with --memory-budget.
  """
  budget, source = (budget, "the given budget") if budget else machine_budget()
  step, make_args = step_and_args(config)
  size = config.microbatch_size
  needed = planning.compiled_peak_bytes(step, *make_args(size))
  if needed <= budget:
    return None
  head = (
    f"--microbatch-size {size} needs {_gb(needed)} for the compiled train step, more than "
    f"{_gb(budget)} ({source})"
  )
  try:
    plan = planning.plan_microbatch(
      step, make_args, memory_budget=budget, sizes=range(1, size + 1), known={size: needed}
    )
  except ValueError:
    return f"{head}; not even 1 line fits: use a smaller model or --seq-len."
  return (
    f"{head}; the largest that fits is --microbatch-size {plan.size} ({_gb(plan.peak_bytes)}), "
    "or plan one with --memory-budget."
  )
