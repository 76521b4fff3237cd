"""Small requests that used to cost the service gigabytes, or let a web page act for its user, done
for real against a live server, with what each now costs measured from /proc, the disk and the clock.

Uploads are in test_limits_uploads.py, job processes' memory in test_limits_jobs.py.
"""
import errno
import http.server
import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.helpers.jobs import tiny_job
from tests.helpers.processes import peak_rss, reset_peak
from tests.helpers.service import Service

pytestmark = pytest.mark.slow
MiB = 1 << 20


@pytest.fixture(scope="module")
def wide_model(live):
    """An Iris model with 1,000 outputs: every prediction row carries 1,000 probabilities."""
    job = live.submit({**tiny_job(), "model": {"arch": "mlp", "hidden": [8], "num_classes": 1000}})
    done = live.wait_state(job["id"])
    assert done["state"] == "succeeded", done
    return done


def timed_reads(live, job_id: int) -> dict[str, float]:
    out = {}
    with live.client() as c:
        for path in ("/jobs?limit=50", f"/jobs/{job_id}", "/metrics", "/healthz"):
            t0 = time.perf_counter()
            assert c.get(path).status_code == 200
            out[path] = time.perf_counter() - t0
    return out


def test_predictions_live_beside_the_job_and_reads_stay_cheap(live, wide_model):
    rows = [[5.1, 3.5, 1.4, 0.2]] * 5000
    with live.client() as c:
        # Today's reproduction: 5,000 rows x 1,000 classes would be a 110 MB result.
        r = c.post("/jobs", json={"kind": "predict", "model_job": wide_model["id"], "inputs": rows})
        assert r.status_code == 422 and "inputs" in r.text and "top_k" in r.text and "MAX_PREDICT_VALUES" in r.text
        # At the bound: 1,000 rows x 1,000 probabilities, a 20 MB result, stored beside the run.
        big = live.submit({"kind": "predict", "model_job": wide_model["id"], "inputs": rows[:1000]})
        top = live.submit({"kind": "predict", "model_job": wide_model["id"], "inputs": rows, "top_k": 3})
    big, top = live.wait_state(big["id"]), live.wait_state(top["id"])
    assert big["state"] == top["state"] == "succeeded", (big, top)
    assert big["result"] == {"predictions": 1000, "classes": 1000, "top_k": None}
    assert top["result"] == {"predictions": 5000, "classes": 1000, "top_k": 3}
    stored = next((live.data_dir / "artifacts" / str(big["id"])).glob("run-*/result.json"))
    assert stored.stat().st_size > 10 * MiB

    server = live.server.pid
    reset_peak(server)
    base = peak_rss(server)
    reads = timed_reads(live, big["id"])
    assert max(reads.values()) < 0.5, reads  # 2-4 s each while the result sat in the job row
    assert peak_rss(server) - base < 20 * MiB
    with live.client() as c:
        with c.stream("GET", f"/jobs/{big['id']}/result") as r:  # the whole result, streamed from disk
            body = b"".join(r.iter_bytes())
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    result = httpx.Response(200, content=body).json()
    assert len(result["predictions"]) == 1000 and len(result["predictions"][0]["probabilities"]) == 1000
    with live.client() as c:
        tops = c.get(f"/jobs/{top['id']}/result").json()["predictions"]
    assert len(tops) == 5000 and all(len(p["top"]) == 3 for p in tops)
    assert tops[0]["class"] == result["predictions"][0]["class"] == tops[0]["top"][0]["class"]


def test_parameter_count_at_submit_and_the_limit(live):
    with live.client() as c:
        r = c.post("/jobs", json={**tiny_job(), "model": {"arch": "mlp", "hidden": [65536, 65536]}})
        assert r.status_code == 422 and "model" in r.text and "parameters" in r.text and "MAX_PARAMETERS" in r.text
        r = c.post("/jobs", json={**tiny_job(), "data": {"dataset": "upload:0123456789abcdef"}})
        assert r.status_code == 422 and "dataset" in r.text and "does not exist" in r.text
        assert c.get("/jobs", params={"state": "queued"}).json()["count"] == 0
    job = live.submit({**tiny_job(), "model": {"arch": "mlp", "hidden": [8, 9]}})
    assert job["parameters"] == 4 * 8 + 8 + 8 * 9 + 9 + 9 * 3 + 3
    done = live.wait_state(job["id"])
    assert done["result"]["parameters"] == job["parameters"] == done["parameters"]


def test_another_site_cannot_act_and_a_rebound_name_is_not_answered(live):
    job = live.submit({**tiny_job(), "device": "cuda:7"})  # stays queued: no such worker
    url = f"/jobs/{job['id']}/cancel"
    with live.client() as c:
        evil = c.post(url, headers={"Origin": "http://evil.example"})
        assert evil.status_code == 403 and "another web origin" in evil.text
        assert c.post(url, headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
        csv = {"file": ("a.csv", b"a,b\n1,2\n")}
        assert c.post("/datasets", headers={"Origin": "null"}, files=csv).status_code == 403
        assert c.get(f"/jobs/{job['id']}").json()["state"] == "queued"
        rebound = c.get("/jobs", headers={"Host": f"evil.example:{live.port}"})
        assert rebound.status_code == 400 and "TRAINYARD_ALLOWED_HOSTS" in rebound.text
        assert c.get("/jobs", headers={"Host": f"localhost:{live.port}"}).status_code == 200
        # The server's own pages, and clients that are no browser, still act.
        own = c.post(url, headers={"Origin": live.url, "Sec-Fetch-Site": "same-origin"})
        assert own.status_code == 200 and own.json()["state"] == "cancelled"


def test_a_page_on_another_site_in_a_real_browser_changes_nothing(live, tmp_path):
    """A page served from another local port auto-submits a form and no-cors fetches to the API."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from tests.helpers.browser import ARGS, CHROMIUM
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed")
    job = live.submit({**tiny_job(), "device": "cuda:7"})
    api = live.url
    (tmp_path / "index.html").write_text(f"""<!doctype html><body>
<form id=f method=post action="{api}/jobs/{job['id']}/cancel" enctype="text/plain"><input name=x value=y></form>
<script>
const form = new FormData(); form.append("file", new Blob(["a,b\\n1,2\\n"]), "x.csv");
Promise.allSettled([
  fetch("{api}/datasets", {{method: "POST", mode: "no-cors", body: form}}),
  fetch("{api}/jobs", {{method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}},
        body: JSON.stringify({{"kind": "train", "model": {{"arch": "mlp"}}, "data": {{"dataset": "iris"}}}})}}),
]).then(() => {{ document.title = "sent"; document.getElementById("f").submit(); }});
</script></body>""")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    with live.client() as c:
        jobs_before = c.get("/jobs").json()["count"]
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
            page = browser.new_page()
            answers = []
            page.on("response", lambda r: r.url.startswith(api) and answers.append(r.status))
            page.goto(f"http://127.0.0.1:{evil.server_address[1]}/index.html")
            page.wait_for_url(f"{api}/jobs/{job['id']}/cancel", timeout=15_000)  # the form was posted
            browser.close()
    finally:
        evil.shutdown()
    assert answers and set(answers) == {403}, answers
    with live.client() as c:
        assert c.get(f"/jobs/{job['id']}").json()["state"] == "queued"
        assert c.get("/jobs").json()["count"] == jobs_before
        assert c.get("/datasets").json()["count"] == 0


def test_with_a_token_only_the_pages_without_data_answer_without_it(tmp_path):
    svc = Service(tmp_path / "data", env={"TRAINYARD_API_TOKEN": "s3cret"}).start_server()
    try:
        with httpx.Client(base_url=svc.url, headers={"Authorization": "Bearer s3cret"}) as c:
            assert c.post("/jobs", json={**tiny_job(), "name": "private-run-name"}).status_code == 201
        with httpx.Client(base_url=svc.url) as c:
            for path in ("/jobs", "/jobs/1", "/devices", "/workers", "/datasets", "/metrics", "/catalog"):
                assert c.get(path).status_code == 401, path
            # The API's description is the same for every installation and holds no data (README, Guarantees).
            for path in ("/openapi.json", "/docs", "/redoc", "/", "/healthz"):
                r = c.get(path)
                assert r.status_code == 200 and "private-run-name" not in r.text, path
    finally:
        svc.stop()


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def fill(path: Path) -> Path:
    """Write a file until the filesystem is full."""
    filler = path / "filler"
    # Unbuffered: a buffered file keeps what the full disk refused and fails again when closed.
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_a_full_disk_answers_507_and_recovers(tmp_path, tiny_disk):
    svc = Service(tmp_path / "svc", env={"TRAINYARD_DATA_DIR": str(tiny_disk)}).start_server()
    try:
        with svc.client() as c:
            assert c.post("/jobs", json=tiny_job()).status_code == 201
            filler = fill(tiny_disk)
            codes = [c.post("/jobs", json={**tiny_job(), "name": "x" * 190}).status_code for _ in range(400)]
            assert set(codes) <= {201, 507} and 507 in codes, codes
            r = c.post("/datasets", files={"file": ("d.csv", b"a,b,label\n" + b"1,2,x\n3,4,y\n" * 400)},
                       data={"label_column": "label"})
            assert r.status_code == 507 and "full" in r.json()["detail"], r.text
            assert not [p for p in (tiny_disk / "datasets").rglob("*") if p.is_file()]  # nothing half-written
            filler.unlink()
            assert c.post("/jobs", json=tiny_job()).status_code == 201
            assert c.get("/healthz").status_code == 200
    finally:
        svc.stop()


@pytest.mark.postgres
def test_a_database_that_refuses_connections_answers_503_and_recovers(tmp_path):
    name = f"trainyard_down_{os.getpid()}"
    admin = "postgresql://postgres@127.0.0.1:5432/postgres"
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    svc = Service(tmp_path / "data", database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}").start_server()
    try:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        with svc.client() as cl:
            for method, path in (("POST", "/jobs"), ("GET", "/jobs"), ("GET", "/healthz")):
                r = cl.request(method, path, json=tiny_job() if method == "POST" else None)
                assert r.status_code == 503 and r.headers["retry-after"] == "5", (path, r.status_code, r.text)
                assert "database is unavailable" in r.json()["detail"]
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
        with svc.client() as cl:
            assert cl.post("/jobs", json=tiny_job()).status_code == 201
    finally:
        svc.stop()
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
