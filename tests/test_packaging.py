"""`pip install trainyard` puts one package into a user's environment: trainyard, with the service
and the workers inside it; no generic top-level `app` or `worker` to shadow (or be shadowed by) theirs."""
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tests.service import ROOT

pytestmark = pytest.mark.slow


def test_a_plain_install_holds_only_the_trainyard_package(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheel"), str(ROOT)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("trainyard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert "trainyard" in tops and all(t == "trainyard" or t.endswith(".dist-info") for t in tops), tops
    assert "trainyard/app/spec.py" in names and "trainyard/worker/train.py" in names
    assert "trainyard/app/api/static/index.html" in names and "trainyard/worker/datasets/iris.csv" in names

    # A fresh environment: the wheel, and this one's dependencies seen through a .pth (whose own
    # editable hook, a .pth inside it, is not run: .pth files are read only in site directories).
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir)}))
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # --ignore-installed: without it, pip run from this environment uninstalls this environment's own
    # (editable) trainyard while installing into --prefix.
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q",
                                "--prefix", str(env_dir), str(wheel)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    python = env_dir / "bin" / "python"

    def run(*args):
        return subprocess.run([str(python), *args], cwd=empty, capture_output=True, text=True)

    for generic in ("app", "worker"):
        r = run("-c", f"import {generic}")
        assert r.returncode != 0 and f"No module named '{generic}'" in r.stderr
    r = run("-c", "import trainyard, trainyard.app.spec; from trainyard import APIError, Client; "
                  "print(trainyard.app.spec.__file__)")
    assert r.returncode == 0 and r.stdout.startswith(str(site)), r.stderr
    cli = run(str(env_dir / "bin" / "trainyard"), "--help")  # the console script, with this environment's python
    assert cli.returncode == 0 and "submit" in cli.stdout, cli.stderr
    # The migrations travel in the wheel: an installed trainyard builds its database from them.
    db = run(str(env_dir / "bin" / "trainyard"), "db", "upgrade")
    assert db.returncode == 0 and "database schema: empty -> " in db.stdout, db.stderr
    # ...and the environment running these tests still has its own trainyard.
    here = subprocess.run([sys.executable, "-c", "import trainyard.app.spec"], cwd=empty, capture_output=True, text=True)
    assert here.returncode == 0, here.stderr
