"""A job run without a worker: in this process (runner.execute), in a job process of its own as a supervisor
starts one (JobProcess), or a training loop called directly (make_ctx)."""
import copy
import multiprocessing as mp
import re
from pathlib import Path

import safetensors.torch
import torch

from tests.helpers.jobs import tiny_job
from trainyard.app.core.states import JobState
from trainyard.app.records import Job
from trainyard.app.spec import TRAIN_EXAMPLE, parse_spec
from trainyard.worker import runner
from trainyard.worker.job_context import JobContext
from trainyard.worker.supervisor.plan import JobPlan

TERMINAL = ("done", "error", "preempted")  # a job process's final events: exactly one of them ends each run


def job_record(spec: dict, job_id: int = 1) -> Job:
    """The claimed job a worker would hand its job process, for spec."""
    blank = {name: None for name in Job.__dataclass_fields__}
    return Job(**{**blank, "id": job_id, "kind": spec["kind"], "state": JobState.RUNNING, "spec": spec,
                  "attempt": 1, "claim": 1, "errors": []})


def run_in_process(tmp_path, spec=None, **plan):
    """spec (tiny_job by default) run by runner.execute in this process: its one final event and all its events."""
    events = []
    (tmp_path / "art").mkdir(exist_ok=True)
    (tmp_path / "ck").mkdir(exist_ok=True)
    runner.execute(JobPlan(job=job_record(spec or tiny_job()), device="cpu", data_dir=tmp_path,
                           run_dir=tmp_path / "art", checkpoint_stem=tmp_path / "ck" / "run-1.pt", **plan),
                   events.append)
    final = [e for e in events if e["type"] in TERMINAL]
    assert len(final) == 1, events
    return final[0], events


def plan_for(tmp_path, spec, ranks=(), name="run", resume_from=None, master="", local=()) -> JobPlan:
    run_dir, ck = tmp_path / name / "art", tmp_path / name / "ck"
    run_dir.mkdir(parents=True, exist_ok=True)
    ck.mkdir(parents=True, exist_ok=True)
    return JobPlan(job=job_record(spec), device="cpu", data_dir=tmp_path, run_dir=run_dir,
                   checkpoint_stem=ck / "run-1.pt", resume_from=resume_from, threads=1, ranks=tuple(ranks),
                   master=master, local_ranks=tuple(local))


class JobProcess:
    """The job process as a supervisor sees it: a process of its own and a pipe of events."""

    def __init__(self, plan: JobPlan):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=runner.run, args=(plan, child))
        self.proc.start()
        child.close()
        self.events: list[dict] = []

    def next_event(self, timeout: float = 120) -> dict:
        assert self.conn.poll(timeout), f"no event in {timeout}s: {self.events}"
        self.events.append(self.conn.recv())
        return self.events[-1]

    def until(self, kinds, timeout: float = 120) -> dict:
        while True:
            event = self.next_event(timeout)
            if event["type"] in kinds:
                return event
            assert event["type"] not in TERMINAL, event

    def finish(self, timeout: float = 120) -> dict:
        final = self.until(TERMINAL, timeout)
        self.proc.join(30)
        return final

    def rank_pids(self) -> list[int]:
        return [int(m) for e in self.events if e["type"] == "log" for m in re.findall(r"rank \d+ pid (\d+)", e["line"])]


def make_ctx(root: Path, events: list, name: str = "run", resume_path=None, stop_after_steps=None) -> JobContext:
    """A JobContext for calling worker/train.py directly: events into `events`, a stop asked for after
    stop_after_steps checks."""
    calls = [0]

    def stop_requested():
        calls[0] += 1
        return stop_after_steps is not None and calls[0] > stop_after_steps

    run = root / name
    return JobContext(job_id=1, device=torch.device("cpu"), data_dir=root / "data", artifact_dir=run / "artifact",
                      checkpoint_path=run / "checkpoint.pt", resume_path=resume_path, emit=events.append,
                      stop_requested=stop_requested)


def train_spec(model=None, data_=None, **train_params):
    """The README's Iris job, parsed, with model, data and train parameters replaced where given."""
    raw = copy.deepcopy(TRAIN_EXAMPLE)
    if model is not None:
        raw["model"] = model
    if data_ is not None:
        raw["data"] = data_
    raw["train"].update(train_params)
    return parse_spec(raw)


def of_type(events, kind):
    return [e for e in events if e["type"] == kind]


def weights(artifact_dir: Path) -> dict:
    return safetensors.torch.load_file(artifact_dir / "model.safetensors")
