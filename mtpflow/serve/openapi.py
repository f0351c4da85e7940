"""The server's OpenAPI schema (``GET /openapi.json``): what each endpoint takes and every answer it can give,
so that a client generator or a fuzzer (the test suite runs schemathesis against it) can hold the server to it.

The completion routes read their bodies themselves (``mtpflow.serve.protocol`` checks every field and names
the wrong one), so their request bodies are declared here as JSON schemas rather than derived from Pydantic
models. Every error status is declared with the OpenAI error object; 429 and 503 with ``Retry-After``. FastAPI's
default 422 is dropped: a malformed request is a 400 here, as in OpenAI's API.
"""
from __future__ import annotations

from typing import Any

from mtpflow.serve.protocol import CHAT_ROLES, MAX_STOP_STRINGS, MAX_TIMEOUT_SECONDS

ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
RETRY_AFTER = {"Retry-After": {"required": True, "description": "seconds to wait before trying again",
                               "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
ERRORS = {
    "400": "a malformed body, a wrong or unsupported field (``param`` names it), a prompt or ``max_tokens`` past "
           "the model's context",
    "401": "the API key is required and missing or wrong",
    "404": "an unknown model id or path",
    "405": "a method the path does not take",
    "408": "the request ran past its deadline (``timeout``, else the server's ``engine.request_timeout``)",
    "413": "a body over 8 MB",
    "429": "refused at once: the waiting queue is full (``queue_full``) or the request waited past "
           "``engine.max_wait_seconds`` (``queue_timeout``)",
    "499": "the client closed the request before it was answered",
    "500": "a strategy's stage failed during the decode",
    "503": "the server is shutting down (draining after SIGTERM)",
}
COMPLETION_ERRORS = ("400", "401", "404", "408", "413", "429", "499", "500", "503")


def _error_response(status: str) -> dict:
    out: dict[str, Any] = {"description": ERRORS[status], "content": {"application/json": {"schema": ERROR}}}
    if status in ("429", "503"):
        out["headers"] = dict(RETRY_AFTER)
    if status == "401":
        out["headers"] = {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}}
    return out


def _nullable(fields: dict) -> dict:
    """Optional fields may be null, as in OpenAI's API: null means absent (the server's default)."""
    return {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in fields.items()}


def _sampling(model_ids: list[str], strategies: list[str]) -> dict:
    """The fields both completion endpoints take."""
    number = {"type": "number"}
    return _nullable({
        "model": {"type": "string", "enum": [*model_ids, ""],
                  "description": "a served model id; empty or absent: the default strategy's"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "temperature": {**number, "minimum": 0, "maximum": 2},
        "top_p": {**number, "exclusiveMinimum": 0, "maximum": 1},
        "stop": {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "maxItems": MAX_STOP_STRINGS,
                            "items": {"type": "string", "minLength": 1}}]},
        "seed": {"type": "integer", "minimum": -(2 ** 63), "maximum": 2 ** 63 - 1},
        "n": {"type": "integer", "enum": [1]},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "timeout": {**number, "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_SECONDS,
                    "description": "mtpflow: seconds until the server ends the request (408)"},
        "user": {"type": "string"},
        "mtpflow": {"type": "object", "additionalProperties": False, "properties": _nullable({
            "strategy": {"type": "string", "enum": strategies},
            "overrides": {"type": "object", "additionalProperties": {
                "type": ["string", "number", "boolean", "null"]}},
            "top_k": {"type": "integer", "minimum": 0},
        })},
    })


def request_bodies(model_ids: list[str], strategies: list[str]) -> dict[str, dict]:
    """The JSON schemas of the chat and completion bodies."""
    common = _sampling(model_ids, strategies)
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": list(CHAT_ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]},
    }}
    chat = {"type": "object", "required": ["messages"],
            "properties": {"messages": {"type": "array", "minItems": 1, "items": message}, **common}}
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    prompt = {"anyOf": [{"type": "string", "pattern": r"\S"}, token_ids,
                        {"type": "array", "minItems": 1, "maxItems": 1,
                         "items": {"anyOf": [{"type": "string", "pattern": r"\S"}, token_ids]}}]}
    completion = {"type": "object", "required": ["prompt"], "properties": {"prompt": prompt, **common}}
    return {"chat": chat, "completion": completion}


COMPLETION_OBJECT = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage", "mtpflow"],
    "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                   "model": {"type": "string"}, "choices": {"type": "array", "minItems": 1, "maxItems": 1},
                   "usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"]},
                   "mtpflow": {"type": "object"}},
}


# one server-sent event: ``data: {chunk}`` (an error event: ``data: {"error": {...}}``), the last ``data: [DONE]``
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def completion_route(body: dict) -> dict:
    """``openapi_extra`` of a completion route: its body, its 200 (JSON or server-sent events), its errors."""
    responses = {"200": {"description": "the completion; with ``stream`` server-sent events",
                         "content": {"application/json": {"schema": COMPLETION_OBJECT},
                                     "text/event-stream": {"schema": SSE_EVENT}}}}
    responses.update({s: _error_response(s) for s in COMPLETION_ERRORS})
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": responses}


def errors(*statuses: str) -> dict:
    """``openapi_extra`` declaring these error statuses with the error object."""
    return {"responses": {s: _error_response(s) for s in statuses}}


def drop_validation_errors(schema: dict) -> dict:
    """FastAPI declares 422 for every route with parameters; this server answers 400 (its handler)."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema


__all__ = ["ERROR", "completion_route", "drop_validation_errors", "errors", "request_bodies"]
