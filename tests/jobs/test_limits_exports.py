"""What a model export may cost the API host, against a live service: an artifact that cannot be exported
is refused from its meta.json (no process that imports torch), an export every requester hung up on is
stopped (its subprocess killed), and past TRAINYARD_EXPORT_QUEUE exports waiting for a slot a new one is a
503 with Retry-After."""
import concurrent.futures
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.helpers.jobs import tiny_job
from tests.helpers.processes import alive
from tests.helpers.service import serving

pytestmark = pytest.mark.slow  # a server and a worker, a trained job, export subprocesses started (then killed)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    # No export may wait for a slot: the third distinct export at once is refused.
    with serving(tmp_path_factory.mktemp("export-limits") / "data", env={"TRAINYARD_EXPORT_QUEUE": "0"}) as svc:
        svc.job_id = svc.submit(tiny_job())["id"]
        assert svc.wait_state(svc.job_id)["state"] == "succeeded"
        yield svc


def cpu_seconds(pid: int) -> tuple[float, float]:
    """A process's own CPU seconds, and those of its children it has waited for (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) / os.sysconf("SC_CLK_TCK") for x in fields[11:15])
    return utime + stime, cutime + cstime


def exporters(svc) -> list[int]:
    """The server's export subprocesses (python -m trainyard.worker.export) now."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == svc.server.pid and b"trainyard.worker.export" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return found


def requesting(svc, job_id: int, fmt: str) -> socket.socket:
    """A client that has asked for an export and waits for the answer (until its socket is closed)."""
    s = socket.create_connection(("127.0.0.1", svc.port))
    s.sendall(f"GET /jobs/{job_id}/artifact?format={fmt} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return s


def held_exporter(svc, known: set[int]) -> int:
    """The new export subprocess, stopped (SIGSTOP) so that it cannot finish before the test is done with it."""
    (pid,) = wait_for(lambda: set(exporters(svc)) - known, 60, "an export subprocess")
    os.kill(pid, signal.SIGSTOP)
    return pid


def run_dir(svc, job_id: int) -> Path:
    (found,) = (svc.data_dir / "artifacts" / str(job_id)).glob("run-*")
    return found


def test_what_cannot_be_exported_is_refused_without_importing_torch(live, tmp_path):
    """Ten requests at once for a run job's kind of artifact (weights without arch): each a 409 from the
    meta, no subprocess (before: each started one that imported torch, 31 CPU-seconds for the ten)."""
    job_id = live.job_id
    meta_file = run_dir(live, job_id) / "meta.json"
    meta = meta_file.read_text()
    meta_file.write_text(json.dumps({"format": 1, "meta": {}, "precision": "fp32"}))
    try:
        own, children = cpu_seconds(live.server.pid)

        def ask(_):
            with live.client(timeout=60) as c:
                return c.get(f"/jobs/{job_id}/artifact", params={"format": "onnx"})
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(ask, range(10)))
        own_after, children_after = cpu_seconds(live.server.pid)
    finally:
        meta_file.write_text(meta)
    assert all(r.status_code == 409 and "arch" in r.json()["detail"] for r in answers), answers[0].text
    assert children_after == children  # no export process ran (and was waited for)
    assert own_after - own < 3.0, own_after - own  # the server's own share: ten small requests
    assert not exporters(live)


def test_an_export_nobody_waits_for_is_stopped(live):
    """Two clients wait for one export; the first hangs up and it goes on; the second too and its
    subprocess is killed, leaving no file behind (before: it ran to its end, 10.6 s after the hang-up)."""
    job_id = live.job_id
    first, second = requesting(live, job_id, "torchscript"), requesting(live, job_id, "torchscript")
    try:
        pid = held_exporter(live, set())
        first.close()
        time.sleep(1.0)  # four times the server's look for a hung-up client
        assert alive(pid), "the export was stopped while a client still waited for it"
    finally:
        first.close()
        second.close()
    wait_for(lambda: not alive(pid), 10, "the export nobody waits for to be killed")
    assert not [p.name for p in run_dir(live, job_id).iterdir() if p.name.startswith(("model.torchscript", "."))]
    with live.client() as c:
        assert c.get("/healthz").status_code == 200


def test_exports_past_the_queue_are_refused_with_retry_after(live):
    """Two exports hold the two slots; with TRAINYARD_EXPORT_QUEUE=0 a third is a 503 with Retry-After at
    once (before: it waited behind them, the last of nine 80 s), while a stored export is still served."""
    job_id = live.job_id
    clients, pids = [], set()
    try:
        for fmt in ("onnx", "pt2"):
            clients.append(requesting(live, job_id, fmt))
            pids.add(held_exporter(live, pids))
        with live.client(timeout=10) as c:
            started = time.monotonic()
            r = c.get(f"/jobs/{job_id}/artifact", params={"format": "torchscript"})
            assert time.monotonic() - started < 5
            assert r.status_code == 503 and "TRAINYARD_EXPORT_QUEUE" in r.json()["detail"], r.text
            assert int(r.headers["retry-after"]) >= 1
            assert c.get(f"/jobs/{job_id}/artifact").status_code == 200  # the safetensors: no export needed
    finally:
        for s in clients:
            s.close()
    wait_for(lambda: not any(alive(p) for p in pids), 10, "the abandoned exports to be killed")
    again = requesting(live, job_id, "torchscript")  # their slots are free again: it starts at once
    try:
        pid = held_exporter(live, set())
    finally:
        again.close()
    wait_for(lambda: not alive(pid), 10, "the export to be killed")
