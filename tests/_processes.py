"""Two (or more) JAX processes on localhost for the multi-process tests (gloo CPU collectives)."""

import pathlib
import socket
import subprocess
import sys

import _xla


def free_port() -> int:
  """A free TCP port on 127.0.0.1 for ``jax.distributed``'s coordinator."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_workers(tmp_path: pathlib.Path, source: str, n: int, devices: int, timeout_s: float,
                extra: tuple[str, ...] = ()) -> list[pathlib.Path]:  # fmt: skip
  """Runs ``source`` as ``n`` processes, ``python worker.py PID PORT OUT *extra``, each with
  ``devices`` CPU devices; returns their ``OUT`` paths. Fails with a process's log if it does."""
  script = tmp_path / "worker.py"
  script.write_text(source)
  env = _xla.env(devices)
  port = str(free_port())
  outs = [tmp_path / f"out{pid}.npz" for pid in range(n)]
  procs = [
    subprocess.Popen(
      [sys.executable, str(script), str(pid), port, str(outs[pid]), *extra],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for pid in range(n)
  ]
  logs = []
  try:
    for proc in procs:
      logs.append(proc.communicate(timeout=timeout_s)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  for proc, log in zip(procs, logs, strict=True):
    assert proc.returncode == 0, log[-3000:]
  return outs
