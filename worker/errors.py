"""The worker's exceptions: how a job ends other than by finishing (torch-free).

Raised in the job process and turned into the job's error record by worker/runner.py, which reads
their class names: JobError is the job's own failure (never retried), Preempted a requested stop
(requeued), DeviceFailure the host's trouble (retried on another worker), RendezvousFailed the
network's between a job's ranks (retried), RankMessageRefused a rank's message that is not what a rank
sends (retried). EvaluationOutOfMemory,
a torch.OutOfMemoryError, stays with the messages of running out of GPU memory (torch_devices).
"""


class JobError(Exception):
    """The job cannot run as specified (the spec does not fit the data, the loss diverged...): not retried."""


class Preempted(Exception):
    """The worker asked the job to stop; it has checkpointed and should be requeued."""


class DeviceFailure(RuntimeError):
    """The worker's device cannot be used (CUDA gone, the device missing or failed): the host's trouble,
    not the job's. An `infrastructure` failure, retried on another worker; this worker takes no more."""


class RendezvousFailed(RuntimeError):
    """A job's ranks could not meet at rank 0's address (unreachable, or a rank never came): the network's
    trouble, not the job's. An `infrastructure` failure, retried; the message names the address tried."""


class RankMessageRefused(RendezvousFailed):
    """A rank sent rank 0 something that is not JSON of the agreed size (a process other than the job's ranks
    reached the rendezvous, or speaks another version's wire): refused unread, never unpickled. An
    `infrastructure` failure, retried like a rendezvous that failed."""
