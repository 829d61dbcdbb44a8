"""Error bodies in the shape the OpenAI and vLLM servers use: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal goes through APIError, so a client library (the official ``openai`` package raises
``BadRequestError``, ``AuthenticationError``, ``NotFoundError`` … from the status and reads ``message``,
``param`` and ``code`` from the body) sees one shape whatever went wrong. The ``type`` names are vLLM's
(its ErrorResponse); ``code`` is the HTTP status, as vLLM sends it.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(BaseModel):
    error: ErrorDetail

    @classmethod
    def of(cls, status: int, message: str, param: str | None = None) -> ErrorBody:
        kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
        return cls(error=ErrorDetail(message=message, type=kind, param=param, code=status))


class APIError(Exception):
    """A request refused (or failed) with ``status``; ``message`` is written for the person reading it."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> ErrorBody:
        return ErrorBody.of(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, in one sentence naming the field (``param``) it is about."""
    error = exc.errors(include_url=False)[0]
    kind, loc = error["type"], [str(part) for part in error["loc"]]
    if kind == "json_invalid":
        reason = _clip(str(error["ctx"].get("error", error["msg"])), 200)
        return bad_request(f"The request body is not valid JSON: {reason}")
    if kind == "model_type" and not loc:
        return bad_request("The request body must be a JSON object")
    field = _field_name(loc)
    if kind == "extra_forbidden":
        # OpenAI's own words for a parameter it does not know.
        return bad_request(f"Unrecognized request argument supplied: {field}", field)
    if kind == "missing":
        return bad_request(f"{field} is required", field)
    return bad_request(f"{field}: {_clip(error['msg'], 200)} (got {_short(error.get('input'))})", field)


def _field_name(loc: list[str]) -> str:
    """``messages.0.role`` from pydantic's location, without the tags it adds for the members of a union
    (``str``, ``list[int]``, ``TextPart``, ``function-after[...]``); field names are lower snake case."""
    parts = [part for part in loc if not (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part
                                          or part[:1].isupper())]
    return ".".join(parts) or "body"


def lone_surrogate() -> APIError:
    """JSON may write a UTF-16 surrogate on its own (\\ud800); it is no character, so no text can hold it."""
    return bad_request("The request body is not valid JSON text: it has a \\u escape of a lone UTF-16 surrogate "
                       "(\\ud800-\\udfff without its pair), which is no Unicode character; send the text as UTF-8 "
                       "or as a surrogate pair")


def _short(value, limit: int = 60) -> str:
    return _clip(repr(value), limit)


def _clip(text: str, limit: int) -> str:
    """At most ``limit`` characters of a message that may quote the client's input (a 4,000-digit number)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"
