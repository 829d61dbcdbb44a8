"""Error bodies in the shape the OpenAI and vLLM servers use: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal goes through APIError, so a client library (the official ``openai`` package raises
``BadRequestError``, ``AuthenticationError``, ``NotFoundError`` … from the status and reads ``message``,
``param`` and ``code`` from the body) sees one shape whatever went wrong. The ``type`` names are vLLM's
(its ErrorResponse); ``code`` is the HTTP status, as vLLM sends it.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """A request refused (or failed) with ``status``; ``message`` is written for the person reading it."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, in one sentence naming the field (``param``) it is about."""
    error = exc.errors(include_url=False)[0]
    kind, loc = error["type"], [str(part) for part in error["loc"]]
    if kind == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {error['ctx'].get('error', error['msg'])}")
    if kind == "model_type" and not loc:
        return bad_request("The request body must be a JSON object")
    field = _field_name(loc)
    if kind == "extra_forbidden":
        # OpenAI's own words for a parameter it does not know.
        return bad_request(f"Unrecognized request argument supplied: {field}", field)
    if kind == "missing":
        return bad_request(f"{field} is required", field)
    return bad_request(f"{field}: {error['msg']} (got {_short(error.get('input'))})", field)


def _field_name(loc: list[str]) -> str:
    """``messages.0.role`` from pydantic's location, without the tags it adds for the members of a union
    (``str``, ``list[int]``, ``TextPart``, ``function-after[...]``); field names are lower snake case."""
    parts = [part for part in loc if not (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part
                                          or part[:1].isupper())]
    return ".".join(parts) or "body"


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"
