"""trainyard installed as users install it: from the built wheel (and sdist), into Pythons other than the
checkout's, without torch (issue 38).

`make test` prepares a venv for each of Python 3.12 and 3.13 under .venv/pythons holding the project's base
dependencies only (the Makefile's OTHER_PYTHONS). Each test installs the wheel built from this checkout into one,
then runs what a laptop or a small API host runs from it, far from the checkout: the server (migrations, the
dashboard's files), the CLI and the Client, while a worker of the project's own venv (torch) runs the job.
"""
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement

from tests.helpers.jobs import tiny_job
from tests.helpers.service import ROOT, Service
from trainyard.app.client.http import tls

pytestmark = pytest.mark.slow

PYTHONS = ROOT / ".venv" / "pythons"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(ROOT)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (found,) = out.glob("trainyard-*.whl")
    return found


def other_python(version: str) -> Path:
    python = PYTHONS / version / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no Python {version} venv at {python.parent.parent} (make test makes it where pyenv or PATH "
                    f"has python{version})")
    return python


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything that would lead a process back to the checkout or its venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "PYTHON", "VIRTUAL_ENV"))}
    return {**env, **extra}


def test_the_wheel_and_the_sdist_carry_what_a_checkout_provides(wheel, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    for part in ("trainyard/app/api/static/index.html", "trainyard/worker/datasets/iris.csv",
                 "trainyard/app/db/migrations/script.py.mako", "trainyard/app/core/operator_token.py"):
        assert part in names, part
    assert any(n.startswith("trainyard/app/db/migrations/versions/") for n in names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta and "Requires-Python: >=3.11" in meta
    assert "Classifier: Programming Language :: Python :: 3.13" in meta
    requires = [Requirement(line.split(":", 1)[1]) for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    # torch only through the worker extra: pip keeps a host's own torch (2.9 on), and a server host needs none.
    base = {r.name for r in requires if r.marker is None}
    assert not base & {"torch", "torchvision", "safetensors"}, base
    (torch,) = [r for r in requires if r.name == "torch" and r.marker and r.marker.evaluate({"extra": "worker"})]
    assert torch.specifier.contains("2.9.1") and torch.specifier.contains("2.14.1")
    assert not torch.specifier.contains("2.8.0")
    # The sdist (PEP 517's hook, as `python -m build --sdist` calls it) builds the same wheel on its own.
    sdist = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path)], cwd=ROOT,
                           capture_output=True, text=True)
    assert sdist.returncode == 0, sdist.stderr
    archive = tmp_path / sdist.stdout.strip().splitlines()[-1]
    with tarfile.open(archive) as tar:
        members = tar.getnames()
        assert any(m.endswith("/LICENSE") for m in members)
        tar.extractall(tmp_path / "src", filter="data")
    (src,) = (tmp_path / "src").iterdir()
    again = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "from-sdist"), str(src)], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    (rebuilt,) = (tmp_path / "from-sdist").glob("trainyard-*.whl")
    assert set(zipfile.ZipFile(rebuilt).namelist()) == names


@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_server_cli_and_client_run_from_the_wheel_without_torch(wheel, tmp_path, version):
    python = other_python(version)
    env_dir = tmp_path / "venv"
    made = subprocess.run([str(python), "-m", "venv", "--system-site-packages", str(env_dir)], capture_output=True,
                          text=True)
    assert made.returncode == 0, made.stderr
    # --system-site-packages over the prepared venv: its base dependencies are there, and nothing else (no torch).
    (env_dir / "lib" / f"python{version}" / "site-packages" / "deps.pth").write_text(
        str(PYTHONS / version / "lib" / f"python{version}" / "site-packages") + "\n")
    bin_dir = env_dir / "bin"
    away = tmp_path / "elsewhere"
    away.mkdir()

    def run(*args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), cwd=away, capture_output=True, text=True, env=kw.pop("env", clean_env()),
                              timeout=300, **kw)

    installed = run(str(bin_dir / "pip"), "install", "--quiet", "--disable-pip-version-check", str(wheel))
    assert installed.returncode == 0, installed.stdout + installed.stderr
    no_torch = run(str(bin_dir / "python"), "-c", "import torch")
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    version_line = run(str(bin_dir / "trainyard"), "--version")
    assert version_line.returncode == 0 and version_line.stdout.startswith("trainyard 0."), version_line.stderr
    worker = run(str(bin_dir / "trainyard"), "worker", "--device", "cpu")
    assert worker.returncode != 0 and "pip install 'trainyard[worker]'" in worker.stderr, worker.stderr

    # The server from the wheel (its migrations build the database), a worker of the project's own venv.
    svc = Service(tmp_path / "data")
    server_env = clean_env(**{k: v for k, v in svc.env.items() if k.startswith("TRAINYARD_")})
    log = open(tmp_path / "server.out", "wb")
    server = subprocess.Popen([str(bin_dir / "trainyard"), "serve", "--port", str(svc.port)], cwd=away,
                              env=server_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        svc.wait_until(lambda: server.poll() is None and _answers(svc.url), 60, "the wheel's server")
        page = httpx.get(f"{svc.url}/", timeout=10)
        assert page.status_code == 200 and "<html" in page.text.lower()
        svc.start_worker("cpu")
        # The client and the CLI from the wheel, in processes that would fail on an import of torch: it is absent.
        client = run(str(bin_dir / "python"), "-c", CLIENT_SCRIPT, env=server_env)
        assert client.returncode == 0, client.stdout + client.stderr + svc.output()
        assert client.stdout.split() == ["succeeded", "False"], client.stdout
        listed = run(str(bin_dir / "trainyard"), "jobs", env=server_env)
        assert listed.returncode == 0 and "succeeded" in listed.stdout, listed.stdout + listed.stderr
    finally:
        server.terminate()
        server.wait(30)
        log.close()
        svc.stop()
    assert "Traceback" not in (tmp_path / "server.out").read_text()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1, verify=tls()).status_code == 200
    except httpx.TransportError:
        return False


CLIENT_SCRIPT = f"""
import sys
from trainyard import Client
with Client() as c:
    job = c.jobs.submit({tiny_job()!r})
    done = c.jobs.wait(job.id, timeout=120)
print(done.state, "torch" in sys.modules)
"""
