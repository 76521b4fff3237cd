"""Why a queued job waits: waiting.why_waiting fed the workers of a recorded mixed fleet (an 8x H100
host, an L4 box, a CPU-only host), through the same job records the queue makes."""
from dataclasses import replace

import pytest

from tests.helpers.jobs import tiny_job
from trainyard.app.db import make_engine, migrate
from trainyard.app.fleet import placement, waiting
from trainyard.app.jobs import queue, submit
from trainyard.app.spec import parse_spec

H100, L4 = 85_520_809_984, 23_034_069_504


def worker(host, device, budget=None, plugins=None, draining=False):
    return {"id": f"{host}-{device}", "host": host, "device": device, "draining": draining,
            "stats": {"slot": {"key": f"{host}/{device}", "budget": budget}, "plugins": plugins or {}}}


FLEET = [*(worker("h100-box", f"cuda:{i}", H100) for i in range(8)), worker("l4-box", "cuda:0", L4),
         worker("cpu-box", "cpu", plugins={"entrypoints": ["cifar_loop"]})]


@pytest.fixture
def engine(tmp_path):
    e = make_engine(f"sqlite:///{tmp_path / 'q.db'}")
    migrate.upgrade(e)
    yield e
    e.dispose()


def job(engine, needs=None, **over):
    j, _ = submit.enqueue(engine, parse_spec({**tiny_job(), "device": "auto", **over}), needs=needs)
    return j


def test_a_job_that_fits_somewhere_only_waits_its_turn(engine):
    assert waiting.why_waiting(job(engine, resources={"gpu_memory_gb": 80}), FLEET) is None  # an H100 offers 85.5
    assert waiting.why_waiting(job(engine), FLEET) is None


def test_a_job_no_card_can_hold_says_the_largest_there_is(engine):
    why = waiting.why_waiting(job(engine, resources={"gpu_memory_gb": 100}), FLEET)
    assert why == "needs 100.0 GB of GPU memory; the most a live worker offers is 85.5 GB (h100-box cuda:0)"
    l4_only = [w for w in FLEET if w["host"] != "h100-box"]
    assert "the most a live worker offers is 23.0 GB (l4-box cuda:0)" in waiting.why_waiting(
        job(engine, resources={"gpu_memory_gb": 40}), l4_only)
    cpu_only = [w for w in FLEET if w["device"] == "cpu"]
    assert "no live worker for device auto offers GPU memory" in waiting.why_waiting(
        job(engine, resources={"gpu_memory_gb": 1}), cpu_only)


def test_device_plugin_draining_and_no_worker(engine):
    assert waiting.why_waiting(job(engine, device="cuda:9"), FLEET) == "no live worker serves device cuda:9"
    plugin_job = job(engine, needs={"models": "tinynet"}, model={"arch": "tinynet"})
    assert waiting.why_waiting(plugin_job, FLEET) == "no live worker for device auto has the model plugin 'tinynet'"
    run = replace(job(engine), need_entrypoint="cifar_loop")
    assert waiting.why_waiting(run, FLEET) is None  # the CPU box has it
    assert waiting.why_waiting(job(engine, device="cpu"), [{**w, "draining": True} for w in FLEET]) == \
        "every live worker for device cpu is draining"
    assert waiting.why_waiting(job(engine), []) == "no worker is running"


def test_a_job_on_more_devices_than_any_host_has_says_the_most_there_is(engine):
    assert waiting.why_waiting(job(engine, devices=8), FLEET) is None  # the H100 box has 8
    assert waiting.why_waiting(job(engine, devices=9), FLEET) == \
        ("needs 9 devices of one host; the most live, undrained workers of one kind on one host is 8 (h100-box); "
         "set hosts to spread the job over several")
    assert waiting.why_waiting(job(engine, devices=2, device="cpu"), FLEET) == \
        ("needs 2 devices of one host; the most live, undrained workers of one kind on one host is 1 (cpu-box); "
         "set hosts to spread the job over several")
    half_drained = [{**w, "draining": w["device"] in ("cuda:0", "cuda:1")} for w in FLEET]
    assert "is 6 (h100-box)" in waiting.why_waiting(job(engine, devices=8), half_drained)


def test_each_job_on_a_gpu_is_counted_with_headroom_for_its_cuda_context(engine):
    """Two jobs stating 40 GB each on an 80 GB card would fill it to the byte, but each process's CUDA
    context (0.5-1 GB, outside its allocator cap) comes on top: the second waits."""
    gpu = placement.Slot("GPU-aaaa", budget=80 * 10**9, headroom=1 << 30)
    first = job(engine, resources={"gpu_memory_gb": 40})
    second = job(engine, resources={"gpu_memory_gb": 40})
    small = job(engine, resources={"gpu_memory_gb": 30})
    got = queue.claim(engine, "w1", "cuda:0", 10, None, gpu)
    assert got.id == first.id
    assert queue.claim(engine, "w2", "cuda:0", 10, None, gpu) is None  # 40 + 1 GiB + 40 + 1 GiB > 80
    assert queue.succeed(engine, got.id, got.claim, {}, None)
    assert queue.claim(engine, "w2", "cuda:0", 10, None, gpu).id == second.id
    assert queue.claim(engine, "w3", "cuda:0", 10, None, gpu).id == small.id  # 41.07 + 31.07 GB fit in 80
    # A job stating all the card offers never fits beside its own context: it says why.
    whole = job(engine, resources={"gpu_memory_gb": 85})
    fleet = [{**w, "stats": {**w["stats"], "slot": {**w["stats"]["slot"], "headroom": 1 << 30}}} for w in FLEET]
    assert waiting.why_waiting(whole, fleet) == (
        "needs 85.0 GB of GPU memory; the most a live worker offers is 84.4 GB, after 1.1 GB of headroom for its "
        "CUDA context (h100-box cuda:0)")
    assert waiting.why_waiting(whole, FLEET) is None  # a worker without headroom: 85.5 GB


def test_gpu_workers_claim_with_the_configured_headroom(tmp_path):
    from trainyard.app.core.settings import Settings
    from trainyard.worker.supervisor.main import Worker
    reading = {"device_uuid": "GPU-aaaa", "gpus": [{"uuid": "GPU-aaaa", "memory_total": H100}]}
    for headroom in (1 << 30, 0):
        w = Worker(Settings(data_dir=tmp_path, gpu_context_headroom_bytes=headroom), device="cpu")
        w.device = "cuda:0"  # as a worker started on a GPU host's first card
        assert w._slot(reading) == placement.Slot("GPU-aaaa", H100, headroom=headroom)
        w.device = "cpu"
        assert w._slot(reading).headroom == 0
        w.engine.dispose()
    assert Settings(data_dir=tmp_path).gpu_context_headroom_bytes == 1 << 30


def test_a_job_only_unavailable_workers_serve_waits_with_their_reason(engine):
    why = "cuda:0: CUDA is not available: no NVIDIA driver is visible to this process"
    broken = {**worker("old-box", "cuda:0"), "state": "unavailable", "stats": {"unavailable": why}}
    cpu_only = [worker("cpu-box", "cpu"), broken]
    assert waiting.why_waiting(job(engine, device="cuda"), cpu_only) == \
        f"no live worker can use a device for cuda: worker old-box-cuda:0 on old-box is unavailable: {why}"
    assert waiting.why_waiting(job(engine), cpu_only) is None  # `auto`: the CPU worker takes it
    assert waiting.why_waiting(job(engine, device="cuda"), [broken, {**broken, "id": "b2"}]).endswith(
        f"is unavailable (and 1 more unavailable): {why}")
    assert waiting.why_waiting(job(engine, device="cuda"), [*FLEET, broken]) is None  # a usable GPU worker too
