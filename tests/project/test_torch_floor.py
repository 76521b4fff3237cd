"""The worker on the oldest torch the worker extra allows (issue 38): a host keeps its own torch when it fits
the range, so the range's floor must be one the worker really works with.

`make test` builds .venv/torch-floor with that torch (TORCH_FLOOR in the Makefile) and the project around it.
This test runs the worker's own tests there, in a pytest of that venv's Python: each starts its real server and
workers with it, so a built-in training job, a `run` job of the example plugin, a checkpoint resume after a
SIGKILL and the exports (ONNX, torch.export, TorchScript, which the server makes in a process of its Python)
all run on the floor's torch and torchvision.
"""
import os
import subprocess
import tomllib

import pytest
from packaging.requirements import Requirement

from tests.helpers.service import ROOT

pytestmark = pytest.mark.slow

FLOOR = ROOT / ".venv" / "torch-floor" / "bin" / "python"
# Where torch's version shows: training, compile, checkpoints and resume, the exports. Not the bucket's or the
# README's export tests, which add nothing of torch's to the same exports (the suite runs them on today's torch).
SKIP = "not bucket and not readme"
CASES = [
    "tests/worker/test_train.py",
    "tests/jobs/test_export.py",
    "tests/jobs/test_reliability.py::test_sigkill_worker_job_resumes_on_another_worker[sqlite]",
    "tests/worker/test_plugins.py::test_a_run_job_reports_checkpoints_saves_a_model_and_the_client_drives_it",
    "tests/worker/test_plugins.py::test_a_run_job_sigkilled_mid_run_resumes_from_restore_on_another_worker",
]


def worker_extra() -> dict[str, Requirement]:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["worker"]
    return {r.name: r for r in map(Requirement, extra)}


def test_the_worker_passes_its_tests_on_the_declared_torch_floor():
    if not FLOOR.exists():
        pytest.skip(f"no {FLOOR.parent.parent} (make test builds it)")
    found = subprocess.run([str(FLOOR), "-c", "import torch, torchvision; print(torch.__version__.split('+')[0], "
                            "torchvision.__version__.split('+')[0])"], capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    torch_version, vision_version = found.stdout.split()
    wanted = worker_extra()
    # The venv holds the floor itself: in the range, and at its lowest minor release.
    assert wanted["torch"].specifier.contains(torch_version)
    assert wanted["torchvision"].specifier.contains(vision_version)
    floor = next(s.version for s in wanted["torch"].specifier if s.operator == ">=")
    assert torch_version.startswith(floor + "."), (torch_version, floor)
    # Nothing of this run's pytest (xdist's worker variables, its plugins' settings) reaches the inner one.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TRAINYARD_"))}
    run = subprocess.run([str(FLOOR), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-k", SKIP, *CASES], cwd=ROOT, capture_output=True, text=True, env=env, timeout=1500)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-500:]
