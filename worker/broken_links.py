"""Which errors of a collective or of the ranks' store mean that another rank's process, or the link to it, went
away: the run's trouble, not the job's (`infrastructure`, retried), on one host as across hosts.

Recognised by what torch and the libraries under it say they are, not by loose words: torch's network and store
errors by type, NCCL's by the ncclResult_t code torch names (the words NCCL and torch 2.14 print, and an H200's
abort of a rank whose peer exited: tests/fixtures/gpu), gloo's by the transport it raises from.
"""
import re

# NCCL's result codes (ncclResult_t, named in the DistBackendError torch raises) that say a peer or the link between
# the ranks failed; any other code it names (ncclInvalidUsage: the job's misuse; ncclUnhandledCudaError: CUDA under
# NCCL, the device's or the job's) is no broken link. NCCL_ABORTED: torch's words for a communicator it aborted.
NCCL_LINK_ERRORS = frozenset({"ncclRemoteError", "ncclSystemError", "ncclInternalError"})
NCCL_ABORTED = "NCCL communicator was aborted"
_NCCL_CODE = re.compile(r"\bnccl[A-Z][A-Za-z]+Error\b|\bnccl(?:InvalidUsage|InvalidArgument)\b")
# gloo raises a plain RuntimeError from its transport (a peer closed or reset the connection, a read timed out),
# prefixed with the source file it came from: gloo/transport/<tcp|uv>/...
GLOO_TRANSPORT = "gloo/transport/"
# What a rank's process prints when NCCL's watchdog aborts it (SIGABRT): a collective that failed or timed out on
# a broken communicator raises nothing in Python, the watchdog thread throws from ProcessGroupNCCL (an H200, its
# peer exited: tests/fixtures/gpu/cuda_failures_h200.json, "nccl_peer_exited").
_WATCHDOG = re.compile(r"ProcessGroupNCCL(?:::Watchdog|::WorkNCCL::checkAndSetException|\.cpp)|"
                       r"Watchdog caught collective operation timeout|\bncclRemoteError\b|\bncclSystemError\b")


def is_broken_link(exc: BaseException) -> bool:
    """The error a collective or the store raises when another rank's process, or its link, went away: torch's
    network and store errors by type (DistNetworkError, DistStoreError), NCCL's by the code they name, gloo's by
    the transport they come from. On one host as across hosts, the job's fault it is not (`infrastructure`)."""
    text = str(exc)
    codes = set(_NCCL_CODE.findall(text))
    if codes & NCCL_LINK_ERRORS:
        return True
    if codes:
        return False
    if _is_dist_error(exc):  # DistBackendError naming no NCCL code: a watchdog timeout, an abort
        return True
    return isinstance(exc, RuntimeError) and (NCCL_ABORTED in text or GLOO_TRANSPORT in text)


def _is_dist_error(exc: BaseException) -> bool:
    """isinstance(exc, torch.distributed.DistError), read from the class's ancestry: this module stays torch-free
    (the supervisor imports it for aborted_by_watchdog; pyproject.toml's supervisor-torch-free contract)."""
    return any(c.__name__ == "DistError" and c.__module__.startswith("torch") for c in type(exc).__mro__)


def aborted_by_watchdog(output: str) -> bool:
    """Whether a job process's output (its last lines, on its death by SIGABRT) is NCCL's watchdog aborting it:
    a broken communicator, which one host's ranks reach this way and not as an exception. Torch-free."""
    return bool(_WATCHDOG.search(output))
