"""trainyard: run PyTorch training and inference jobs on your own GPU machines, over REST.

Installed, this package holds the service (trainyard.app) and the workers (trainyard.worker); in a
checkout they are the top-level folders app/ and worker/, which this package then reaches.

    from trainyard import Client, APIError     # the Python client of the REST API
    from trainyard import Context              # what a `run` job's entrypoint is given (worker side)
"""
import os as _os

__version__ = "0.1.0"

# A checkout: app/ and worker/ sit beside this folder, not inside it.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "app")) and _os.path.isfile(_os.path.join(_root, "app", "spec.py")):
    __path__.append(_root)

from trainyard.app.client import APIError, Client  # noqa: E402


def __getattr__(name: str):
    # The worker side imports torch: only for the code that asks for it.
    if name == "Context":
        from trainyard.worker.run_context import Context
        return Context
    raise AttributeError(f"module 'trainyard' has no attribute {name!r}")


__all__ = ["APIError", "Client", "Context", "__version__"]
