"""Jobs on a real Slurm (tests/helpers/slurm.py: slurmctld, a slurmd per node, munge; nodes as network namespaces),
through trainyard's API: `trainyard slurm-agent` asks for an allocation per job, its workers (`trainyard worker
--for-job`) run the job with every guarantee of the own fleet, and Slurm's endings map to trainyard's (a cancel is
an scancel, an outside scancel a cancel, a time limit a `timeout`, a lost node an `infrastructure` failure that
resumes from the last checkpoint), with no process left in the nodes. PostgreSQL is reached from the nodes
through the bridge; the data directory is shared on disk. Each task takes a node's 2 CPUs, so a job holds whole
nodes and a second one waits in Slurm's queue."""
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.helpers.jobs import IRIS_JOB, slow_job
from tests.helpers.service import Service, metrics, wait_checkpoint
from tests.helpers.slurm import SlurmCluster, slurm_cluster, unavailable
from tests.helpers.sweeps import start_sweep, wait_sweep
from trainyard.app.db import make_engine
from trainyard.app.launcher import postgres_schema
from trainyard.app.records import job_reads

why_not = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.skipif(why_not is not None, reason=str(why_not))]

IRIS = {**IRIS_JOB, "device": "cpu", "train": {**IRIS_JOB["train"], "epochs": 30}}
# The 2-node job: the digits CNN for a few seconds, long enough that its samples/s say something.
SPREAD = {**slow_job(epochs=8), "devices": 2, "hosts": 2}
EPOCHS_PAST_A_NODE = 200
RESULT_FIELDS = {"val_accuracy", "val_loss", "devices", "samples_per_s"}


@dataclass
class OnSlurm:
    cluster: SlurmCluster
    api: Service
    agent: subprocess.Popen
    on_bridge: dict[str, str]  # what a process in a node needs to reach the database

    def slurm_of(self, job_id: int) -> dict:
        """The job's Slurm record as app/records reads it (id, partition, nodes, state, reason)."""
        return job_reads.get_job(make_engine(self.api.env["TRAINYARD_DATABASE_URL"]), job_id).slurm or {}

    def log(self, job_id: int) -> str:
        with self.api.client() as c:
            return c.get(f"/jobs/{job_id}/logs").text

    def no_leftovers(self, timeout: float = 60) -> None:
        """No trainyard allocation in Slurm's queue still running, no process in any node but its slurmd."""
        self.api.wait_until(lambda: not self.cluster.leftovers() and not self.live_allocations(), timeout,
                            f"the nodes to be clean: {self.cluster.leftovers()} {self.live_allocations()}")

    def live_allocations(self) -> list[str]:
        out = self.cluster.run("squeue", "--noheader", "--format=%i %T %j").stdout.split("\n")
        return [line for line in out if "trainyard-" in line]


@pytest.fixture(scope="module")
def on_slurm(tmp_path_factory) -> Iterator[OnSlurm]:
    with slurm_cluster(nodes=2, cpus=2, memory_mb=4096, slurmd_timeout_s=10) as cluster, \
            postgres_schema("slurm") as db_url:
        pg = cluster.network.forward(5432)
        data = tmp_path_factory.mktemp("slurm") / "data"
        api = Service(data, db_url, env={"TRAINYARD_SLURM_PARTITION": cluster.partition,
                                         "TRAINYARD_SLURM_CPUS_PER_RANK": "2", "TRAINYARD_SLURM_POLL_S": "0.5",
                                         # offered to jobs, though Slurm has no such partition: sbatch refuses it
                                         "TRAINYARD_SLURM_JOB_PARTITIONS": "nosuch"})
        on_bridge = {"TRAINYARD_DATABASE_URL": db_url.replace("127.0.0.1:5432", pg)}
        agent = None
        try:
            api.start_server()
            with open(data / "slurm-agent.out", "ab") as out:
                agent = subprocess.Popen([sys.executable, "-m", "trainyard", "slurm-agent"], stdout=out,
                                         stderr=subprocess.STDOUT, env={**api.env, **cluster.env,
                                         "TRAINYARD_SLURM_DATABASE_URL": on_bridge["TRAINYARD_DATABASE_URL"]})
            yield OnSlurm(cluster, api, agent, on_bridge)
        finally:
            if agent is not None:
                agent.send_signal(signal.SIGTERM)
                agent.wait(30)
            api.stop()


def submit_timed(s: OnSlurm, body: dict) -> tuple[dict, float]:
    """The job once running, and seconds from its submit until then."""
    t0 = time.monotonic()
    job = s.api.submit(body)
    s.api.wait_until(lambda: s.api.job(job["id"])["state"] != "queued", 120, f"job {job['id']} to start")
    return job, time.monotonic() - t0


def test_a_1_node_and_a_2_node_job_run_in_allocations_with_the_results_of_the_own_fleet(on_slurm):
    s = on_slurm
    one, one_s = submit_timed(s, {**IRIS, "slurm": {}})
    done = s.api.wait_state(one["id"], timeout=180)
    assert done["state"] == "succeeded", done
    record = s.slurm_of(one["id"])
    assert record["partition"] == s.cluster.partition and record["nodes"] in s.cluster.nodes, record
    assert done["worker_id"].startswith(record["nodes"])  # the node's name, as Slurm calls it
    log = s.log(one["id"])
    assert f"slurm: asked for allocation {record['id']}" in log and f"allocation {record['id']} started on" in log

    two, two_s = submit_timed(s, {**SPREAD, "slurm": {}})
    started = time.monotonic()
    spread = s.api.wait_state(two["id"], timeout=240)
    two_run_s = time.monotonic() - started
    assert spread["state"] == "succeeded", spread
    assert {r["host"] for r in spread["ranks"]} == set(s.cluster.nodes), spread["ranks"]
    assert all(r.get("addr") == s.cluster.addr(r["host"]) for r in spread["ranks"]), spread["ranks"]
    s.no_leftovers()

    # The same two jobs on trainyard's own workers (in the same nodes, outside Slurm), for the results and times.
    own = [s.cluster.network.start_worker(s.api, h, {**s.on_bridge, "TRAINYARD_NODE_ADDR": h.addr})
           for h in s.cluster.network.hosts]
    try:
        mine, mine_s = submit_timed(s, IRIS)
        mine_done = s.api.wait_state(mine["id"], timeout=120)
        mine_two, mine_two_s = submit_timed(s, SPREAD)
        started = time.monotonic()
        mine_spread = s.api.wait_state(mine_two["id"], timeout=240)
        mine_two_run_s = time.monotonic() - started
    finally:
        for w in own:
            w.terminate()
            w.wait(60)
    for ours, theirs in ((done, mine_done), (spread, mine_spread)):
        assert theirs["state"] == "succeeded", theirs
        assert set(ours["result"]) == set(theirs["result"]) and RESULT_FIELDS <= set(ours["result"])
        assert ours["progress"] == theirs["progress"]
    assert done["result"]["val_accuracy"] == pytest.approx(mine_done["result"]["val_accuracy"], abs=0.05)
    assert spread["result"]["devices"] == mine_spread["result"]["devices"] == 2
    print(f"\nsubmit to running: Slurm 1 node {one_s:.1f} s, 2 nodes {two_s:.1f} s; own fleet 1 host {mine_s:.1f} s, "
          f"2 hosts {mine_two_s:.1f} s. 2-node job running to its end: Slurm {two_run_s:.1f} s, own fleet "
          f"{mine_two_run_s:.1f} s; its samples/s: Slurm {spread['result']['samples_per_s']:.0f}, own fleet "
          f"{mine_spread['result']['samples_per_s']:.0f}")
    s.no_leftovers()


def test_a_cancel_in_trainyard_is_an_scancel_and_leaves_nothing_behind(on_slurm):
    s = on_slurm
    job, _ = submit_timed(s, {**slow_job(epochs=500), "devices": 2, "hosts": 2, "slurm": {}})
    wait_checkpoint(s.api, job["id"], 1)
    slurm_id = s.slurm_of(job["id"])["id"]
    with s.api.client() as c:
        assert c.post(f"/jobs/{job['id']}/cancel").status_code == 200
    s.api.wait_until(lambda: not s.live_allocations(), 30, f"Slurm job {slurm_id} to end")
    s.no_leftovers(30)
    assert s.api.job(job["id"])["state"] == "cancelled"


def test_an_scancel_from_outside_cancels_the_job_saying_so(on_slurm):
    s = on_slurm
    job, _ = submit_timed(s, {**slow_job(epochs=500), "slurm": {}})
    wait_checkpoint(s.api, job["id"], 1)
    slurm_id = s.slurm_of(job["id"])["id"]
    s.cluster.run("scancel", slurm_id)
    ended = s.api.wait_state(job["id"], timeout=60)
    assert ended["state"] == "cancelled" and ended["error"]["class"] == "cancelled", ended
    assert f"Slurm job {slurm_id} was cancelled in Slurm, outside trainyard" in ended["error"]["message"]
    assert s.slurm_of(job["id"])["state"] == "CANCELLED"
    s.no_leftovers()


def test_a_job_waiting_for_nodes_says_it_waits_in_slurms_queue_with_slurms_reason(on_slurm):
    s = on_slurm
    first, _ = submit_timed(s, {**slow_job(epochs=500), "devices": 2, "hosts": 2, "slurm": {}})
    second = s.api.submit({**IRIS, "slurm": {}})
    s.api.wait_until(lambda: (s.api.job(second["id"])["waiting_for"] or "").startswith(
        "waiting in Slurm's queue: Resources"), 30, "the second job to wait in Slurm's queue")
    with s.api.client() as c:
        listed = {j["id"]: j for j in c.get("/jobs", params={"state": "queued"}).json()["data"]}
    assert listed[second["id"]]["waiting_for"].startswith("waiting in Slurm's queue: Resources")
    with s.api.client() as c:
        c.post(f"/jobs/{first['id']}/cancel")
    assert s.api.wait_state(second["id"], timeout=120)["state"] == "succeeded"
    s.no_leftovers()


def test_allocations_that_end_before_the_job_starts_are_asked_again_then_the_job_fails_saying_why(on_slurm):
    s = on_slurm
    job = s.api.submit({**IRIS, "slurm": {"partition": "nosuch"}})
    ended = s.api.wait_state(job["id"], timeout=60)
    assert ended["state"] == "failed" and ended["error"]["type"] == "SlurmAllocationsLost", ended
    assert ended["error"]["class"] == "infrastructure" and ended["runs"] == 0
    message = ended["error"]["message"]
    assert message.startswith("3 Slurm allocations ended before the job started") and "REFUSED" in message, message
    assert "invalid partition" in message.lower(), message
    assert s.log(job["id"]).count("slurm: sbatch refused") == 3


def test_a_time_limit_fails_the_run_as_timeout_and_a_retry_resumes_from_its_checkpoint(on_slurm):
    s = on_slurm
    job, _ = submit_timed(s, {**slow_job(epochs=5000), "slurm": {"time_limit_min": 1}})
    ended = s.api.wait_state(job["id"], timeout=150)
    assert ended["state"] == "failed" and ended["error"]["class"] == "timeout", ended
    assert "reached its Slurm time limit" in ended["error"]["message"]
    checkpoint = ended["checkpoint_epoch"]
    assert checkpoint and checkpoint >= 1
    s.no_leftovers()
    with s.api.client() as c:
        assert c.post(f"/jobs/{job['id']}/retry").status_code == 200
    s.api.wait_until(lambda: (s.api.job(job["id"])["progress"]["epoch"] or 0) > checkpoint, 120,
                     "the retry to train past its checkpoint")
    assert [m["epoch"] for m in metrics(s.api, job["id"])][0] == 1  # the history kept, no gap
    with s.api.client() as c:
        c.post(f"/jobs/{job['id']}/cancel")
    s.no_leftovers()


def test_a_node_lost_mid_job_fails_the_run_as_infrastructure_and_the_job_resumes_on_a_node_still_there(on_slurm):
    s = on_slurm
    # Long enough to outlast SlurmdTimeout (10 s) and slurmctld's look at the node after the kill.
    job, _ = submit_timed(s, {**slow_job(epochs=EPOCHS_PAST_A_NODE), "slurm": {}})
    wait_checkpoint(s.api, job["id"], 2)
    node = s.slurm_of(job["id"])["nodes"]
    s.cluster.kill_slurmd(node)
    try:
        done = s.api.wait_state(job["id"], timeout=300)
    finally:
        s.cluster.start_slurmd(node)
    assert done["state"] == "succeeded", done
    assert done["runs"] == 2 and done["errors"][0]["class"] == "infrastructure", done["errors"]
    assert "NODE_FAIL" in done["errors"][0]["message"]
    assert done["result"]["resumed_from_epoch"] >= 2
    assert [m["epoch"] for m in metrics(s.api, job["id"])] == list(range(1, EPOCHS_PAST_A_NODE + 1))
    assert not done["worker_id"].startswith(node)
    s.cluster.wait_idle(60)
    s.no_leftovers()


def test_a_node_cut_off_mid_job_loses_the_run_and_the_job_resumes_on_a_node_still_there(on_slurm):
    s = on_slurm
    job, _ = submit_timed(s, {**slow_job(epochs=EPOCHS_PAST_A_NODE), "slurm": {}})
    wait_checkpoint(s.api, job["id"], 2)
    node = s.slurm_of(job["id"])["nodes"]
    s.cluster.host(node).cut()
    try:
        # Its run ends at once as infrastructure (its lease, or Slurm's NODE_FAIL, whichever comes first); the job
        # waits for Slurm to give up the node and resumes in a new allocation on the other.
        s.api.wait_until(lambda: s.api.job(job["id"])["runs"] == 2, 120, "the job to run again")
        assert not s.api.job(job["id"])["worker_id"].startswith(node)
        done = s.api.wait_state(job["id"], timeout=300)
    finally:
        s.cluster.host(node).mend()
    assert done["state"] == "succeeded" and done["errors"][0]["class"] == "infrastructure", done["errors"]
    assert done["result"]["resumed_from_epoch"] >= 2
    assert [m["epoch"] for m in metrics(s.api, job["id"])] == list(range(1, EPOCHS_PAST_A_NODE + 1))
    s.cluster.wait_idle(90)
    s.no_leftovers(90)


def test_a_sweeps_trials_run_each_in_an_allocation_of_its_own(on_slurm):
    s = on_slurm
    sweep = start_sweep(s.api, job={**IRIS, "slurm": {}}, method="grid", metric="val_accuracy", max_concurrent=2,
                        parameters={"train.lr": {"type": "choice", "values": [0.01, 0.05]}})
    done = wait_sweep(s.api, sweep["id"], timeout=240)
    assert done["state"] == "succeeded", done
    with s.api.client() as c:
        trials = c.get("/jobs", params={"sweep": sweep["id"]}).json()["data"]
    assert len(trials) == 2 and all(t["state"] == "succeeded" for t in trials)
    slurm_ids = {s.slurm_of(t["id"])["id"] for t in trials}
    assert len(slurm_ids) == 2 and None not in slurm_ids
    s.no_leftovers()
