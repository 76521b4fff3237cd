"""The real Slurm cluster the Slurm tests run on (tests/helpers/slurm.py): it starts within seconds, two can run
at once, its jobs run inside the nodes and reach this machine's PostgreSQL only through a forward, scancel, a lost
slurmd and preemption do what Slurm says, and nothing of it remains once it is gone. Time limits (whole minutes,
60-90 s a test) are tested once, through trainyard: tests/fleet/test_slurm.py.

What a lost slurmd does, as seen here: its node goes DOWN about SlurmdTimeout + 3 x MessageTimeout after its
last answer; a `--requeue` batch job on it goes back to PENDING (Restarts=1; the completion log says NODE_FAIL)
and runs again once eligible (CredExpire later), a `--no-requeue` one ends NODE_FAIL; the jobs' processes run on
until the node's slurmd returns, which kills them.
"""
import re
import sys
import time

import pytest

from tests.helpers.slurm import KILL_WAIT_S, MESSAGE_TIMEOUT_S, SlurmCluster, slurm_cluster, unavailable

why_not = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_not is not None, reason=str(why_not))]


@pytest.fixture(scope="module")
def shared():
    with slurm_cluster() as c:
        yield c


@pytest.fixture
def cluster(shared: SlurmCluster):
    """The module's cluster, handed back as it was taken: no job, no process left in a node, every node idle,
    even after a test that failed half-way."""
    yield shared
    shared.run("scancel", "--user=root", check=False)
    for node in shared.nodes:
        if node not in shared.slurmd:
            shared.start_slurmd(node)
    shared.wait(lambda: not shared.leftovers(), KILL_WAIT_S + 10, "no process left in a node")
    shared.wait_idle(30)


def completion(c: SlurmCluster, job_id: int) -> list[str]:
    """The job's states in the job-completion log, in order (a requeued job has one line per run)."""
    if not c.jobcomp_log.exists():
        return []
    return re.findall(rf"^JobId={job_id} .*?JobState=(\S+)", c.jobcomp_log.read_text(), re.M)


def test_a_cluster_starts_in_seconds_two_run_at_once_and_nothing_of_them_remains(tmp_path):
    started = time.monotonic()
    with slurm_cluster() as one:
        took = time.monotonic() - started
        with slurm_cluster(nodes=1) as other:
            assert other.env["SLURM_CONF"] != one.env["SLURM_CONF"]
            assert other.run("sinfo", "-h", "-o", "%N").stdout.split() == other.nodes
            assert other.run("srun", "hostname").stdout.split() == other.nodes
            assert sorted(one.run("srun", "-N2", "hostname").stdout.split()) == one.nodes  # each its own
            up = one.traces() + other.traces()
        for kind in ("namespace", "mount", "process", "file", "link"):
            assert any(t.startswith(kind) for t in up), (kind, up)  # what traces() looks for, while it is there
    assert one.traces() == [] and other.traces() == []
    assert took < 10, took

    # Whatever happened inside: an error, a job still running.
    with pytest.raises(RuntimeError, match="the test broke"), slurm_cluster() as broken:
        job = broken.sbatch("--wrap=sleep 300")
        broken.wait_job(job, {"RUNNING"})
        raise RuntimeError("the test broke")
    assert broken.traces() == []


def test_srun_runs_on_every_node_each_printing_its_own_name(cluster):
    r = cluster.run("srun", "-N2", "-l", "hostname")
    assert sorted(r.stdout.splitlines()) == [f"{i}: {n}" for i, n in enumerate(cluster.nodes)]
    cluster.wait_idle(10)  # completing a moment after srun returns, then free again


PROBE = """
import os, socket, sys
def reach(addr):
    try:
        socket.create_connection(addr, timeout=3).close()
        return "open"
    except OSError as e:
        return type(e).__name__
import psycopg
with psycopg.connect(f"postgresql://postgres@{sys.argv[1]}:5432/test", connect_timeout=5) as c:
    answer = c.execute("select 41 + 1").fetchone()[0]
print(socket.gethostname(), os.getuid(), os.environ["PROBE_TOKEN"], answer, reach(("127.0.0.1", 5432)))
"""


@pytest.mark.postgres
def test_a_batch_job_reaches_postgresql_through_the_forward_and_writes_a_file(cluster, tmp_path):
    gateway = cluster.network.forward(5432).rsplit(":", 1)[0]
    (tmp_path / "probe.py").write_text(PROBE)
    node = cluster.nodes[1]
    job = cluster.sbatch("-w", node, f"--wrap={sys.executable} {tmp_path / 'probe.py'} {gateway}",
                         cwd=tmp_path, env={"PROBE_TOKEN": "from-the-submitter"})
    done = cluster.wait_job(job, {"COMPLETED", "FAILED"})
    out = (tmp_path / f"slurm-{job}.out").read_text()  # in the submitter's working directory
    assert done["JobState"] == "COMPLETED", out
    # Inside the node, as root, with the submitter's environment; PostgreSQL through the bridge, never through
    # the node's own 127.0.0.1.
    assert out.split() == [node, "0", "from-the-submitter", "42", "ConnectionRefusedError"]
    assert done["WorkDir"] == str(tmp_path)
    assert completion(cluster, job) == ["COMPLETED"]


def test_scancel_kills_every_process_of_a_running_job(cluster):
    job = cluster.sbatch("-w", cluster.nodes[0], "--wrap=sleep 301 & sleep 302 & sleep 303; wait")
    cluster.wait_job(job, {"RUNNING"})
    cluster.wait(lambda: sum("sleep 30" in p for p in cluster.leftovers()) == 3, 10, "the job's three sleeps")
    cancelled_at = time.monotonic()
    cluster.run("scancel", str(job))
    assert cluster.wait_job(job, {"CANCELLED"})["JobState"] == "CANCELLED"
    cluster.wait(lambda: cluster.leftovers() == [], KILL_WAIT_S + 5, "every process of the job gone")
    assert time.monotonic() - cancelled_at < KILL_WAIT_S + 5
    assert completion(cluster, job) == ["CANCELLED"]


def test_a_node_whose_slurmd_is_killed_goes_down_and_its_jobs_are_requeued_or_fail_as_they_asked(cluster):
    node = cluster.nodes[1]
    again = cluster.sbatch("-w", node, "--requeue", "--wrap=sleep 300")
    once = cluster.sbatch("-w", node, "--no-requeue", "--wrap=sleep 300")
    cluster.wait_job(again, {"RUNNING"})
    cluster.wait_job(once, {"RUNNING"})
    cluster.wait(lambda: sum(p.startswith(node) and p.endswith("sleep 300") for p in cluster.leftovers()) == 2, 10,
                 "both jobs' sleeps")
    running = [p for p in cluster.leftovers() if p.startswith(node)]
    killed_at = time.monotonic()
    cluster.kill_slurmd(node)
    limit = 10 + 3 * MESSAGE_TIMEOUT_S + 5  # the fixture's SlurmdTimeout, the failed pings, the check's interval
    cluster.wait(lambda: cluster.node_states()[node].startswith("down"), limit, f"{node} DOWN")
    down_in = time.monotonic() - killed_at

    requeued, failed = cluster.job(again), cluster.job(once)
    assert requeued["JobState"] == "PENDING" and requeued["Restarts"] == "1", requeued
    assert failed["JobState"] == "NODE_FAIL" and failed["Restarts"] == "0", failed
    assert completion(cluster, again) == ["NODE_FAIL"] and completion(cluster, once) == ["NODE_FAIL"]
    # The jobs' processes run on while the node has no slurmd: nobody is there to kill them.
    assert set(running) <= set(cluster.leftovers())

    cluster.start_slurmd(node)
    cluster.wait(lambda: not cluster.node_states()[node].startswith("down"), 15, f"{node} back")
    cluster.wait(lambda: not set(running) & set(cluster.leftovers()), 15, "the old run's processes gone")
    rerun = cluster.wait_job(again, {"RUNNING"}, timeout=40)  # eligible CredExpire (10 s) after the requeue
    assert rerun["Restarts"] == "1"
    assert cluster.job(once)["JobState"] == "NODE_FAIL"
    assert down_in <= limit


def test_a_job_of_the_preempting_partition_requeues_a_running_job_of_the_default_one(cluster, tmp_path):
    starts = tmp_path / "starts"
    low = cluster.sbatch("-N2", "--exclusive", f"--wrap=echo started >> {starts}; sleep 300")
    cluster.wait_job(low, {"RUNNING"})
    cluster.wait(lambda: starts.exists(), 10, "the low job's first start")
    high = cluster.sbatch("-p", cluster.preempting_partition, "-N2", "--exclusive", "--wrap=sleep 3")
    assert cluster.wait_job(high, {"RUNNING", "COMPLETED"}, timeout=20)
    preempted = cluster.job(low)
    assert preempted["JobState"] in ("PENDING", "REQUEUED") and preempted["Restarts"] == "1", preempted
    assert completion(cluster, low) == ["PREEMPTED"]
    # Requeued, not cancelled: it runs again from the start once the urgent job is done.
    assert cluster.wait_job(high, {"COMPLETED"}, timeout=20)
    cluster.wait_job(low, {"RUNNING"}, timeout=40)
    cluster.wait(lambda: starts.read_text().count("started") == 2, 10, "the low job's second start")

