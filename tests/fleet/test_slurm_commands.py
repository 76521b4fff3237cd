"""Jobs on Slurm without Slurm: the arguments trainyard gives sbatch (argument lists, hostile values refused),
squeue's answer parsed, the spec's Slurm fields and the service's checks on them, and the claim's binding: a
job on Slurm is taken by its allocation's workers alone, which take nothing else, and nothing once the agent saw
their allocation end (app/fleet/placement.py), on each backend. The real cluster: tests/fleet/test_slurm.py."""
import shlex
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import insert, select, update

from tests.helpers.jobs import tiny_job
from trainyard.app.clusters import slurm
from trainyard.app.core.errors import Invalid
from trainyard.app.core.settings import Settings
from trainyard.app.db import jobs, read, write
from trainyard.app.db.tables import slurm_allocations
from trainyard.app.fleet import placement, waiting
from trainyard.app.fleet import workers as registry
from trainyard.app.jobs import queue, submit
from trainyard.app.records import Job
from trainyard.app.spec import parse_spec
from trainyard.app.spec import slurm as slurm_spec

LEASE = 10.0
OUT = Path("/data/slurm")


def test_sbatch_gets_one_argument_per_option_and_the_script_runs_one_bound_worker_per_task():
    ask = slurm.Ask(job_id=7, nodes=2, tasks_per_node=1, partition="main", cpus_per_task=2, mem_mb=2048,
                    time_limit_min=30, account="lab-a", qos="normal", options=("--exclusive",))
    assert slurm.sbatch_argv(ask, OUT) == [
        "sbatch", "--parsable", "--job-name=trainyard-7", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2",
        "--partition=main", "--output=/data/slurm/%j.out", "--chdir=/data/slurm", "--no-requeue", "--mem=2048M",
        "--time=30", "--account=lab-a", "--qos=normal", "--exclusive"]
    gpu = slurm.sbatch_argv(slurm.Ask(job_id=8, nodes=1, tasks_per_node=4, partition="gpu", gpus_per_node=4), OUT)
    assert "--gpus-per-node=4" in gpu and "--ntasks-per-node=4" in gpu
    script = slurm.batch_script(slurm.worker_argv(7, "cpu"))
    assert script.splitlines()[0] == "#!/bin/sh"
    assert shlex.split(script.splitlines()[1]) == ["exec", "srun", "--kill-on-bad-exit=0", sys.executable, "-m",
                                                   "trainyard", "worker", "--for-job", "7", "--device", "cpu"]


@pytest.mark.parametrize("field,value", [
    ("partition", "main; rm -rf /"), ("partition", "two words"), ("partition", "a,b"), ("partition", "--qos=x"),
    ("partition", ""), ("account", "a$(id)"), ("qos", "x\nqos"), ("partition", "p" * 65)])
def test_a_name_that_is_not_a_slurm_name_is_refused_naming_its_field(field, value):
    ask = slurm.Ask(job_id=1, nodes=1, tasks_per_node=1, partition="main")
    with pytest.raises(slurm.Refused, match=f"^{field}: "):
        slurm.sbatch_argv(slurm.Ask(**{**ask.__dict__, field: value}), OUT)


@pytest.mark.parametrize("value", ["30", "1:00:00", -1, 0, True, 1.5, None, 10**12])
def test_a_time_limit_or_a_count_that_is_not_a_positive_whole_number_is_refused(value):
    ask = slurm.Ask(job_id=1, nodes=1, tasks_per_node=1, partition="main")
    if value is not None:
        with pytest.raises(slurm.Refused, match="^time_limit_min: "):
            slurm.sbatch_argv(slurm.Ask(**{**ask.__dict__, "time_limit_min": value}), OUT)
    with pytest.raises(slurm.Refused, match="^hosts: "):
        slurm.sbatch_argv(slurm.Ask(**{**ask.__dict__, "nodes": value}), OUT)


def test_the_operators_sbatch_options_are_options_each_and_never_what_trainyard_sets():
    assert slurm.operator_options("--exclusive --constraint='intel&avx2' --comment=\"two words\"") == (
        "--exclusive", "--constraint=intel&avx2", "--comment=two words")
    assert slurm.operator_options("") == ()
    for bad, why in (("-p main", "is not one --option"), ("script.sh", "is not one --option"),
                     ("--partition=debug", "--partition is trainyard's"), ("--wrap=id", "--wrap is trainyard's"),
                     ("--x='unclosed", "No closing quotation"), ("--comment=$'a\\nb'", None)):
        if why is None:
            assert slurm.operator_options(bad) == ("--comment=$a\\nb",)  # a shell's syntax is only text here
            continue
        with pytest.raises(slurm.Refused, match=why):
            slurm.operator_options(bad)


def test_squeue_lines_of_trainyard_allocations_are_read_and_others_left_out():
    text = ("12|PENDING|main|(null)|Resources|trainyard-5\n"
            "13|RUNNING|main|n1,n2|None|trainyard-6\n"
            "14|CANCELLED|urgent|n1|None|trainyard-7\n"
            "15|RUNNING|main|n2|None|someone-elses-job\n"
            "16|RUNNING|main|n2|None|trainyard-x|y\n"
            "garbage\n17|PENDING|main|(null)|(Priority)|trainyard-8\n")
    seen = slurm.parse_squeue(text)
    assert sorted(seen) == ["12", "13", "14", "17"]
    assert seen["12"] == slurm.Seen("12", 5, "PENDING", "main", None, "Resources")
    assert seen["13"] == slurm.Seen("13", 6, "RUNNING", "main", "n1,n2", None)
    assert seen["14"].state == "CANCELLED" and seen["14"].state in slurm.FINAL
    assert seen["17"].reason == "Priority"
    assert "RUNNING" not in slurm.FINAL and "PENDING" not in slurm.FINAL


def test_every_final_state_ends_a_run_with_a_class_the_house_knows():
    assert slurm.ENDINGS["TIMEOUT"].cls == "timeout" and slurm.ENDINGS["TIMEOUT"].final == "failed"
    assert slurm.ENDINGS["CANCELLED"].final == "cancelled"
    assert slurm.ENDINGS["PREEMPTED"].cls is None  # requeued without an attempt, as a preempted run is
    assert slurm.ENDINGS["NODE_FAIL"].cls == "infrastructure" and slurm.ENDINGS["NODE_FAIL"].final is None


def test_the_spec_takes_a_jobs_slurm_choices_and_refuses_what_is_not_a_slurm_name():
    spec = parse_spec({**tiny_job(), "slurm": {"partition": "main", "time_limit_min": 5}})
    assert spec.runs_on == "slurm" and spec.slurm is not None and spec.slurm.partition == "main"
    assert parse_spec(tiny_job()).runs_on is None
    for bad, where in (({"partition": "a;b"}, "partition"), ({"time_limit_min": "10"}, "time_limit_min"),
                       ({"time_limit_min": 0}, "time_limit_min"), ({"sbatch": "--x"}, "sbatch")):
        with pytest.raises(ValidationError) as got:
            parse_spec({**tiny_job(), "slurm": bad})
        assert got.value.errors()[0]["loc"][-2:] == ("slurm", where) or got.value.errors()[0]["loc"][-1] == where
    with pytest.raises(ValidationError, match="runs_on workers takes no Slurm fields"):
        parse_spec({**tiny_job(), "runs_on": "workers", "slurm": {}})


def test_the_service_refuses_what_it_does_not_offer_and_fills_in_where_a_job_runs():
    none = Settings()
    spec = parse_spec({**tiny_job(), "runs_on": "slurm"})
    with pytest.raises(Invalid, match="runs no job on Slurm") as got:
        slurm_spec.resolve(spec, none)
    assert got.value.loc == ("runs_on",)
    on = Settings(slurm_partition="main", slurm_job_partitions="debug", slurm_time_limit_min=60)
    for body, loc in (({"partition": "gpu"}, ("slurm", "partition")), ({"account": "a"}, ("slurm", "account")),
                      ({"time_limit_min": 61}, ("slurm", "time_limit_min"))):
        with pytest.raises(Invalid) as got:
            slurm_spec.resolve(parse_spec({**tiny_job(), "slurm": body}), on)
        assert got.value.loc == loc
    slurm_spec.resolve(ok := parse_spec({**tiny_job(), "slurm": {"partition": "debug"}}), on)
    assert ok.runs_on == "slurm"
    slurm_spec.resolve(plain := parse_spec(tiny_job()), on)
    assert plain.runs_on is None  # the own fleet's, as before Slurm
    slurm_spec.resolve(default := parse_spec(tiny_job()), on.model_copy(update={"slurm_default": True}))
    assert default.runs_on == "slurm"


def _worker(engine, wid: str, host: str, for_job: int | None = None, allocation: str | None = None,
            addr: str | None = None) -> placement.Slot:
    slot = placement.Slot(wid, addr=addr, gang=1, for_job=for_job, allocation=allocation)
    registry.register_worker(engine, wid, host, 1, "cpu", {"slot": slot.__dict__, "addr": addr})
    return slot


def _on_slurm(engine, **over) -> Job:
    """A queued job that runs on Slurm (as app/jobs/submit.py's INSERT marks it: runs_on from the spec)."""
    job, _ = submit.enqueue(engine, parse_spec({**tiny_job(), "slurm": {}, **over}))
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job.id).values(runs_on="slurm"))
    return Job.from_row(_row(engine, job.id))


def test_a_job_on_slurm_is_claimed_by_its_allocations_workers_alone(engine):
    own = _worker(engine, "own", "hostA")
    slurm_job = _on_slurm(engine)
    assert queue.claim(engine, "own", "cpu", LEASE, None, own) is None  # the own fleet never takes it
    other = _worker(engine, "other", "n1", for_job=slurm_job.id + 1000, allocation="41")
    assert queue.claim(engine, "other", "cpu", LEASE, None, other) is None  # bound to another job
    plain, _ = submit.enqueue(engine, parse_spec(tiny_job()))
    assert queue.claim(engine, "other", "cpu", LEASE, None, other) is None  # a bound worker takes nothing else
    bound = _worker(engine, "bound", "n1", for_job=slurm_job.id, allocation="42")
    got = queue.claim(engine, "bound", "cpu", LEASE, None, bound)
    assert got is not None and got.id == slurm_job.id
    assert queue.claim(engine, "own", "cpu", LEASE, None, own).id == plain.id


def test_a_job_across_nodes_borrows_its_allocations_workers_and_no_one_elses(engine):
    job = _on_slurm(engine, devices=2, hosts=2)
    a = _worker(engine, "a", "n1", for_job=job.id, allocation="50", addr="10.9.0.1")
    _worker(engine, "own-b", "hostB", addr="10.9.0.3")  # an own worker with an address: never a rank of it
    assert queue.claim(engine, "a", "cpu", LEASE, None, a, port=4567) is None
    _worker(engine, "b", "n2", for_job=job.id, allocation="50", addr="10.9.0.2")
    got = queue.claim(engine, "a", "cpu", LEASE, None, a, port=4567)
    assert [(r["worker"], r["host"]) for r in got.ranks] == [("a", "n1"), ("b", "n2")]


def test_a_worker_whose_allocation_ended_takes_nothing_more_and_leaves(engine):
    job = _on_slurm(engine)
    slot = _worker(engine, "w", "n1", for_job=job.id, allocation="60")
    assert not placement.ended(engine, job.id, "60")
    with write(engine) as conn:
        conn.execute(insert(slurm_allocations).values(job_id=job.id, slurm_id="60", state="NODE_FAIL",
                                                      asked_at=0.0, ended_at=1.0))
    assert placement.ended(engine, job.id, "60")
    assert queue.claim(engine, "w", "cpu", LEASE, None, slot) is None
    assert not placement.ended(engine, job.id, "61")  # another allocation of the job is not this one's
    queue.cancel(engine, job.id)
    assert placement.ended(engine, job.id, "61")  # the job is over: every worker bound to it leaves


def test_a_job_waiting_in_slurms_queue_says_so_with_slurms_reason(engine):
    job = _on_slurm(engine)
    settings = Settings()
    assert "waiting for the Slurm agent" in waiting.of_jobs(engine, settings, [job])[job.id]
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.id == job.id).values(slurm={
            "id": "70", "partition": "main", "nodes": None, "state": "PENDING", "reason": "Resources"}))
    job = Job.from_row(_row(engine, job.id))
    assert waiting.of_jobs(engine, settings, [job])[job.id] == \
        "waiting in Slurm's queue: Resources (Slurm job 70, partition main)"


def _row(engine, job_id: int):
    with read(engine) as conn:
        return conn.execute(select(jobs).where(jobs.c.id == job_id)).one()


def test_the_allocations_environment_holds_none_of_the_servers_secrets(tmp_path, monkeypatch):
    """sbatch hands the agent's environment to the workers, whose jobs' code runs with it: the admin token and the
    tracker's credentials stay with the agent."""
    from trainyard.app.clusters.agent import SERVER_SECRETS, Agent
    for name in SERVER_SECRETS:
        monkeypatch.setenv(name, "secret-" + name)
    monkeypatch.setenv("TRAINYARD_LEASE_S", "7")
    agent = Agent(Settings(data_dir=tmp_path / "data", slurm_partition="main"))
    assert not SERVER_SECRETS & set(agent.env) and "TRAINYARD_API_TOKEN" in SERVER_SECRETS
    assert agent.env["TRAINYARD_LEASE_S"] == "7"
    assert agent.env["TRAINYARD_DATA_DIR"] == str((tmp_path / "data").resolve())
