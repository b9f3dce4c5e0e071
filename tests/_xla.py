"""The XLA flags every test process compiles with: its fake CPU devices and the CPU code generator.

XLA:CPU of jaxlib 0.10 generates each fused kernel with its MLIR fusion emitters; compiling is
most of the suite's time (about 70% on test_step, test_accumulate and test_nonfinite), and with
the classic emitters (``--xla_cpu_use_fusion_emitters=false``) that backend compile time is 22 s
instead of 48 s (on jaxlib 0.7 the flag changes nothing measurable). The tests therefore ask for
the classic emitters. Only the generation of kernel
code changes: the HLO passes (fusion, copy insertion, buffer assignment) and so the compiled
memory the tests assert are the same, and the large reduce that drops a NaN on today's jaxlib
drops it with either emitter, so the non-finite tests keep leaves of 4,096 elements and more
(test_nonfinite.py). The benchmarks' own runs (``python benchmarks/...``) use XLA's defaults,
what a user compiles with; a jaxlib this list has not seen gets the defaults too, since XLA
aborts on a flag it does not know. One program the tests compile needs the default emitters: the
demo's refusal of a 10^8-row microbatch, whose scatter of more than 2**31 indices the classic
emitters do not implement (test_demo_plan.py runs that command with ``codegen=False``).
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

CODEGEN = "--xla_cpu_use_fusion_emitters=false"
_CHECKED = ((0, 7), (0, 11))  # jaxlib releases known to take CODEGEN: 0.7 to 0.10


def _takes_codegen() -> bool:
  try:
    version = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return False
  major_minor = tuple(int(p) for p in version.split(".")[:2])
  return _CHECKED[0] <= major_minor < _CHECKED[1]


def flags(devices: int = 1, codegen: bool = True) -> str:
  """``XLA_FLAGS`` for a test process with ``devices`` fake CPU devices (1: as a user runs),
  with :data:`CODEGEN` unless ``codegen=False`` (XLA's default emitters, as a user compiles)."""
  parts = [f"--xla_force_host_platform_device_count={devices}"] if devices > 1 else []
  if codegen and _takes_codegen():
    parts.append(CODEGEN)
  return " ".join(parts)


def env(
  devices: int = 1, base: dict[str, str] | None = None, codegen: bool = True, **extra: Any
) -> dict[str, str]:
  """A subprocess environment: ``base`` (default ``os.environ``) on the CPU with
  :func:`flags`, plus ``extra``."""
  out = dict(os.environ if base is None else base)
  out.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags(devices, codegen), **extra)
  return out
