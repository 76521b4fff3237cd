"""The container packaging: docker-compose*.yml, Dockerfile.gpu, docker/entrypoint.sh, docker/healthcheck.py.

No Docker engine runs here (nor in CI), so the compose files and the Dockerfile are checked as
YAML and text (and with `docker compose config` where the compose plugin is installed), while the
entrypoint and the health check run for real: the real `trainyard` from this venv, real
processes, real signals, real HTTP.
"""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from packaging.requirements import Requirement

from tests.helpers.service import FAST_ENV, ROOT, free_port
from trainyard.app.client.http import tls
from trainyard.app.core.settings import Settings

pytestmark = pytest.mark.slow  # starts the real server and workers

COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CPU = ROOT / "docker-compose.cpu.yml"
COMPOSE_HOSTS = ROOT / "docker-compose.hosts.yml"
DOCKERFILE = ROOT / "Dockerfile.gpu"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
HEALTHCHECK = ROOT / "docker" / "healthcheck.py"
GRACE_S = Settings.model_fields["grace_s"].default


# ---- compose files ------------------------------------------------------------------------------

class Reset:
    """A compose `!reset VALUE`: replaces what the files before it said, instead of merging."""
    def __init__(self, value):
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    pass


def _reset(loader, node):
    if isinstance(node, yaml.SequenceNode):
        return Reset(loader.construct_sequence(node, deep=True))
    if isinstance(node, yaml.MappingNode):
        return Reset(loader.construct_mapping(node, deep=True))
    return Reset(None)


ComposeLoader.add_constructor("!reset", _reset)


def load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def merge(base, over):
    """Compose's merge of an override file, as far as these files need it: mappings merge key by
    key, `!reset` replaces, anything else (scalars, `command` lists) is replaced."""
    if isinstance(over, Reset):
        return over.value
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
    return over


def interpolate(value: str, given: dict[str, str] | None = None) -> str:
    """${VAR:-default} with no VAR set, as on a host without a .env; ${VAR:?error} (a value compose demands)
    from `given`, and a KeyError when it is not there, as compose refuses to start."""
    value = re.sub(r"\$\{(\w+):\?[^}]*\}", lambda m: (given or {})[m.group(1)], value)
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def seconds(duration: str) -> float:
    """A compose duration such as 45s or 1m30s."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def gpu_devices(service: dict) -> list:
    return (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []


def data_mounts(service: dict) -> list[str]:
    return [v.split(":")[0] for v in service.get("volumes", []) if v.split(":")[1] == "/data"]


def test_compose_gpu_services():
    c = load(COMPOSE)
    assert set(c["services"]) == {"api", "worker"}
    api, worker = c["services"]["api"], c["services"]["worker"]

    # All GPUs for the worker (and, for NVML's /devices, the API), through the NVIDIA driver.
    for svc in (api, worker):
        (dev,) = gpu_devices(svc)
        assert dev["driver"] == "nvidia" and dev["count"] == "all" and "gpu" in dev["capabilities"]

    # One named volume at /data in both, so they share the SQLite file and the artifacts.
    assert data_mounts(api) == data_mounts(worker) == ["trainyard-data"]
    assert "trainyard-data" in c["volumes"]

    # The API published on 8000 by default; the container side is fixed at 8000.
    (port,) = api["ports"]
    assert interpolate(port) == "8000:8000"
    assert api["environment"]["TRAINYARD_PORT"] == "8000"

    for svc, role in ((api, "api"), (worker, "worker")):
        assert svc["restart"] in ("unless-stopped", "always")
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and test[2].endswith("/healthcheck.py") and test[3] == role
        assert svc["command"][0] in ("serve", "worker", "gpu-workers")
        assert svc["build"]["dockerfile"] == "Dockerfile.gpu"

    assert api["command"] == ["serve"]
    assert worker["command"] == ["gpu-workers"]
    assert worker["depends_on"]["api"]["condition"] == "service_healthy"
    assert worker["environment"]["TRAINYARD_URL"] == "http://api:8000"
    # The API answers the host name the workers (and the CLI in their container) call it by.
    assert "api" in interpolate(api["environment"]["TRAINYARD_ALLOWED_HOSTS"]).split(",")
    # docker stop must give a worker more than TRAINYARD_GRACE_S to checkpoint its job and exit.
    assert seconds(worker["stop_grace_period"]) >= GRACE_S + 10


def test_compose_cpu_variant():
    c = merge(load(COMPOSE), load(COMPOSE_CPU))
    api, worker = c["services"]["api"], c["services"]["worker"]
    assert gpu_devices(api) == gpu_devices(worker) == []
    assert worker["command"] == ["worker", "--device", "cpu"]
    # Everything else is inherited.
    assert data_mounts(api) == data_mounts(worker) == ["trainyard-data"]
    assert worker["healthcheck"]["test"][3] == "worker"
    assert seconds(worker["stop_grace_period"]) >= GRACE_S + 10
    assert worker["depends_on"]["api"]["condition"] == "service_healthy"


def test_compose_hosts_variant():
    """Several hosts: API and workers share PostgreSQL and a MinIO bucket, nothing on a shared disk."""
    c = merge(load(COMPOSE), load(COMPOSE_HOSTS))
    services = c["services"]
    api, worker = services["api"], services["worker"]
    dot_env = {"TRAINYARD_DB_PASSWORD": "pw1", "TRAINYARD_S3_KEY": "key1", "TRAINYARD_S3_SECRET": "secret1"}
    for svc in (api, worker):
        env = {k: interpolate(str(v), dot_env) for k, v in svc["environment"].items()}
        assert env["TRAINYARD_DATABASE_URL"] == "postgresql+psycopg://trainyard:pw1@postgres:5432/trainyard"
        assert env["TRAINYARD_STORAGE_URL"] == "s3://trainyard/data"
        assert env["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
        assert env["AWS_SECRET_ACCESS_KEY"] == "secret1" == interpolate(
            services["minio"]["environment"]["MINIO_ROOT_PASSWORD"], dot_env)
        # No default password: without .env's, compose refuses to start (issue 37).
        with pytest.raises(KeyError):
            interpolate(str(svc["environment"]["TRAINYARD_DATABASE_URL"]))
    for name in ("postgres", "minio"):
        with pytest.raises(KeyError):
            interpolate(str(services[name]["environment"]), {})
        # The queue and the bucket are published on loopback only unless TRAINYARD_SHARE_ADDR names the hosts'
        # private network: whoever reaches them with the passwords can read every job and mint tokens.
        (port,) = services[name]["ports"]
        assert interpolate(port).startswith("127.0.0.1:"), port
        Settings(storage_url=env["TRAINYARD_STORAGE_URL"])  # a URL trainyard takes
    # Inherited from docker-compose.yml: the API's port, the worker's GPUs and grace period.
    assert "TRAINYARD_ALLOWED_HOSTS" in api["environment"] and gpu_devices(worker)
    assert interpolate(worker["environment"]["TRAINYARD_URL"]) == "http://api:8000"
    assert api["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                 "minio-bucket": {"condition": "service_completed_successfully"}}
    # The bucket the init service makes is the one the storage URL names.
    assert "mc mb --ignore-existing s3/trainyard" in services["minio-bucket"]["entrypoint"][2]
    assert set(c["volumes"]) == {"trainyard-data", "postgres-data", "minio-data"}
    # The image carries the drivers these need.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(r.startswith("boto3") for r in project["optional-dependencies"]["s3"])


def size_bytes(size) -> int:
    """A compose byte size such as 16gb, 512m or a number of bytes."""
    m = re.fullmatch(r"(\d+)([kmg]?)b?", str(size).lower())
    assert m, size
    return int(m.group(1)) * 1024 ** " kmg".index(m.group(2) or " ")


def test_gpu_workers_get_shared_memory_and_pinned_memory_for_nccl():
    """NCCL between a multi-GPU job's ranks uses /dev/shm (Docker's default is 64 MB: the job fails)
    and pins host memory: the worker gets GBs of shm and no memlock limit, in every variant."""
    for files in ((COMPOSE,), (COMPOSE, COMPOSE_CPU), (COMPOSE, COMPOSE_HOSTS)):
        c = load(files[0])
        for f in files[1:]:
            c = merge(c, load(f))
        worker = c["services"]["worker"]
        assert worker.get("ipc") == "host" or size_bytes(interpolate(worker["shm_size"])) >= 8 << 30, files
        assert worker["ulimits"]["memlock"] in (-1, {"soft": -1, "hard": -1}), files


def test_the_image_has_a_c_compiler_for_torch_compile():
    # Triton builds its kernels' launchers with a C compiler, Inductor's CPU code is C++: python:3.11-slim has
    # neither, and every compile job would fall back to eager.
    _, stages = dockerfile()
    runtime = stages[-1]
    runs = [r for i, r in runtime if i == "RUN"]
    assert any(re.search(r"apt-get install .*\b(build-essential|gcc g\+\+|g\+\+ gcc)\b", r) for r in runs), runs
    user_at = max(n for n, (i, _) in enumerate(runtime) if i == "USER")
    assert all(n < user_at for n, (i, r) in enumerate(runtime) if i == "RUN" and "apt-get" in r)  # as root


def _compose_plugin() -> bool:
    try:
        return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_compose_config_with_docker_compose():
    # The real parser, where the compose plugin is installed. Without it (this machine, CI) only
    # this check is skipped: the tests above cover the same properties with our own merge.
    # `docker compose config` needs no engine.
    if not _compose_plugin():
        pytest.skip("`docker compose` (the compose plugin) is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "COMPOSE_"))}

    def config(*files: Path, fmt: list[str]) -> subprocess.CompletedProcess:
        args = [a for f in files for a in ("-f", str(f))]
        return subprocess.run(["docker", "compose", *args, "config", *fmt], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)

    for files in ((COMPOSE,), (COMPOSE, COMPOSE_CPU), (COMPOSE, COMPOSE_HOSTS), (COMPOSE, COMPOSE_CPU, COMPOSE_HOSTS)):
        r = config(*files, fmt=["-q"])
        assert r.returncode == 0, r.stderr
    gpu = json.loads(config(COMPOSE, fmt=["--format", "json"]).stdout)["services"]
    cpu = json.loads(config(COMPOSE, COMPOSE_CPU, fmt=["--format", "json"]).stdout)["services"]
    for name in ("api", "worker"):
        (dev,) = gpu_devices(gpu[name])
        assert dev["driver"] == "nvidia" and dev["count"] in ("all", -1) and dev["capabilities"] == ["gpu"]
        assert gpu_devices(cpu[name]) == []
        assert [v["target"] for v in cpu[name]["volumes"]] == ["/data"]
    assert cpu["worker"]["command"] == ["worker", "--device", "cpu"]
    assert cpu["api"]["ports"][0]["target"] == 8000 and cpu["api"]["ports"][0]["published"] == "8000"


# ---- Dockerfile.gpu -----------------------------------------------------------------------------

def dockerfile() -> tuple[dict, list[list[tuple[str, str]]]]:
    """(global ARG defaults, stages as lists of (INSTRUCTION, arguments)), continuations joined."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        instr, _, rest = line.strip().partition(" ")
        instr, rest = instr.upper(), " ".join(rest.split())
        if instr == "FROM":
            stages.append([])
        if not stages:
            assert instr == "ARG", line
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            stages[-1].append((instr, rest))
    return args, stages


def test_dockerfile():
    args, stages = dockerfile()
    assert len(stages) >= 2, "multi-stage: a builder and the runtime"
    froms = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], s[0][1]).split() for s in stages]
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"  # the image's own Python is the oldest supported
    for f in froms:
        assert f[0].startswith("python:3.11") or f[0].startswith("nvidia/cuda:13.0"), f
    runtime = stages[-1]
    last = {i: r for i, r in runtime}  # the last of each instruction in the runtime stage

    user = last["USER"].split(":")[0]
    assert user not in ("root", "0")
    entrypoint = json.loads(last["ENTRYPOINT"])
    assert entrypoint[0].endswith("/entrypoint.sh") and len(entrypoint) == 1
    assert json.loads(last["CMD"]) == ["serve"]
    assert "healthcheck.py" in last["HEALTHCHECK"] and " CMD " in f" {last['HEALTHCHECK']} "
    assert "8000" in last["EXPOSE"].split()
    assert last["VOLUME"] in ("/data", '["/data"]')
    env = dict(shlex.split(kv)[0].split("=", 1) for kv in re.findall(r"\w+=\S+", " ".join(
        r for i, r in runtime if i == "ENV")))
    assert env["TRAINYARD_DATA_DIR"] == "/data" and env["TRAINYARD_HOST"] == "0.0.0.0"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert {"compute", "utility"} <= set(env["NVIDIA_DRIVER_CAPABILITIES"].split(","))
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # torch's cuda:N is NVML's (and nvidia-smi's) GPU N

    # Both scripts are copied to the directory the ENTRYPOINT and HEALTHCHECK name.
    copies = [r for i, r in runtime if i == "COPY" and "--from" not in r]
    script_dir = str(Path(entrypoint[0]).parent)
    assert any("docker/entrypoint.sh" in r and "docker/healthcheck.py" in r and r.rstrip("/").endswith(script_dir)
               for r in copies)
    assert f"{script_dir}/healthcheck.py" in last["HEALTHCHECK"]
    for svc in load(COMPOSE)["services"].values():  # compose's health checks use the same path
        assert svc["healthcheck"]["test"][2] == f"{script_dir}/healthcheck.py"

    # The project and its pinned dependencies (torch's CUDA build among them) are installed.
    runs = " && ".join(r for s in stages for i, r in s if i == "RUN")
    assert re.search(r"pip install (-\S+ )*\.(\s|$|\[)", runs), "pip install of the project"
    assert "pip install -r /tmp/requirements.txt -c /tmp/torch.txt" in runs
    assert "torch.version.cuda" in runs  # the build fails on a CPU-only torch
    # Another CUDA line: the same pinned torch and torchvision from the index the build argument names,
    # installed before the rest so that the requirements find them satisfied.
    assert ("ARG", 'TORCH_INDEX_URL=""') in stages[0]  # empty by default: PyPI's torch, the CUDA 13.0 build
    torch_line = re.search(r'pip install --index-url "\$TORCH_INDEX_URL" -r /tmp/torch.txt', runs)
    assert torch_line and runs.index(torch_line.group(0)) < runs.index("pip install -r /tmp/requirements.txt")
    # The image pins the torch it is built and tested with, within the range the worker extra allows.
    pins = dict(a.split("=", 1) for i, a in stages[0] if i == "ARG" and a.startswith("TORCH"))
    worker = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["worker"]
    assert Requirement(next(r for r in worker if r.startswith("torch>"))).specifier.contains(pins["TORCH"])
    assert """printf 'torch==%s\\ntorchvision==%s\\n' "$TORCH" "$TORCHVISION" > /tmp/torch.txt""" in runs


def test_dockerfile_dependency_list_is_the_pinned_one():
    """Run the Dockerfile's own snippet that turns pyproject.toml into the requirements it installs."""
    _, stages = dockerfile()
    run = next(r for s in stages for i, r in s if i == "RUN" and "tomllib" in r)
    words = shlex.split(run.split(">")[0])
    code = words[words.index("-c") + 1]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    reqs = out.splitlines()  # one a line, as pip reads them (a marker has spaces)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert reqs == project["dependencies"] + extras["worker"] + extras["postgres"] + extras["s3"] + \
        extras["export"] + extras["gpu-check"] + extras["mlflow"]
    assert any(r.startswith("pytest") for r in reqs) and not any(r.startswith("playwright") for r in reqs)
    assert any(r.startswith("torch>=") for r in reqs), "the worker's torch (pinned by the build's constraint)"


def test_the_image_carries_what_gpu_check_runs():
    """`docker run --gpus all IMAGE gpu-check`: the CUDA-marked tests, the benchmarks and pytest's settings
    land where the command looks for them, beside the venv (its sys.prefix is /opt/venv)."""
    from trainyard.app.cli import gpu_check
    _, stages = dockerfile()
    runtime = stages[-1]
    env = " ".join(r for i, r in runtime if i == "ENV")
    assert "VIRTUAL_ENV=/opt/venv" in env
    share = f"/opt/venv/{gpu_check.SHARE.as_posix()}"
    copies = {tuple(r.split()) for i, r in runtime if i == "COPY" and "--from" not in r}
    assert {("tests", f"{share}/tests"), ("bench", f"{share}/bench"), ("pyproject.toml", f"{share}/")} <= copies
    venv_copy = next(n for n, (i, r) in enumerate(runtime) if i == "COPY" and r.startswith("--from=builder"))
    assert all(n > venv_copy for n, (i, r) in enumerate(runtime) if i == "COPY" and share in r), \
        "after the venv: a changed test must not rebuild torch's layer"


def test_dockerignore_lets_in_what_the_dockerfile_copies():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "an allow-list: nothing (.venv, .git, .env, data) but what is named"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    _, stages = dockerfile()
    for s in stages:
        for i, r in s:
            if i == "COPY" and "--from" not in r:
                *sources, _dest = [w for w in r.split() if not w.startswith("--")]
                for src in sources:
                    assert src.rstrip("/") in allowed, src
                    assert (ROOT / src).exists(), src



def test_plugins_are_baked_into_the_venv_the_runtime_copies():
    """`--build-arg PLUGINS=...` installs plugins in the builder, into the /opt/venv the runtime copies;
    the example plugin is in the build context."""
    args, stages = dockerfile()
    builder, runtime = stages[0], stages[-1]
    assert ("ARG", 'PLUGINS=""') in builder
    run = next(r for i, r in builder if i == "RUN" and "$PLUGINS" in r)
    # The image's torch held by the constraint: a plugin may not swap it for another.
    assert run.startswith('if [ -n "$PLUGINS" ]; then pip install $PLUGINS -c /tmp/torch.txt && pip check')
    assert any(i == "COPY" and r.split()[0] == "examples/plugin" for i, r in builder)
    assert (ROOT / "examples/plugin/pyproject.toml").exists()
    assert any(i == "COPY" and r.startswith("--from=builder /opt/venv") for i, r in runtime)
    # An empty PLUGINS installs nothing and succeeds.
    assert subprocess.run(["sh", "-c", run.split("; fi")[0] + "; fi"], env={"PLUGINS": ""}).returncode == 0

# ---- entrypoint and health check, for real ------------------------------------------------------

@pytest.fixture
def env(tmp_path):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    # The venv's bin first: `trainyard` and `python` in the scripts are this project's.
    path = f"{Path(sys.executable).parent}{os.pathsep}{clean.get('PATH', '')}"
    return {**clean, **FAST_ENV, "PATH": path, "PYTHONUNBUFFERED": "1",
            "TRAINYARD_DATA_DIR": str(tmp_path / "data"), "TRAINYARD_WORKER_PIDFILE": str(tmp_path / "workers.pid"),
            "TRAINYARD_WORKER_STATUS_DIR": str(tmp_path / "status")}


class Logged(subprocess.Popen[bytes]):
    """A process whose output goes to the file `log`."""
    log: Path


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[[list[str], dict], Logged]]:
    """start(args, env) runs `bash docker/entrypoint.sh ARGS` in a session of its own; whatever is
    still running at the end of the test (the process and its children) is stopped."""
    procs: list[tuple[Logged, Path]] = []

    def _start(args: list[str], env: dict) -> Logged:
        log = tmp_path / f"entrypoint-{len(procs)}.log"
        p = Logged(["bash", str(ENTRYPOINT), *args], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                   stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        p.log = log
        procs.append((p, log))
        return p

    yield _start
    for p, _ in procs:
        _signal_group(p, signal.SIGTERM)
    for p, _ in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(p, signal.SIGKILL)  # also orphaned grandchildren (fork servers)
        p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def wait_until(predicate, timeout: float, what: str, *procs: Logged) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for p in procs:
            assert p.poll() is None, f"exited ({p.returncode}) while waiting for {what}:\n{p.log.read_text()}"
        time.sleep(0.1)
    logs = "\n".join(f"--- {p.args!r}\n{p.log.read_text()[-3000:]}" for p in procs)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2, verify=tls()).status_code == 200
    except httpx.TransportError:
        return False


def healthcheck(env: dict, *args: str) -> int:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], env=env, capture_output=True,
                          timeout=60).returncode


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def workers(url: str) -> list[dict]:
    return httpx.get(f"{url}/workers", timeout=5, verify=tls()).json()


def start_api(start, env: dict) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = start(["serve", "--port", str(port), "--log-level", "warning"], env)
    wait_until(lambda: healthy(url), 60, "the API's /healthz", p)
    return p, url


def test_script_headers():
    assert ENTRYPOINT.read_text().startswith("#!/usr/bin/env bash\n")
    assert "\nset -eu\n" in ENTRYPOINT.read_text()


def test_serve_execs_trainyard_and_stops_on_sigterm(start, env, tmp_path):
    # A stale pid file from an earlier worker run must not make the auto health check look at workers.
    Path(env["TRAINYARD_WORKER_PIDFILE"]).write_text("999999\n")
    api, url = start_api(start, env)
    port = url.rsplit(":", 1)[1]
    # exec: the entrypoint's pid is now trainyard's own process.
    argv = cmdline(api.pid)
    assert any(a.endswith("trainyard") for a in argv) and "serve" in argv and not any("entrypoint" in a for a in argv)

    check_env = {**env, "TRAINYARD_PORT": port}
    assert healthcheck(check_env, "api") == 0
    assert healthcheck(check_env) == 0  # auto: no worker pid file, so the API
    assert not Path(env["TRAINYARD_WORKER_PIDFILE"]).exists()
    assert healthcheck(env, "api", "--url", f"http://127.0.0.1:{free_port()}") == 1  # nothing listens there

    api.send_signal(signal.SIGTERM)
    api.wait(timeout=20)
    assert not healthy(url), "the server went on after its entrypoint's pid got SIGTERM"
    assert healthcheck(check_env, "api") == 1


def test_worker_waits_for_api_registers_and_stops_on_sigterm(start, env):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    wenv = {**env, "TRAINYARD_URL": url}
    worker = start(["worker", "--device", "cpu"], wenv)
    # No API yet: the entrypoint is still waiting, trainyard worker has not started.
    wait_until(lambda: "waiting up to" in worker.log.read_text(), 10, "the wait message", worker)
    time.sleep(1.5)
    assert worker.poll() is None and any("entrypoint.sh" in a for a in cmdline(worker.pid))
    assert healthcheck(env, "worker") == 1  # no pid file yet

    api = start(["serve", "--port", str(port), "--log-level", "warning"], env)
    # Registered under the entrypoint's pid: exec made the worker that very process.
    wait_until(lambda: healthy(url) and any(w["pid"] == worker.pid and w["device"] == "cpu" for w in workers(url)),
               120, "the worker's registration", worker, api)
    assert Path(env["TRAINYARD_WORKER_PIDFILE"]).read_text().split() == [str(worker.pid)]
    assert healthcheck(env, "worker") == 0
    assert healthcheck(env) == 0  # auto: the pid file is there, so the worker check

    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=GRACE_S + 10) == 0
    assert healthcheck(env, "worker") == 1
    assert not any(w["pid"] == worker.pid for w in workers(url))  # stopped workers are not listed


def test_gpu_workers_role_runs_one_worker_per_device(start, env):
    _, url = start_api(start, env)
    wenv = {**env, "TRAINYARD_URL": url, "TRAINYARD_WORKER_DEVICES": "cpu cpu"}
    sup = start(["gpu-workers"], wenv)
    pidfile = Path(env["TRAINYARD_WORKER_PIDFILE"])
    wait_until(lambda: len({w["pid"] for w in workers(url)} & set(_pids(pidfile))) == 2, 120,
               "two workers' registration", sup)
    pids = _pids(pidfile)
    for pid in pids:  # children of the entrypoint, which stays to supervise them
        assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == sup.pid
        assert "worker" in cmdline(pid)
    assert healthcheck(env, "worker") == 0

    sup.send_signal(signal.SIGTERM)  # forwarded to every worker
    assert sup.wait(timeout=GRACE_S + 10) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert healthcheck(env, "worker") == 1
    assert workers(url) == []


def test_gpu_workers_role_exits_with_a_failing_workers_status(start, env):
    # Both workers fail at once (argparse: exit 2); the supervisor neither hangs nor exits 0, so
    # compose's restart policy starts the container again.
    p = start(["gpu-workers", "--max-jobs", "many"], {**env, "TRAINYARD_WORKER_DEVICES": "cpu cpu"})
    assert p.wait(timeout=60) == 2
    assert "exited with status 2; stopping the others" in p.log.read_text()


def _pids(pidfile: Path) -> list[int]:
    try:
        return [int(p) for p in pidfile.read_text().split()]
    except (OSError, ValueError):
        return []


def test_gpu_workers_without_a_gpu_fails_clearly(start, env):
    # CUDA_VISIBLE_DEVICES="" hides any GPU the machine has: NVML counts none.
    p = start(["gpu-workers"], {**env, "CUDA_VISIBLE_DEVICES": ""})
    assert p.wait(timeout=60) == 1
    assert "no GPU visible" in p.log.read_text() and "docker-compose.cpu.yml" in p.log.read_text()


def test_worker_gives_up_when_the_api_never_answers(start, env):
    url = f"http://127.0.0.1:{free_port()}"
    p = start(["worker", "--device", "cpu"], {**env, "TRAINYARD_URL": url, "TRAINYARD_WAIT_S": "1"})
    assert p.wait(timeout=30) == 1
    assert f"api at {url} is not healthy" in p.log.read_text()
    assert not Path(env["TRAINYARD_WORKER_PIDFILE"]).exists()  # trainyard worker never started


def test_other_arguments_go_to_trainyard(start, env):
    p = start(["--help"], env)
    assert p.wait(timeout=60) == 0 and "usage: trainyard" in p.log.read_text()
    # A client subcommand, with TRAINYARD_URL passed through to it.
    url = f"http://127.0.0.1:{free_port()}"
    p = start(["jobs", "--json"], {**env, "TRAINYARD_URL": url})
    assert p.wait(timeout=60) == 2 and f"cannot reach trainyard at {url}" in p.log.read_text()
