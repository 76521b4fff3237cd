"""Job and sweep states and failure classes, defined once (str enums: the JSON and the database hold the same
strings)."""
from enum import StrEnum
from typing import NotRequired, TypedDict


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # A sweep's trial stopped early by its pruner for doing worse than the others (app/sweeps/trial_outcomes.py):
    # not a failure (max_failed_trials does not count it), and retried only by hand, to run it to its end.
    PRUNED = "pruned"


TERMINAL = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PRUNED)


class SweepState(StrEnum):
    """A sweep runs until its trials are done (succeeded: one completed with its metric; failed), or it is
    cancelled; app/sweeps/sweep_store.py alone changes it."""
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


SWEEP_STATES = tuple(s.value for s in SweepState)

# A worker's state beside idle, busy, stopping and stopped: alive (it heartbeats) but unable to use its
# device (no CUDA, a driver too old, a device that failed under a job); it claims nothing.
WORKER_UNAVAILABLE = "unavailable"


class Failure(StrEnum):
    """Why a run failed; the class decides whether the job is tried again."""
    JOB = "job"                        # the job's own error (a spec that does not fit the data, a NaN loss)
    INFRASTRUCTURE = "infrastructure"  # its worker was lost (lease expired), its object store or its device
    #                                    failed: tried again
    OOM = "oom"                        # out of memory (CUDA, or the job's host-memory budget)
    CRASHED = "crashed"                # the job process died by a signal or exited without a word
    TIMEOUT = "timeout"                # past the job's timeout_s
    CANCELLED = "cancelled"            # by request
    PRUNED = "pruned"                  # a sweep's trial stopped early for doing worse than the others
    DEPENDENCY = "dependency"          # a job it waits for (after, model_job, init_from) failed, was cancelled,
    #                                    pruned or deleted: it would never start (app/fleet/dependencies.py)


# Only a lost worker is retried automatically: the job's own error, an out-of-memory or a crash
# would fail the same way again.
RETRYABLE = frozenset({Failure.INFRASTRUCTURE})


# The error type of a run whose device failed under it (an `infrastructure` failure): the worker whose
# own device it was stops claiming jobs.
DEVICE_FAILURE = "DeviceFailure"


# A failed run's error, as the job row (error, and each of errors with its attempt), the API, the logs and the job
# process's pipe carry it: JSON, so its keys are these strings ("class" a Failure's value). The functional form
# because "class" is a keyword.
ErrorRecord = TypedDict("ErrorRecord", {
    "class": str,
    "type": str,
    "message": str,
    "traceback": NotRequired[str],
    "rank": NotRequired[int],     # the rank whose failure it was (a job on several devices: worker/distributed.py)
    "attempt": NotRequired[int],  # in the job's history (errors): the attempt it ended
})


def error_record(cls: Failure, type_: str, message: str, traceback: str | None = None) -> ErrorRecord:
    """A failed run's error, as the job row, the API and the logs carry it."""
    record: ErrorRecord = {"class": cls.value, "type": type_, "message": message}
    if traceback:
        record["traceback"] = traceback
    return record
