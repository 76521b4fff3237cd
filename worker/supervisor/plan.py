"""What a job process must do, decided by its supervisor: a frozen, picklable plan (torch-free).

The supervisor knows the database, the layout and the host; the job process knows only its plan,
so it can be run and tested in-process without either.
"""
from dataclasses import dataclass
from pathlib import Path

from trainyard.app.records import Job


@dataclass(frozen=True)
class JobPlan:
    job: Job
    device: str                      # the worker's device: "cpu" or "cuda:N"
    data_dir: Path
    run_dir: Path                    # this run's artifact (train) or result (predict)
    checkpoint_stem: Path            # this run's checkpoints are files beside it
    resume_from: Path | None = None  # the checkpoint the database points at
    threads: int | None = None       # torch threads: the host's cores shared among its workers (prepare.job_threads)
    memory_budget: int | None = None  # host bytes the job process may add (enforced on CPU jobs)
    gpu_memory_fraction: float | None = None
    model_dir: Path | None = None    # predict: the model job's artifact; train: init_from's
    model_spec: dict | None = None   # predict: the train job's spec (None for a run job's model)
    scratch_dir: Path | None = None  # run jobs: ctx.data_dir, a directory of this run's own (removed at its end)
    ranks: tuple[str, ...] = ()      # a multi-device job's devices, rank 0 (this worker's) first; () for one device
    rank_uuids: tuple[str | None, ...] = ()  # each rank's GPU UUID (its worker's slot key): ranks pin themselves by it
    master: str = ""                 # "addr:port": the ranks meet at rank 0's TCPStore there; "": a file store
    local_ranks: tuple[int, ...] = ()  # the ranks this host runs, the first in this process; (): all of them
    node_addr: str = ""              # this host's address for the ranks of a job across hosts (its interface's)
    storage_url: str = ""            # where the run's files are published (app/core/storage.py); "" = the data dir
    fetch: tuple[str, ...] = ()      # stored keys to bring to this host's data dir first (they may be missing)
