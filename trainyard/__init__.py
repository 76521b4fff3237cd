"""trainyard: run PyTorch training and inference jobs on your own GPU machines, over REST.

It holds the service (trainyard.app) and the workers (trainyard.worker). In a checkout those are the
top-level folders app/ and worker/, reached through the links trainyard/app and trainyard/worker.

    from trainyard import Client, APIError     # the Python client of the REST API
    from trainyard import Job, Sweep, Dataset, Worker, Event, Page   # what it answers (typed records)
    from trainyard import Context              # what a `run` job's entrypoint is given (worker side)
"""
from trainyard.app import __version__
from trainyard.app.client import APIError, Client
from trainyard.app.client.models import Dataset, Event, Job, Page, Sweep, Worker


def __getattr__(name: str):
    # The worker side imports torch: only for the code that asks for it.
    if name == "Context":
        from trainyard.worker.public_context import Context
        return Context
    raise AttributeError(f"module 'trainyard' has no attribute {name!r}")


__all__ = ["APIError", "Client", "Context", "Dataset", "Event", "Job", "Page", "Sweep", "Worker", "__version__"]
