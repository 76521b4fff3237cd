"""An answer checked against the OpenAPI document the server publishes."""
from openapi_schema_validator import OAS31Validator


def conforms(document: dict, op_id: str, status: int, body) -> None:
    """body validates against what the document declares op_id answers with status."""
    op = next(o for methods in document["paths"].values() for o in methods.values() if o["operationId"] == op_id)
    schema = op["responses"][str(status)]["content"]["application/json"]["schema"]
    OAS31Validator({**schema, "components": document["components"]}).validate(body)
