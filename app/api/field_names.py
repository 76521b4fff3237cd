"""The nearest valid name for a field a request body may not have (a misspelt `train.epcohs`): the names the model
at that place of the body declares, found by following the error's path through the route's body type, and the
closest of them (difflib). Used by the one handler that formats validation errors (app/api/errors.py)."""
import difflib
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from fastapi import Request
from pydantic import BaseModel, RootModel


def did_you_mean(request: Request, loc: tuple | list) -> str | None:
    """For an extra field at loc (("body", "train", "train", "epcohs"): pydantic's path, a tagged union's tag
    included), the valid name closest to it; None when none is close."""
    route = request.scope.get("route")
    field = getattr(route, "body_field", None)
    if field is None or len(loc) < 2 or loc[0] != "body" or not isinstance(loc[-1], str):
        return None
    path = list(loc[1:-1])
    if getattr(route, "_embed_body_fields", False):  # several body parameters: the path starts with one's name
        return None
    names = _names_at(field.field_info.annotation, path)
    if not names:
        return None
    close = difflib.get_close_matches(loc[-1], names, n=1)
    return close[0] if close else None


def _names_at(tp: Any, path: list) -> list[str]:
    for part in path:
        tp = _step(tp, part)
        if tp is None:
            return []
    model = _unwrap(tp)
    if not (isinstance(model, type) and issubclass(model, BaseModel)) or issubclass(model, RootModel):
        return []
    return [f.alias or name for name, f in model.model_fields.items()]


def _unwrap(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _step(tp: Any, part: str | int) -> Any:
    """The type one step of an error's path leads to from tp, or None where it cannot be followed."""
    tp = _unwrap(tp)
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        members = [m for m in get_args(tp) if m is not type(None)]
        if len(members) == 1:
            return _step(members[0], part)
        # Pydantic names the member it tried: a tagged union's by its tag, another by its class's name.
        return next((m for m in members if _names_member(_unwrap(m), part)), None)
    if isinstance(tp, type) and issubclass(tp, RootModel):
        return _step(tp.model_fields["root"].annotation, part)
    if isinstance(tp, type) and issubclass(tp, BaseModel) and isinstance(part, str):
        f = next((f for name, f in tp.model_fields.items() if part in (name, f.alias)), None)
        return None if f is None else f.annotation
    if origin in (list, set, frozenset) and isinstance(part, int):
        return get_args(tp)[0]
    if origin is tuple and isinstance(part, int):
        args = get_args(tp)
        return args[0] if len(args) == 2 and args[1] is Ellipsis else args[part] if part < len(args) else None
    if origin is dict:
        return get_args(tp)[1]
    return None


def _names_member(member: Any, part: str | int) -> bool:
    if not (isinstance(member, type) and issubclass(member, BaseModel)):
        return False
    return member.__name__ == part or any(
        get_origin(_unwrap(f.annotation)) is Literal and part in get_args(_unwrap(f.annotation))
        for f in member.model_fields.values())

