"""Why a queued job waits: placement.why_waiting fed the workers of a recorded mixed fleet (an 8x H100
host, an L4 box, a CPU-only host), through the same job records the queue makes."""
from dataclasses import replace

import pytest

from tests.conftest import tiny_job
from trainyard.app import placement, queue, schema
from trainyard.app.db import make_engine
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
    schema.upgrade(e)
    yield e
    e.dispose()


def job(engine, needs=None, **over):
    j, _ = queue.enqueue(engine, parse_spec({**tiny_job(), "device": "auto", **over}), needs=needs)
    return j


def test_a_job_that_fits_somewhere_only_waits_its_turn(engine):
    assert placement.why_waiting(job(engine, resources={"gpu_memory_gb": 80}), FLEET) is None  # an H100 offers 85.5
    assert placement.why_waiting(job(engine), FLEET) is None


def test_a_job_no_card_can_hold_says_the_largest_there_is(engine):
    why = placement.why_waiting(job(engine, resources={"gpu_memory_gb": 100}), FLEET)
    assert why == "needs 100.0 GB of GPU memory; the most a live worker offers is 85.5 GB (h100-box cuda:0)"
    l4_only = [w for w in FLEET if w["host"] != "h100-box"]
    assert "the most a live worker offers is 23.0 GB (l4-box cuda:0)" in placement.why_waiting(
        job(engine, resources={"gpu_memory_gb": 40}), l4_only)
    cpu_only = [w for w in FLEET if w["device"] == "cpu"]
    assert "no live worker for device auto offers GPU memory" in placement.why_waiting(
        job(engine, resources={"gpu_memory_gb": 1}), cpu_only)


def test_device_plugin_draining_and_no_worker(engine):
    assert placement.why_waiting(job(engine, device="cuda:9"), FLEET) == "no live worker serves device cuda:9"
    plugin_job = job(engine, needs={"models": "tinynet"}, model={"arch": "tinynet"})
    assert placement.why_waiting(plugin_job, FLEET) == "no live worker for device auto has the model plugin 'tinynet'"
    run = replace(job(engine), need_entrypoint="cifar_loop")
    assert placement.why_waiting(run, FLEET) is None  # the CPU box has it
    assert placement.why_waiting(job(engine, device="cpu"), [{**w, "draining": True} for w in FLEET]) == \
        "every live worker for device cpu is draining"
    assert placement.why_waiting(job(engine), []) == "no worker is running"


def test_a_job_on_more_devices_than_any_host_has_says_the_most_there_is(engine):
    assert placement.why_waiting(job(engine, devices=8), FLEET) is None  # the H100 box has 8
    assert placement.why_waiting(job(engine, devices=9), FLEET) == \
        "needs 9 devices of one host; the most live, undrained workers of one kind on one host is 8 (h100-box)"
    assert placement.why_waiting(job(engine, devices=2, device="cpu"), FLEET) == \
        "needs 2 devices of one host; the most live, undrained workers of one kind on one host is 1 (cpu-box)"
    half_drained = [{**w, "draining": w["device"] in ("cuda:0", "cuda:1")} for w in FLEET]
    assert "is 6 (h100-box)" in placement.why_waiting(job(engine, devices=8), half_drained)
