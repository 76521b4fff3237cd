"""Job presets for the tests: tiny ones that train in well under a second, slow ones to crash mid-run."""
from trainyard.app.spec import TRAIN_EXAMPLE

# The README's Iris job (seed 000's MLP and loop settings), as the OpenAPI docs show it.
IRIS_JOB = TRAIN_EXAMPLE


def tiny_job(epochs: int = 2, **train) -> dict:
    """A job that takes well under a second to train."""
    return {"kind": "train", "model": {"arch": "mlp", "hidden": [8]}, "data": {"dataset": "iris"},
            "train": {"epochs": epochs, "batch_size": 32, **train}, "device": "cpu"}


def slow_job(epochs: int = 40, **train) -> dict:
    """A job that trains for several seconds and checkpoints every epoch (for crash tests)."""
    return {"kind": "train", "model": {"arch": "cnn", "channels": [16, 32]}, "data": {"dataset": "digits"},
            "train": {"epochs": epochs, "batch_size": 16, "lr": 0.001, "checkpoint_every_s": 0, **train},
            "device": "cpu"}


def enqueued(engine, body: dict | None = None, key: str | None = None, **over):
    """A job queued straight through the queue's INSERT (no server): tiny_job() unless a body is given, with
    `over` laid over it; the Job record."""
    from trainyard.app.jobs.submit import enqueue
    from trainyard.app.spec import parse_spec

    return enqueue(engine, parse_spec({**(body or tiny_job()), **over}), key)[0]
