"""The web dashboard at `/`, in a real headless Chromium against the live server and a real CPU worker.

Needs Debian's `chromium` (Playwright's own browser download is not used) and `playwright` (Python).
"""
import re
from pathlib import Path

import httpx
import pytest

from tests.conftest import slow_job, tiny_job
from tests.service import Service, serving

sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect

CHROMIUM = "/usr/bin/chromium"
# As root Chromium needs --no-sandbox; the rest keep it from reaching out to the internet.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} not installed (apt-get install chromium)")]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("dashboard") / "data") as svc:
        yield svc


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


class Watched:
    """A page with its console errors, uncaught exceptions and request URLs recorded."""

    def __init__(self, browser):
        self.context = browser.new_context(viewport={"width": 1360, "height": 900})
        self.page = self.context.new_page()
        self.page.set_default_timeout(15_000)
        self.errors: list[str] = []
        self.requests: list[sync_api.Request] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("request", lambda r: self.requests.append(r))

    def close(self):
        self.context.close()


@pytest.fixture
def watched(browser):
    w = Watched(browser)
    yield w
    w.close()


def state_cell(page, job_id):
    return page.get_by_test_id(f"job-state-{job_id}")


def test_page_loads_clean_and_shows_the_cpu_and_its_worker(live, watched):
    page = watched.page
    response = page.goto(live.url + "/")
    assert response.status == 200 and "text/html" in response.headers["content-type"]
    assert "connect-src 'self'" in response.headers["content-security-policy"]
    [worker] = httpx.get(f"{live.url}/workers").json()
    cpu = page.get_by_test_id("cpu")
    expect(cpu).to_contain_text("CPU")
    expect(cpu).to_contain_text(f"{worker['host']}:{worker['pid']}")
    expect(page.get_by_test_id(f"worker-{worker['id']}")).to_be_visible()
    expect(page.get_by_test_id("versions")).to_contain_text("torch ")
    expect(page.get_by_test_id("status")).to_have_text("live")
    page.wait_for_timeout(1500)  # a poll or two more
    assert watched.errors == []
    # Everything comes from the server itself: no CDN, no fonts, nothing else.
    assert watched.requests and all(r.url.startswith(live.url + "/") for r in watched.requests), \
        [r.url for r in watched.requests]
    assert any(r.url.endswith("/jobs?limit=100&include=spec,result") for r in watched.requests)


def test_job_reaches_succeeded_and_its_page_plots_every_epoch(live, watched, tmp_path):
    page = watched.page
    page.goto(live.url + "/")
    job = live.submit({**tiny_job(epochs=5, lr_schedule={"name": "linear"}), "name": "dash-iris"})
    row = page.get_by_test_id(f"job-row-{job['id']}")
    expect(row).to_contain_text("dash-iris")
    expect(state_cell(page, job["id"])).to_have_text("succeeded", timeout=60_000)
    expect(row).to_contain_text("5/5")
    expect(page.get_by_test_id(f"job-loss-{job['id']}")).to_have_text(re.compile(r"^\d+\.\d{4}$"))

    row.get_by_role("link", name=str(job["id"]), exact=True).click()
    expect(page).to_have_url(re.compile(rf"#/jobs/{job['id']}$"))
    expect(page.get_by_test_id("job-state")).to_have_text("succeeded")
    loss = page.get_by_test_id("loss-chart")
    expect(loss).to_have_attribute("data-points", "5")
    for series in ("train_loss", "val_loss"):
        expect(loss.locator(f"[data-series={series}]")).to_have_attribute("data-points", "5")
        expect(loss.locator(f"[data-series={series}] circle")).to_have_count(5)
    expect(page.get_by_test_id("accuracy-chart")).to_have_attribute("data-points", "5")
    lr = page.get_by_test_id("lr-chart").locator("[data-series=lr]")
    expect(lr).to_have_attribute("data-points", "5")
    # Linear decay from train.lr (0.001) to 0 over 5 x 4 steps; each epoch shows its last step's.
    expect(lr.locator("circle title").first).to_have_text("epoch 1: lr 0.000842")
    expect(lr.locator("circle title").last).to_have_text("epoch 5: lr 0")
    expect(page.get_by_test_id("job-spec")).to_contain_text('"epochs": 5')
    expect(page.get_by_test_id("job-result")).to_contain_text("val_accuracy")
    expect(page.get_by_test_id("job-log")).to_contain_text("epoch 5/5")
    expect(page.get_by_role("button", name=f"Retry job {job['id']}")).to_be_hidden()
    page.screenshot(path=str(tmp_path / "dashboard-job.png"), full_page=True)
    assert watched.errors == []



def test_a_run_job_has_its_entrypoint_curves_and_own_metric_names(live, watched):
    """A `run` job (the example plugin's cifar_loop) on the page like any other; metrics an entrypoint
    names itself ("loss", "top5_accuracy") get series of their own."""
    job = live.submit({"kind": "run", "entrypoint": "cifar_loop", "device": "cpu",
                       "config": {"epochs": 2, "size": 100, "batch_size": 20}})
    page = watched.page
    page.goto(live.url + "/")
    expect(page.get_by_test_id(f"job-row-{job['id']}")).to_contain_text("entrypoint cifar_loop")
    expect(state_cell(page, job["id"])).to_have_text("succeeded", timeout=60_000)
    page.goto(f"{live.url}/#/jobs/{job['id']}")
    expect(page.get_by_test_id("job-facts")).to_contain_text("run · entrypoint cifar_loop")
    for chart, series in (("loss-chart", "train_loss"), ("loss-chart", "val_loss"), ("accuracy-chart", "val_accuracy")):
        expect(page.get_by_test_id(chart).locator(f"[data-series={series}]")).to_have_attribute("data-points", "2")

    own = [{"epoch": e, "loss": 1 / e, "recon_loss": 2 / e, "top5_accuracy": 0.2 * e, "lr": 0.1} for e in (1, 2, 3)]
    page.route(f"**/jobs/{job['id']}/metrics", lambda route: route.fulfill(json=own))
    page.reload()
    loss, acc = page.get_by_test_id("loss-chart"), page.get_by_test_id("accuracy-chart")
    for chart, series in ((loss, "loss"), (loss, "recon_loss"), (acc, "top5_accuracy")):
        expect(chart.locator(f"[data-series={series}]")).to_have_attribute("data-points", "3")
    expect(loss.locator("[data-series=lr]")).to_have_count(0)
    expect(page.get_by_test_id("lr-chart").locator("[data-series=lr]")).to_have_attribute("data-points", "3")
    assert watched.errors == []

def test_cancel_then_retry_from_the_page(live, watched):
    page = watched.page
    job = live.submit(slow_job(epochs=30))
    jid = job["id"]
    try:
        live.wait_state(jid, "running", timeout=60)
        page.goto(live.url + "/")
        expect(state_cell(page, jid)).to_have_text("running")
        cancel = page.get_by_role("button", name=f"Cancel job {jid}")
        cancel.click()
        expect(state_cell(page, jid)).to_have_text("cancelled")
        expect(cancel).to_be_hidden()
        assert live.job(jid)["state"] == "cancelled"

        # Retry from the job's own page, which shows why it stopped.
        page.goto(f"{live.url}/#/jobs/{jid}")
        expect(page.get_by_test_id("job-state")).to_have_text("cancelled")
        expect(page.get_by_test_id("job-error")).to_contain_text("cancelled by request")
        page.get_by_role("button", name=f"Retry job {jid}").click()
        expect(page.get_by_test_id("job-state")).to_have_text(re.compile(r"^(queued|running)$"))
        assert live.job(jid)["state"] in ("queued", "running")
        expect(page.get_by_role("button", name=f"Cancel job {jid}")).to_be_visible()
        assert watched.errors == []
    finally:
        with live.client() as c:
            c.post(f"/jobs/{jid}/cancel")  # free the worker whatever happened


def test_gpu_memory_bars_from_a_recorded_devices_payload(live, watched):
    """No GPU here: feed the page a /devices answer as a 24 GiB card with a busy worker would give."""
    gib = 2**30
    job = live.submit({**tiny_job(), "device": "cuda:0"})  # only the CPU worker here: it stays queued
    worker = {"id": "gpu-host-1-abc", "host": "gpu-host", "pid": 4242, "device": "cuda:0", "state": "busy",
              "job_id": job["id"], "torch": {"memory_allocated": 6 * gib, "memory_reserved": 8 * gib},
              "last_heartbeat_age_s": 0.4}
    payload = {"cuda_available": True, "driver_version": "580.65", "torch_version": "2.14.1", "cuda_version": "13.0",
               "cudnn_version": "9.24.0",
               "cuda_devices": [{"index": 0, "name": "NVIDIA L4", "uuid": "GPU-1", "compute_capability": "8.9",
                                 "memory_total": 24 * gib, "memory_used": 10 * gib, "memory_free": 14 * gib,
                                 "utilization_gpu": 87, "workers": [worker]}],
               "cpu": {"cores": 8, "memory_total": 64 * gib, "memory_available": 40 * gib, "workers": []}}
    page = watched.page
    page.route("**/devices", lambda route: route.fulfill(json=payload))
    page.goto(live.url + "/")
    gpu = page.get_by_test_id("gpu-0")
    expect(gpu).to_contain_text("NVIDIA L4")
    for text in ("cuda:0", "10.00 GiB", "8.00 GiB", "6.00 GiB", "24.00 GiB", "87% busy", f"job {job['id']}"):
        expect(gpu).to_contain_text(text)
    track = gpu.locator(".mem-track").bounding_box()["width"]
    for part, expected in (("used", 10 / 24), ("reserved", 8 / 24), ("allocated", 6 / 24)):
        seg = page.get_by_test_id(f"gpu-0-{part}")
        expect(seg).to_have_attribute("data-bytes", str({"used": 10, "reserved": 8, "allocated": 6}[part] * gib))
        assert seg.bounding_box()["width"] / track == pytest.approx(expected, abs=0.02)
    gpu.get_by_role("link", name=f"job {job['id']}").click()  # the worker's current job
    expect(page).to_have_url(re.compile(rf"#/jobs/{job['id']}$"))
    expect(page.get_by_test_id("job-state")).to_have_text("queued")
    assert watched.errors == []
    with live.client() as c:
        c.post(f"/jobs/{job['id']}/cancel")



def test_devices_are_grouped_by_host_and_a_draining_worker_says_so(live, watched):
    """A recorded two-host fleet (an L4 box and a 2x H100 box, each with a cuda:0) and an API-only host."""
    gib = 2**30

    def gpu(host, index, name, total, used, workers=()):
        return {"index": index, "name": name, "uuid": f"GPU-{host}-{index}", "compute_capability": "8.9",
                "memory_total": total * gib, "memory_used": used * gib, "memory_free": (total - used) * gib,
                "utilization_gpu": None, "host": host, "workers": list(workers)}

    def worker(id, host, device, draining=False):
        return {"id": id, "host": host, "pid": 1, "device": device, "state": "idle", "job_id": None, "torch": None,
                "last_heartbeat_age_s": 0.5, "draining": draining}

    hosts = [
        {"host": "api-box", "driver_version": None, "cuda_devices": [],
         "cpu": {"cores": 2, "memory_total": 8 * gib, "memory_available": 6 * gib, "workers": []}},
        {"host": "l4-box", "driver_version": "580.65", "cuda_devices": [
            gpu("l4-box", 0, "NVIDIA L4", 24, 3, [worker("l4-w0", "l4-box", "cuda:0", draining=True)])],
         "cpu": {"cores": 8, "memory_total": 64 * gib, "memory_available": 60 * gib, "workers": []}},
        {"host": "h100-box", "driver_version": "580.65", "cuda_devices": [
            gpu("h100-box", 0, "NVIDIA H100", 80, 40, [worker("h-w0", "h100-box", "cuda:0")]),
            gpu("h100-box", 1, "NVIDIA H100", 80, 1)],
         "cpu": {"cores": 64, "memory_total": 512 * gib, "memory_available": 500 * gib,
                 "workers": [worker("h-cpu", "h100-box", "cpu")]}},
    ]
    payload = {"cuda_available": True, "driver_version": "580.65", "torch_version": "2.14.1", "cuda_version": "13.0",
               "cudnn_version": None, "hosts": hosts,
               "cuda_devices": [g for h in hosts for g in h["cuda_devices"]],
               "cpu": {**hosts[0]["cpu"], "workers": [worker("h-cpu", "h100-box", "cpu")]}}
    page = watched.page
    page.route("**/devices", lambda route: route.fulfill(json=payload))
    page.goto(live.url + "/")
    expect(page.get_by_test_id("devices-summary")).to_have_text("3 GPU(s) on 2 hosts")
    expect(page.get_by_test_id("host-l4-box")).to_be_visible()
    expect(page.get_by_test_id("host-h100-box")).to_be_visible()
    expect(page.get_by_test_id("host-api-box")).to_have_count(0)  # no GPU, no worker: left out
    expect(page.get_by_test_id("gpu-l4-box-0")).to_contain_text("NVIDIA L4")
    expect(page.get_by_test_id("gpu-h100-box-0")).to_contain_text("NVIDIA H100")
    expect(page.get_by_test_id("gpu-h100-box-0-used")).to_have_attribute("data-bytes", str(40 * gib))
    expect(page.get_by_test_id("gpu-l4-box-0")).to_contain_text("l4-w0")
    expect(page.get_by_test_id("worker-draining-l4-w0")).to_have_text("draining")
    expect(page.get_by_test_id("worker-draining-h-w0")).to_have_count(0)
    expect(page.get_by_test_id("cpu-h100-box")).to_contain_text("h-cpu")
    assert watched.errors == []

def test_token_is_asked_for_stored_and_sent(browser, tmp_path):
    svc = Service(tmp_path / "data", env={"TRAINYARD_API_TOKEN": "dash-s3cret"}).start_server()
    w = Watched(browser)
    try:
        job = svc.submit(tiny_job())  # no worker: it stays queued
        page = w.page
        assert page.goto(svc.url + "/").status == 200  # the page itself needs no token
        token = page.get_by_label("API token")
        expect(token).to_be_visible()
        token.fill("wrong")
        page.get_by_role("button", name="Save token").click()
        expect(page.get_by_test_id("token-error")).to_contain_text("refused")
        token.fill("dash-s3cret")
        page.get_by_role("button", name="Save token").click()
        expect(state_cell(page, job["id"])).to_have_text("queued")
        expect(token).to_be_hidden()
        sent = [r.all_headers().get("authorization") for r in w.requests if r.url.endswith("/jobs?limit=100&include=spec,result")]
        assert sent[-1] == "Bearer dash-s3cret"

        page.reload()  # kept in localStorage
        expect(state_cell(page, job["id"])).to_have_text("queued")
        expect(token).to_be_hidden()
        # The only console errors are the browser's own notes of the 401s before the token was given.
        assert w.errors and all("401" in e for e in w.errors), w.errors
    finally:
        w.close()
        svc.stop()
