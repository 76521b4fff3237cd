"""The web dashboard at `/`, in a real headless Chromium against the live server and a real CPU worker.

Needs Debian's `chromium` (Playwright's own browser download is not used) and `playwright` (Python).
"""
import re
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.helpers.browser import ARGS, CHROMIUM
from tests.helpers.jobs import IRIS_JOB, slow_job, tiny_job
from tests.helpers.service import Service

sync_api = pytest.importorskip("playwright.sync_api")
if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Request
expect = sync_api.expect


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                 reason=f"{CHROMIUM} not installed (apt-get install chromium)")]


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


class Watched:
    """A page with its console errors, uncaught exceptions and request URLs recorded."""

    def __init__(self, browser: "Browser") -> None:
        self.context = browser.new_context(viewport={"width": 1360, "height": 900})
        self.page = self.context.new_page()
        self.page.set_default_timeout(15_000)
        self.errors: list[str] = []
        self.requests: list[Request] = []

        def console(m: "ConsoleMessage") -> None:
            if m.type == "error":
                self.errors.append(m.text)

        self.page.on("console", console)
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
    # The list poll asks for no specs (a predict job's rows are megabytes): its summaries say what each job is.
    assert any(r.url.endswith("/jobs?limit=100&include=result") for r in watched.requests)


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


def test_a_keep_best_jobs_page_says_which_epoch_its_summary_and_its_result_are(live, watched):
    """keep: best: the summary shows the last epoch's losses, the result the kept epoch's; the page says which."""
    job = live.wait_state(live.submit(tiny_job(epochs=3))["id"])
    assert job["state"] == "succeeded"
    shown = {**job, "latest_metrics": {**job["latest_metrics"], "epoch": 3, "val_loss": 0.61},
             "result": {**job["result"], "kept": "best", "kept_epoch": 2, "val_loss": 0.42}}
    page = watched.page
    page.route(f"**/jobs/{job['id']}", lambda route: route.fulfill(json=shown))
    page.goto(f"{live.url}/#/jobs/{job['id']}")
    kept = page.get_by_test_id("job-result-kept")
    expect(kept).to_contain_text("epoch 2's, the best evaluated (keep: best)")
    expect(kept).to_contain_text("the last epoch, 3")
    expect(page.get_by_test_id("job-facts")).to_contain_text("val loss (last epoch, 3)")
    expect(page.get_by_test_id("job-result")).to_contain_text("0.42")
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

def test_an_unavailable_gpu_worker_shows_why(live, watched):
    """A recorded host whose driver is older than the torch build needs: its cuda:0 worker is listed with
    its reason, though NVML's GPU list has no entry it could sit under."""
    gib = 2**30
    why = ("cuda:0: CUDA is not available: the NVIDIA driver 570.86.15 supports CUDA up to 12.8, and torch "
           "2.14.1+cu130 is built for CUDA 13.0 (driver R580 or newer). Upgrade the driver, or install torch built "
           "for CUDA 12.x: TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128")
    stuck = {"id": "old-w0", "host": "old-box", "pid": 1, "device": "cuda:0", "state": "unavailable",
             "job_id": None, "torch": None, "last_heartbeat_age_s": 0.5, "draining": False, "unavailable": why}
    cpu = {"cores": 8, "memory_total": 64 * gib, "memory_available": 60 * gib, "workers": []}
    hosts = [{"host": "old-box", "driver_version": "570.86.15", "cuda_devices": [], "other_workers": [stuck],
              "cpu": cpu}]
    payload = {"cuda_available": False, "driver_version": "570.86.15", "torch_version": "2.14.1",
               "cuda_version": "13.0", "cudnn_version": None, "hosts": hosts, "cuda_devices": [], "cpu": cpu,
               "other_workers": [stuck]}
    page = watched.page
    page.route("**/devices", lambda route: route.fulfill(json=payload))
    page.goto(live.url + "/")
    expect(page.get_by_test_id("other-workers-old-box")).to_contain_text("old-w0")
    expect(page.get_by_test_id("worker-unavailable-old-w0")).to_have_text(why)
    expect(page.get_by_test_id("worker-old-w0")).to_have_attribute("data-state", "unavailable")
    assert watched.errors == []


def test_the_storage_panel_shows_every_kind_as_measured(live, watched):
    job = live.wait_state(live.submit(tiny_job())["id"])
    assert job["state"] == "succeeded"
    page = watched.page
    page.goto(live.url + "/")
    expect(page.get_by_test_id("storage-panel")).to_contain_text("Storage")
    with live.client() as c:
        assert c.post("/storage/collect").status_code == 200
        storage = c.get("/storage").json()
    expect(page.get_by_test_id("storage-summary")).to_contain_text("measured ")
    assert storage["kinds"]["artifacts"]["objects"] > 0
    for kind, usage in storage["kinds"].items():
        row = page.get_by_test_id(f"storage-{kind}")
        expect(row).to_have_attribute("data-bytes", str(usage["bytes"]))
        expect(row).to_have_attribute("data-objects", str(usage["objects"]))
        expect(row).to_contain_text(kind)
    expect(page.get_by_test_id("storage-artifacts")).to_contain_text("KiB")
    assert list(storage["kinds"]) == page.get_by_test_id("storage-table").locator("tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.testid.slice('storage-'.length))")
    assert watched.errors == []


def test_the_page_signs_in_with_a_cookie_and_its_script_never_sends_the_token(browser, tmp_path):
    """The page asks for the token, posts it to /session (an HttpOnly cookie: tests/api/test_dashboard_signin.py), and
    from then on the browser sends the cookie: no Authorization header, nothing in local storage."""
    svc = Service(tmp_path / "data", env={"TRAINYARD_API_TOKEN": "dash-s3cret"}).start_server()
    w = Watched(browser)
    try:
        job = svc.submit(tiny_job())  # no worker: it stays queued
        page = w.page
        assert page.goto(svc.url + "/").status == 200  # the page itself needs no token
        token = page.get_by_label("Token")
        expect(token).to_be_visible()
        token.fill("wrong")
        page.get_by_role("button", name="Sign in").click()
        expect(page.get_by_test_id("token-error")).to_contain_text("refused")
        token.fill("dash-s3cret")
        page.get_by_role("button", name="Sign in").click()
        expect(state_cell(page, job["id"])).to_have_text("queued")
        expect(token).to_be_hidden()
        listed = [r for r in w.requests if r.url.endswith("/jobs?limit=100&include=result")]
        assert "authorization" not in listed[-1].all_headers()
        cookie = listed[-1].all_headers()["cookie"]  # a session of its own (app/accounts/signins.py), not the token
        assert "trainyard_token=tys_" in cookie and "dash-s3cret" not in cookie
        assert "dash-s3cret" not in page.evaluate("document.cookie + JSON.stringify(Object.entries(localStorage))")

        page.reload()  # the cookie outlives the page
        expect(state_cell(page, job["id"])).to_have_text("queued")
        expect(token).to_be_hidden()
        page.get_by_role("button", name="Sign out").click()
        expect(token).to_be_visible()
        # The only console errors are the browser's own notes of the 401s before signing in and after signing out.
        assert w.errors and all("401" in e for e in w.errors), w.errors
    finally:
        w.close()
        svc.stop()


# ---- sweeps ----------------------------------------------------------------------------------------------

LR_SWEEP = {"train.lr": {"type": "choice", "values": [0.001, 0.05]}}


def sweep_rows(page) -> list[int]:
    """The trial numbers of the trials table, top to bottom."""
    return [int(n) for n in page.get_by_test_id("trials-table").locator("tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.trial)")]


def wait_sweep(live, sweep_id: int, timeout: float = 120) -> dict:
    with live.client() as c:
        live.wait_until(lambda: c.get(f"/sweeps/{sweep_id}").json()["state"] != "running", timeout,
                        f"sweep {sweep_id} to end")
        return c.get(f"/sweeps/{sweep_id}").json()


def test_a_grid_sweep_runs_and_its_page_shows_trials_curves_and_scatter(live, watched, tmp_path):
    """A real grid sweep of the Iris job over two learning rates, through the server and the CPU worker."""
    job = {**IRIS_JOB, "name": "dash-sweep-trial", "train": {**IRIS_JOB["train"], "epochs": 5}}
    with live.client() as c:
        r = c.post("/sweeps", json={"name": "dash-lr", "job": job, "parameters": LR_SWEEP, "method": "grid",
                                    "metric": "val_loss"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    page = watched.page
    # Opened while the sweep runs: what the page shows at the end came by polling.
    page.goto(f"{live.url}/#/sweeps/{sid}")
    expect(page.get_by_test_id("sweep-title")).to_have_text(f"Sweep {sid} · dash-lr")
    sweep = wait_sweep(live, sid)
    assert sweep["state"] == "succeeded", sweep
    trials = {t["trial"]: t for t in sweep["trials"]}
    assert len(trials) == 2 and all(t["state"] == "succeeded" and len(t["params"]) == 1 for t in trials.values())
    best = sweep["best"]["trial"]
    values = {n: t["value"] for n, t in trials.items()}
    # a grid tries each value once
    assert sorted(t["params"]["train.lr"] for t in trials.values()) == [0.001, 0.05], trials
    assert values[0] != values[1]

    expect(page.get_by_test_id("sweep-state")).to_have_text("succeeded", timeout=30_000)
    expect(page.get_by_role("button", name=f"Cancel sweep {sid}")).to_be_hidden()
    facts = page.get_by_test_id("sweep-facts")
    expect(facts).to_contain_text("grid")
    expect(facts).to_contain_text("val_loss (minimize)")
    expect(facts).to_contain_text("2 succeeded")
    expect(page.get_by_test_id("sweep-best")).to_contain_text(f"trial {best} (job {trials[best]['job_id']})")
    expect(page.get_by_test_id("sweep-best")).to_contain_text(f"train.lr={trials[best]['params']['train.lr']:.6g}")

    # The table: a row per trial, linking to its job, the best one marked.
    table = page.get_by_test_id("trials-table")
    expect(table.locator("tbody tr")).to_have_count(2)
    for n, t in trials.items():
        row = page.get_by_test_id(f"trial-row-{n}")
        expect(row).to_have_attribute("data-best", "true" if n == best else "false")
        expect(row.locator(f"a[href='#/jobs/{t['job_id']}']").first).to_be_visible()
        expect(row.locator("td[data-param='train.lr']")).to_have_text(f"{t['params']['train.lr']:.6g}")
        expect(page.get_by_test_id(f"trial-value-{n}")).to_have_text(f"{t['value']:.4f}")
        expect(page.get_by_test_id(f"trial-state-{n}")).to_have_text("succeeded")
        expect(row).to_contain_text("5/5")
    expect(page.get_by_test_id(f"trial-row-{best}").get_by_test_id("best-trial")).to_have_text("best")
    expect(table.get_by_test_id("best-trial")).to_have_count(1)
    for header in ("Trial", "Job", "State", "train.lr", "val_loss", "Epoch"):
        expect(table.locator("thead th", has_text=header)).to_have_count(1)

    # Sorting by value: best first (val_loss is minimised), then the other way round.
    by_value = sorted(values, key=values.get)
    assert sweep_rows(page) == [0, 1]
    page.get_by_test_id("trials-sort-value").click()
    expect(page.get_by_test_id("trials-sort-value")).to_have_attribute("aria-sort", "ascending")
    assert sweep_rows(page) == by_value and by_value[0] == best
    page.get_by_test_id("trials-sort-value").click()
    expect(page.get_by_test_id("trials-sort-value")).to_have_attribute("aria-sort", "descending")
    assert sweep_rows(page) == by_value[::-1]
    page.get_by_test_id("trials-sort-param:train.lr").click()  # by the parameter: 0.001 before 0.05
    assert sweep_rows(page) == sorted(trials, key=lambda n: trials[n]["params"]["train.lr"])
    page.wait_for_timeout(1500)  # polling keeps the order chosen
    assert sweep_rows(page) == sorted(trials, key=lambda n: trials[n]["params"]["train.lr"])

    # Every trial's validation curve, 5 epochs each, the best drawn heavier.
    curves = page.get_by_test_id("curves-chart")
    expect(curves.locator("[data-series]")).to_have_count(2)
    for n in trials:
        series = curves.locator(f"[data-trial='{n}']")
        expect(series).to_have_attribute("data-points", "5")
        expect(series.locator("circle")).to_have_count(5)
        expect(series.locator("path")).to_have_attribute("d", re.compile(r"^M[\d.]+,[\d.]+( L[\d.]+,[\d.]+){4}$"))
    expect(curves.locator("[data-best=true]")).to_have_attribute("data-trial", str(best))

    def width(n: int) -> float:
        return float(curves.locator(f"[data-trial='{n}'] path").evaluate("p => getComputedStyle(p).strokeWidth")[:-2])

    assert width(best) > width(1 - best)
    expect(curves).to_contain_text(f"best (trial {best})")

    # The scatter: a point per trial at its choice of lr, the best ringed, higher loss higher up.
    scatter = page.get_by_test_id("scatter-chart")
    expect(scatter).to_have_attribute("data-points", "2")
    expect(scatter).to_have_attribute("data-scale", "category")
    expect(scatter).to_contain_text("0.001")
    expect(scatter).to_contain_text("0.05")
    expect(page.get_by_test_id("scatter-param")).to_be_hidden()  # one parameter: nothing to choose
    points = {int(d["trial"]): d for d in scatter.locator("circle").evaluate_all(
        "cs => cs.map(c => ({trial: c.dataset.trial, best: c.dataset.best, cx: +c.getAttribute('cx'), "
        "cy: +c.getAttribute('cy')}))")}
    assert set(points) == {0, 1} and points[best]["best"] == "true" and points[1 - best]["best"] == "false"
    lr = {n: trials[n]["params"]["train.lr"] for n in trials}
    assert (points[0]["cx"] < points[1]["cx"]) == (lr[0] < lr[1])
    assert (points[0]["cy"] > points[1]["cy"]) == (values[0] < values[1])  # svg y grows downwards
    page.screenshot(path=str(tmp_path / "dashboard-sweep.png"), full_page=True)

    # A trial's job page links back to its sweep.
    page.get_by_test_id(f"trial-row-{best}").get_by_role("link", name=f"job {trials[best]['job_id']}").click()
    expect(page).to_have_url(re.compile(rf"#/jobs/{trials[best]['job_id']}$"))
    expect(page.get_by_test_id("job-state")).to_have_text("succeeded")
    expect(page.get_by_test_id("job-facts")).to_contain_text(f"sweep {sid}, trial {best}")
    back = page.get_by_test_id("job-sweep-link")
    expect(back).to_have_text(f"\u2190 Sweep {sid} (trial {best})")
    back.click()
    expect(page).to_have_url(re.compile(rf"#/sweeps/{sid}$"))
    expect(page.get_by_test_id("trials-table").locator("tbody tr")).to_have_count(2)

    # The list shows it; its row opens the page.
    page.get_by_role("link", name="Sweeps", exact=True).click()
    expect(page).to_have_url(re.compile(r"#/sweeps$"))
    row = page.get_by_test_id(f"sweep-row-{sid}")
    expect(row).to_contain_text("dash-lr")
    expect(row).to_contain_text("grid")
    expect(row).to_contain_text("val_loss (min)")
    expect(page.get_by_test_id(f"sweep-state-{sid}")).to_have_text("succeeded")
    expect(page.get_by_test_id(f"sweep-trials-{sid}")).to_have_text("2/2 · 2 succeeded")
    expect(page.get_by_test_id(f"sweep-best-{sid}")).to_have_text(f"{values[best]:.4f} (trial {best})")
    row.get_by_role("link", name="dash-lr").click()
    expect(page).to_have_url(re.compile(rf"#/sweeps/{sid}$"))
    expect(page.get_by_test_id("sweep-state")).to_have_text("succeeded")
    # The jobs list says which sweep a trial belongs to.
    page.get_by_role("link", name="Jobs", exact=True).click()
    expect(page.get_by_test_id(f"job-row-{trials[0]['job_id']}")).to_contain_text(f"sweep {sid} trial 0")
    assert watched.errors == []


def test_cancel_a_running_sweep_from_its_page(live, watched):
    sweep = {"name": "dash-cancel", "job": slow_job(epochs=30), "method": "grid", "max_concurrent": 1,
             "parameters": {"train.lr": {"type": "choice", "values": [0.001, 0.002]}}}
    with live.client() as c:
        r = c.post("/sweeps", json=sweep)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            live.wait_until(lambda: c.get(f"/sweeps/{sid}").json()["counts"]["running"] == 1, 60, "a running trial")
            page = watched.page
            page.goto(f"{live.url}/#/sweeps/{sid}")
            expect(page.get_by_test_id("sweep-state")).to_have_text("running")
            expect(page.get_by_test_id("trial-state-0")).to_have_text("running")
            cancel = page.get_by_role("button", name=f"Cancel sweep {sid}")
            cancel.click()
            expect(page.get_by_test_id("sweep-state")).to_have_text("cancelled")
            expect(cancel).to_be_hidden()
            expect(page.get_by_test_id("sweep-facts")).to_contain_text("cancelled by request")
            expect(page.get_by_test_id("trial-state-0")).to_have_text("cancelled", timeout=30_000)
            got = c.get(f"/sweeps/{sid}").json()
            assert got["state"] == "cancelled" and got["trials"][0]["state"] == "cancelled", got
            assert watched.errors == []
        finally:
            c.post(f"/sweeps/{sid}/cancel")  # free the worker whatever happened (409 once ended)


def recorded_sweep(state: str = "running") -> dict:
    """A TPE sweep over a log-scale lr and a choice of layers, as GET /sweeps/{id} gives it mid-way: trial 2
    the best so far, trial 1 pruned, trial 3 running, trial 4 queued."""
    def trial(n, state, lr, hidden, value, epoch, failure=None, best=False):
        return {"trial": n, "job_id": 900 + n, "state": state, "failure": failure,
                "params": {"train.lr": lr, "model.hidden": hidden}, "value": value, "epoch": epoch, "epochs": 8,
                "best": best, "created_at": 1790000000.0 + n, "started_at": None, "finished_at": None}
    trials = [trial(0, "succeeded", 0.001, [8], 0.30, 8), trial(1, "failed", 0.0001, [16, 16], 0.9, 2, "pruned"),
              trial(2, "succeeded", 0.01, [16, 16], 0.12, 8, best=True), trial(3, "running", 0.1, [8], 0.5, 3),
              trial(4, "queued", 0.02, [8], None, 0)]
    parameters = {"train.lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True},
                  "model.hidden": {"type": "choice", "values": [[8], [16, 16]]}}
    return {"id": 9001, "name": "recorded", "state": state, "method": "tpe", "metric": "val_loss",
            "direction": "minimize", "max_trials": 6, "max_concurrent": 2, "trial_count": 5,
            "counts": {"queued": 1, "running": 1, "succeeded": 2, "pruned": 1, "failed": 0, "cancelled": 0},
            "best": {"trial": 2, "job_id": 902, "params": trials[2]["params"], "value": 0.12},
            "created_at": 1790000000.0, "finished_at": None, "error": None,
            "spec": {"name": "recorded", "job": {"kind": "train"}, "parameters": parameters, "method": "tpe",
                     "metric": "val_loss", "pruner": {"type": "median", "startup_trials": 3, "warmup_epochs": 2}},
            "trials": trials}


def recorded_curves(sweep: dict) -> dict:
    def points(t):
        return [[e, round(t["value"] + 0.1 * (t["epoch"] - e), 4)] for e in range(1, t["epoch"] + 1)]
    return {"metric": "val_loss", "direction": "minimize",
            "trials": [{k: t[k] for k in ("trial", "job_id", "state", "failure", "best")} | {"points": points(t)}
                       for t in sweep["trials"]]}


def paged_curves(sweep: dict, route, log: list, asked: list) -> dict:
    """The curves as the server pages them: points in the order they were recorded (`log`, grown with the sweep's
    new epochs), three a page, `since` and `next` positions in that order (each `since` asked kept in `asked`)."""
    asked_since = re.search(r"[?&]since=(\d+)", route.request.url)
    assert asked_since, route.request.url
    since = int(asked_since.group(1))
    whole = recorded_curves(sweep)
    for t in whole["trials"]:
        log.extend((t["trial"], p) for p in t["points"] if (t["trial"], p[0]) not in {(n, q[0]) for n, q in log})
    page = log[since:since + 3]
    for t in whole["trials"]:
        t["points"] = [p for n, p in page if n == t["trial"]]
    asked.append(since)
    return {**whole, "next": since + len(page), "more": since + len(page) < len(log)}


def test_sweep_page_from_recorded_payloads_log_axis_pruned_curves_live_updates_and_cancel(live, watched):
    """No search runs here: the page is fed a sweep mid-way (what the real server gives is the test above)."""
    sweep = recorded_sweep()
    cancels, log, asked = [], [], []

    def sweep_route(route):
        if route.request.method == "POST":
            cancels.append(route.request.all_headers().get("authorization"))
            sweep.update(state="cancelled", finished_at=1790000100.0)
        route.fulfill(json=sweep)

    page = watched.page
    page.route("**/sweeps/9001", sweep_route)
    page.route("**/sweeps/9001/cancel", sweep_route)
    page.route("**/sweeps/9001/curves?*", lambda route: route.fulfill(json=paged_curves(sweep, route, log, asked)))
    page.goto(f"{live.url}/#/sweeps/9001")
    expect(page.get_by_test_id("sweep-state")).to_have_text("running")
    expect(page.get_by_test_id("sweep-facts")).to_contain_text("tpe · median pruner")
    expect(page.get_by_test_id("sweep-facts")).to_contain_text("1 running · 1 queued · 2 succeeded · 1 pruned")
    expect(page.get_by_test_id("trials-table").locator("tbody tr")).to_have_count(5)
    expect(page.get_by_test_id("trial-state-1")).to_have_text("pruned")
    expect(page.get_by_test_id("trial-row-1")).to_have_attribute("data-state", "pruned")
    expect(page.get_by_test_id("trial-row-2")).to_have_attribute("data-best", "true")
    expect(page.get_by_test_id("trial-row-2")).to_have_class(re.compile(r"\bbest\b"))
    expect(page.get_by_test_id("trial-row-4").locator("td[data-param='model.hidden']")).to_have_text("[8]")
    expect(page.get_by_test_id("trial-value-4")).to_have_text("–")

    # Sorting: by value (trial 4 has none: last both ways), by a list-valued parameter, by state.
    page.get_by_test_id("trials-sort-value").click()
    assert sweep_rows(page) == [2, 0, 3, 1, 4]
    page.get_by_test_id("trials-sort-value").click()
    assert sweep_rows(page) == [1, 3, 0, 2, 4]
    page.get_by_test_id("trials-sort-param:train.lr").click()
    assert sweep_rows(page) == [1, 0, 2, 4, 3]
    page.get_by_test_id("trials-sort-state").click()
    assert sweep_rows(page) == [1, 4, 3, 0, 2]  # pruned, queued, running, succeeded
    page.get_by_test_id("trials-sort-trial").click()
    assert sweep_rows(page) == [0, 1, 2, 3, 4]

    # Curves: the pruned trial dashed, the best heavier than the rest.
    curves = page.get_by_test_id("curves-chart")
    expect(curves.locator("[data-series]")).to_have_count(5)
    expect(curves.locator("[data-trial='1']")).to_have_attribute("data-points", "2")
    expect(curves.locator("[data-trial='3']")).to_have_attribute("data-points", "3")

    def style(n: int, prop: str) -> str:
        return curves.locator(f"[data-trial='{n}'] path").evaluate(f"p => getComputedStyle(p).{prop}")

    assert style(1, "strokeDasharray") not in ("none", "")
    assert style(0, "strokeDasharray") == "none" and style(2, "strokeDasharray") == "none"
    assert float(style(2, "strokeWidth")[:-2]) > float(style(0, "strokeWidth")[:-2])
    expect(curves).to_contain_text("pruned")

    # The scatter on a log axis: 0.001, 0.01 and 0.1 evenly apart; four trials have a value.
    scatter = page.get_by_test_id("scatter-chart")
    expect(scatter).to_have_attribute("data-scale", "log")
    expect(scatter).to_have_attribute("data-points", "4")
    expect(scatter).to_contain_text("train.lr (log scale)")
    cx = {int(c["t"]): c["x"] for c in scatter.locator("circle").evaluate_all(
        "cs => cs.map(c => ({t: c.dataset.trial, x: +c.getAttribute('cx')}))")}
    assert set(cx) == {0, 1, 2, 3}
    assert cx[2] - cx[0] == pytest.approx(cx[3] - cx[2], abs=0.2)
    assert cx[0] - cx[1] == pytest.approx(cx[2] - cx[0], abs=0.2)
    expect(scatter.locator("circle.best")).to_have_attribute("data-trial", "2")
    # The other parameter, a choice of lists: one category per value, in the spec's order.
    select = page.get_by_test_id("scatter-param")
    expect(select).to_be_visible()
    select.select_option("model.hidden")
    expect(scatter).to_have_attribute("data-scale", "category")
    expect(scatter).to_contain_text("[16,16]")
    cx = {int(c["t"]): c["x"] for c in scatter.locator("circle").evaluate_all(
        "cs => cs.map(c => ({t: c.dataset.trial, x: +c.getAttribute('cx')}))")}
    assert cx[0] == cx[3] < cx[1] == cx[2]

    # Live: trial 3 reports more epochs and becomes the best; the page follows without a reload.
    sweep["trials"][3].update(value=0.05, epoch=6)
    sweep["trials"][2]["best"], sweep["trials"][3]["best"] = False, True
    sweep["best"] = {"trial": 3, "job_id": 903, "params": sweep["trials"][3]["params"], "value": 0.05}
    expect(page.get_by_test_id("trial-row-3")).to_have_attribute("data-best", "true")
    expect(page.get_by_test_id("trial-row-2")).to_have_attribute("data-best", "false")
    expect(page.get_by_test_id("trial-row-3")).to_contain_text("6/8")
    expect(curves.locator("[data-trial='3']")).to_have_attribute("data-points", "6")
    # The page read the curves a page at a time, and later only the points after its cursor.
    assert asked[:8] == [0, 3, 6, 9, 12, 15, 18, 21] and 0 not in asked[1:], asked
    expect(page.get_by_test_id("sweep-best")).to_contain_text("trial 3 (job 903)")
    expect(select).to_have_value("model.hidden")  # the choice survives polling

    cancel = page.get_by_role("button", name="Cancel sweep 9001")
    cancel.click()
    expect(page.get_by_test_id("sweep-state")).to_have_text("cancelled")
    expect(cancel).to_be_hidden()
    assert len(cancels) == 1
    assert watched.errors == []


def test_a_pruned_trial_is_pruned_in_the_list_and_on_its_page_and_runs_to_its_end_from_there(live, watched):
    """A real sweep whose second trial is pruned (lr 1e-6 against the finished lr 0.05): not a red `failed`, and
    its one action is to run it to its end."""
    with live.client() as c:
        # (seed 1: the good trial first, the median the poor one is judged by.)
        r = c.post("/sweeps", json={"name": "dash-prune", "job": tiny_job(600, batch_size=8), "method": "grid",
                                    "seed": 1, "max_concurrent": 1,
                                    "parameters": {"train.lr": {"type": "choice", "values": [0.05, 1e-6]}},
                                    "pruner": {"type": "median", "startup_trials": 1, "warmup_epochs": 5}})
        assert r.status_code == 201, r.text
    done = wait_sweep(live, r.json()["id"])
    jid = next((t["job_id"] for t in done["trials"] if t["state"] == "pruned"), None)
    assert jid is not None, done["trials"]
    page = watched.page
    page.goto(live.url + "/")
    badge = state_cell(page, jid)
    expect(badge).to_have_text("pruned")
    expect(badge).to_have_class(re.compile(r"\bstate-pruned\b"))
    assert badge.evaluate("b => getComputedStyle(b).color") != page.evaluate(
        "() => { const b = document.createElement('span'); b.className = 'badge state-failed';"
        " document.body.append(b); const c = getComputedStyle(b).color; b.remove(); return c; }")
    expect(page.get_by_test_id(f"job-row-{jid}")).to_have_attribute("data-state", "pruned")
    expect(page.get_by_test_id(f"retry-{jid}")).to_have_text("Run to end")

    page.goto(f"{live.url}/#/jobs/{jid}")
    expect(page.get_by_test_id("job-state")).to_have_text("pruned")
    expect(page.get_by_test_id("job-error")).to_contain_text("Pruned")
    expect(page.get_by_test_id("job-error")).to_contain_text("worse than the median")
    page.get_by_role("button", name=f"Run to end job {jid}").click()
    expect(page.get_by_test_id("job-state")).to_have_text(re.compile(r"^(queued|running|succeeded)$"))
    ended = live.wait_state(jid, timeout=120)
    assert ended["state"] == "succeeded" and ended["progress"]["epoch"] == 600, ended
    expect(page.get_by_test_id("job-state")).to_have_text("succeeded")
    assert watched.errors == []


def spiky_sweep(sweep_id: int, spike: float | None) -> tuple[dict, dict]:
    """A finished sweep of twenty trials of ten epochs whose val_loss falls from about 1 towards 0.1; trial 7's
    is `spike` at epoch 2 (none: no spike). The sweep and its curves, as the server gives them."""
    trials, curves = [], []
    for n in range(20):
        points = [[e, round(0.1 + 0.9 / e + 0.01 * n, 4)] for e in range(1, 11)]
        if n == 7 and spike is not None:
            points[1][1] = spike
        trials.append({"trial": n, "job_id": 1000 + n, "state": "succeeded", "failure": None,
                       "params": {"train.lr": 0.001 * (n + 1)}, "value": points[-1][1], "epoch": 10, "epochs": 10,
                       "best": n == 0, "created_at": 1790000000.0 + n, "started_at": None, "finished_at": None})
        curves.append({"trial": n, "job_id": 1000 + n, "state": "succeeded", "failure": None, "best": n == 0,
                       "points": points})
    sweep = {"id": sweep_id, "name": "spiky", "state": "succeeded", "method": "random", "metric": "val_loss",
             "direction": "minimize", "max_trials": 20, "max_concurrent": 4, "trial_count": 20,
             "counts": {"queued": 0, "running": 0, "succeeded": 20, "pruned": 0, "failed": 0, "cancelled": 0},
             "best": {"trial": 0, "job_id": 1000, "params": trials[0]["params"], "value": trials[0]["value"]},
             "created_at": 1790000000.0, "finished_at": 1790000100.0, "error": None,
             "spec": {"name": "spiky", "job": {"kind": "train"}, "method": "random", "metric": "val_loss",
                      "parameters": {"train.lr": {"type": "float", "low": 1e-3, "high": 0.02}}},
             "trials": trials}
    return sweep, {"metric": "val_loss", "direction": "minimize", "trials": curves}


def route_sweep(page, sweep: dict, curves: dict) -> None:
    def curves_route(route):
        since = int(re.search(r"[?&]since=(\d+)", route.request.url).group(1))
        total = sum(len(t["points"]) for t in curves["trials"])
        page_ = curves if since == 0 else {**curves, "trials": [{**t, "points": []} for t in curves["trials"]]}
        route.fulfill(json={**page_, "next": total, "more": False})
    page.route(f"**/sweeps/{sweep['id']}", lambda route: route.fulfill(json=sweep))
    page.route(f"**/sweeps/{sweep['id']}/curves?*", curves_route)


def test_one_trials_spike_does_not_flatten_the_other_curves(live, watched):
    """The curves' y axis follows the bulk of the points (a note says what is beyond it, drawn on its edge); with no
    spike it spans every point."""
    page = watched.page
    spiky, spiky_curves = spiky_sweep(9101, 6.5)
    calm, calm_curves = spiky_sweep(9102, None)
    route_sweep(page, spiky, spiky_curves)
    route_sweep(page, calm, calm_curves)

    page.goto(f"{live.url}/#/sweeps/9101")
    chart = page.get_by_test_id("curves-chart")
    expect(chart.locator("[data-series]")).to_have_count(20)
    expect(chart).to_have_attribute("data-clipped", "true")
    assert float(chart.get_attribute("data-ymax")) < 2  # the bulk tops out near 1.2, not at 6.5
    note = page.get_by_test_id("curves-clip-note")
    expect(note).to_contain_text("follows the bulk of the curves")
    expect(note).to_contain_text("1 point beyond it (as far as 6.5000)")
    spike = chart.locator("[data-trial='7'] circle.clipped")
    expect(spike).to_have_count(1)
    # The spike sits on the axis's top edge; the other curves spread over most of the plot's height.
    tops = chart.locator("[data-series] circle").evaluate_all("cs => cs.map(c => +c.getAttribute('cy'))")
    assert min(tops) == pytest.approx(30, abs=0.2)
    others = chart.locator("[data-series]:not([data-trial='7']) circle").evaluate_all(
        "cs => cs.map(c => +c.getAttribute('cy'))")
    assert max(others) - min(others) > 0.6 * (260 - 30 - 36)

    page.goto(f"{live.url}/#/sweeps/9102")
    expect(page.get_by_test_id("sweep-state")).to_have_text("succeeded")
    expect(chart).to_have_attribute("data-clipped", "false")
    expect(page.get_by_test_id("curves-clip-note")).to_have_count(0)
    assert watched.errors == []
