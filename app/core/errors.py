"""The errors trainyard raises for clients, one family: each class carries its HTTP status.

The API maps them to responses in one handler (app/api/errors.py); the worker and the CLI catch
them by class. A class's docstring is its default message.
"""
from typing import Any


class TrainyardError(Exception):
    """Something went wrong."""
    status = 500

    def __init_subclass__(cls, status: int = 500, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.status = status

    def __init__(self, message: str | None = None, loc: tuple | None = None):
        super().__init__(message or self.__doc__)
        # The request field at fault, e.g. ("model_job",) or ("file",); None when it is no one field.
        self.loc = loc

    def detail(self) -> str | list[dict[str, Any]]:
        """The response's `detail`: a sentence, or for a field FastAPI's validation-error shape."""
        if self.loc is None:
            return str(self)
        return [{"loc": ["body", *self.loc], "msg": str(self), "type": "value_error"}]


class NotFound(TrainyardError, status=404):
    """No such thing."""


class Conflict(TrainyardError, status=409):
    """It is not in a state that allows this."""


class Gone(TrainyardError, status=410):
    """It existed but its files are gone from the data directory."""


class Invalid(TrainyardError, status=422):
    """The request is well-formed but asks for something that cannot be used."""


class TooLarge(TrainyardError, status=413):
    """The request, or what it unpacks to, is over a limit."""


class StorageFull(TrainyardError, status=507):
    """The server's storage is full; nothing was stored: free space, then retry."""


class Unavailable(TrainyardError, status=503):
    """The database or the object store is unavailable; retry shortly."""
