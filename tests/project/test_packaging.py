"""`pip install trainyard` puts one package into a user's environment: trainyard, with the service
and the workers inside it; no generic top-level `app` or `worker` to shadow (or be shadowed by) theirs."""
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.service import ROOT
from trainyard.app.cli import gpu_check

pytestmark = pytest.mark.slow


def test_a_plain_install_holds_only_the_trainyard_package(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheel"), str(ROOT)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("trainyard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert "trainyard" in tops and all(t == "trainyard" or t.endswith(".dist-info") for t in tops), tops
    assert "trainyard/app/spec/__init__.py" in names and "trainyard/worker/train.py" in names
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
    # The image's layout for `gpu-check`: tests/ and bench/ beside the environment (Dockerfile.gpu copies
    # them there), found by the installed command and collected from there against the installed package.
    checks = env_dir / gpu_check.SHARE
    for part in ("tests", "bench"):
        shutil.copytree(ROOT / part, checks / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", checks)
    r = run(str(env_dir / "bin" / "trainyard"), "gpu-check", "--device", "cpu", "--only", "cuda-tests")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"| tests from | {checks} |" in r.stdout
    found = r"\| CUDA-marked tests \(pytest -m cuda\) \| passed \| [1-9]\d*/\d+ tests? collected"
    assert re.search(found, r.stdout), r.stdout
    # ...and the environment running these tests still has its own trainyard.
    here = subprocess.run([sys.executable, "-c", "import trainyard.app.spec"], cwd=empty, capture_output=True,
                          text=True)
    assert here.returncode == 0, here.stderr


# Run in a process of its own: every module of a distribution the image lacks fails to import, then pytest
# collects the CUDA-marked tests as `gpu-check` does (plugin autoload off: the image has no pytest plugins).
BLOCKED_COLLECT = """
import sys
import pytest
blocked = set(sys.argv[1].split(","))
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the image)", name=name)
sys.meta_path.insert(0, Absent())
sys.exit(pytest.main(["-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[2:]]))
"""


def installed_closure(requirements: list[str]) -> set[str]:
    """The distributions `pip install` of these requirements brings, read from this environment's metadata."""
    seen: set[tuple[str, frozenset]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, requires):
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in (req.extras or {""})):
                todo.append(r)
    return {name for name, _ in seen}


def test_the_cuda_tests_need_nothing_of_the_test_extra():
    """The image installs the gpu-check extra, not the test extra (a browser driver, an S3 server, ...): the
    files `gpu-check` collects, and their conftest, import with only what the image installs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    image = installed_closure(project["dependencies"] + extras["worker"] + extras["postgres"] + extras["s3"] +
                              extras["export"] + extras["gpu-check"]) | {"trainyard"}
    blocked = sorted(m for m, dists in importlib.metadata.packages_distributions().items()
                     if not {canonicalize_name(d) for d in dists} & image and m.isidentifier())
    assert {"playwright", "sklearn", "moto", "schemathesis"} <= set(blocked)  # what only the test extra brings
    assert "pytest" not in blocked and "torch" not in blocked
    files = gpu_check.cuda_test_files(ROOT)
    r = subprocess.run([sys.executable, "-c", BLOCKED_COLLECT, ",".join(blocked), *files], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"[1-9]\d*/\d+ tests? collected", r.stdout), r.stdout[-2000:]
