"""Tests of the demo's memory planning (optax_accum/demo/plan.py) and its command line."""

import dataclasses
import math
import re
import subprocess
import sys

import _xla
import pytest

from optax_accum import _planning as planning
from optax_accum.__main__ import main
from optax_accum.demo import plan
from optax_accum.demo.setup import QUICK, DemoConfig

TINY = DemoConfig(microbatch_size=16, every_k=4, seq_len=8, dim=8, depth=1, heads=2)


@pytest.mark.slow  # compiles the demo's train step 9 times
def test_transformer_plan_equals_exhaustive_scan():
  step, make_args = plan.step_and_args(TINY)
  sizes = [1, 4, 16, 64, 256]
  exhaustive = {s: planning.compiled_peak_bytes(step, *make_args(s)) for s in sizes}
  values = [exhaustive[s] for s in sizes]
  assert values == sorted(values)
  # The logits alone: rows x seq_len x 256 float32, counted at least once per row.
  assert values[-1] - values[0] >= 255 * 8 * 256 * 4
  budget = (exhaustive[16] + exhaustive[64]) // 2
  p = planning.plan_microbatch(step, make_args, memory_budget=budget, sizes=sizes)
  assert p.size == max(s for s in sizes if exhaustive[s] <= budget) == 16
  assert p.peak_bytes == exhaustive[16] <= budget < exhaustive[64]
  assert p.measured == {s: exhaustive[s] for s in p.measured}
  assert p.num_compilations <= math.log2(len(sizes)) + 2


@pytest.mark.slow  # compiles the demo's train step about 6 times
def test_plan_config_keeps_the_window():
  step, make_args = plan.step_and_args(TINY)
  budget = planning.compiled_peak_bytes(step, *make_args(8)) + 1000
  config, line = plan.plan_config(TINY, str(budget))
  # Divisors of the 64-line window: 8 fits (by construction), 16 does not.
  assert planning.compiled_peak_bytes(step, *make_args(16)) > budget
  assert (config.microbatch_size, config.every_k) == (8, 8)
  assert dataclasses.replace(config, microbatch_size=16, every_k=4) == TINY
  assert "microbatch_size=8 every_k=8 (window of 64 lines kept)" in line


def test_cli_rejects_an_unreadable_budget(capsys):
  with pytest.raises(SystemExit) as e:
    main(["demo", "--quick", "--memory-budget", "lots"])
  assert e.value.code == 2
  assert "--memory-budget lots: Cannot read the memory size 'lots'" in capsys.readouterr().err


@pytest.mark.slow  # compiles the demo's train step about 6 times
def test_cli_refuses_a_microbatch_the_machine_cannot_hold():
  # Today's demo pads the epoch to 10^8 rows and is killed by the kernel; now it stops first.
  # A process of its own with XLA's default emitters: the classic ones the tests compile with
  # do not implement the 10^8-row program's scatter (tests/_xla.py).
  cmd = [sys.executable, "-m", "optax_accum", "demo", "--quick", "--microbatch-size", "100000000"]
  proc = subprocess.run(
    [*cmd, "--no-progress"],
    env=_xla.env(codegen=False),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 2 and proc.stdout == ""  # nothing trained, nothing but the refusal
  match = re.search(r"the largest that fits is --microbatch-size (\d+)", proc.stderr)
  assert match and "--microbatch-size 100000000 needs" in proc.stderr
  largest = int(match.group(1))
  budget, _ = plan.machine_budget()
  step, make_args = plan.step_and_args(dataclasses.replace(QUICK, microbatch_size=largest))
  assert planning.compiled_peak_bytes(step, *make_args(largest)) <= budget
  assert planning.compiled_peak_bytes(step, *make_args(largest + 1)) > budget


def test_machine_budget_on_cpu_is_a_fraction_of_ram():
  import os

  budget, source = plan.machine_budget()
  ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  assert budget == int(ram * 0.8) and "80% of this machine's" in source
