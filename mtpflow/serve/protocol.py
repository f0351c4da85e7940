"""The OpenAI wire format: request bodies checked and turned into engine ``Request`` settings, and response
objects, stream chunks and error objects built from results.

Every check names the offending field (``param``) in one line, so a client's mistake is a 400 with an
OpenAI-style error object, never a traceback. Fields the engine cannot honour (``n`` > 1, logprobs, tools,
penalties) are refused rather than silently ignored; fields that change nothing (``user``, ``metadata``) are
accepted.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 16
MAX_TIMEOUT_SECONDS = 86400.0  # a request's own deadline (``timeout``) is at most a day
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MTPFLOW_FIELDS = {"strategy", "overrides", "top_k"}
# fields accepted only at their neutral value: (name, is_neutral)
UNSUPPORTED = (
    ("frequency_penalty", lambda v: v in (None, 0, 0.0)),
    ("presence_penalty", lambda v: v in (None, 0, 0.0)),
    ("logit_bias", lambda v: not v),
    ("logprobs", lambda v: v in (None, False, 0)),
    ("top_logprobs", lambda v: v in (None, 0)),
    ("tools", lambda v: not v),
    ("functions", lambda v: not v),
    ("tool_choice", lambda v: v in (None, "none", "auto")),
    ("function_call", lambda v: v in (None, "none", "auto")),
    ("echo", lambda v: v in (None, False)),
    ("best_of", lambda v: v in (None, 1)),
    ("suffix", lambda v: not v),
    ("audio", lambda v: not v),
    ("modalities", lambda v: v in (None, ["text"])),
)


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class Parsed:
    """A checked request: which endpoint, the model id asked for, streaming, and the engine Request fields."""

    kind: str  # "chat" or "completion"
    model: str
    strategy: str | None  # None: the server's default strategy
    stream: bool
    include_usage: bool
    request: dict[str, Any] = field(default_factory=dict)  # keyword arguments of mtpflow.engine.Request


# ----- field checks ---------------------------------------------------------------------------------------------
def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"{name} must be a number, got {v!r}")
    if v < low or v > high or (low_open and v == low):
        span = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise bad(name, f"{name} must be in {span}, got {v!r}")
    return float(v)


def _whole(body: dict, name: str, low: int | None = None, param: str | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if not (isinstance(v, float) and v.is_integer()):
            raise bad(param or name, f"{param or name} must be a whole number, got {v!r}")
    if low is not None and v < low:
        raise bad(param or name, f"{param or name} must be >= {low}, got {v!r}")
    return int(v)


def _stop(body: dict) -> tuple[str, ...] | None:
    v = body.get("stop")
    if v is None:
        return None
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad("stop", "stop must be a non-empty string or a list of them")
    if len(items) > MAX_STOP_STRINGS:
        raise bad("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    return tuple(items)


def _text_content(content: Any, param: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{param}[{i}]", "only text content parts ({\"type\": \"text\", \"text\": ...}) are "
                                           "supported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(param, "content must be a string or a list of text parts")


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                                              f"{role!r} (tool messages are not supported)")
        if m.get("tool_calls") or m.get("function_call"):
            raise bad(f"messages[{i}]", "tool calls are not supported")
        out.append({"role": CHAT_ROLES[role], "content": _text_content(m.get("content"), f"messages[{i}].content")})
    if not any(m["content"].strip() for m in out):
        raise bad("messages", "every message is empty")
    return out


def _prompt(body: dict) -> dict[str, Any]:
    """``prompt``: a string, a list holding one string, token ids, or a list holding one list of token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p.strip():
            raise bad("prompt", "prompt is empty")
        return {"prompt": p}
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return {"prompt_ids": list(p)}
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("prompt", "one prompt per request (send several requests: they are batched together)")
    raise bad("prompt", "prompt must be a non-empty string, a list of token ids, or a list holding one of them")


def _mtpflow(body: dict) -> dict[str, Any]:
    m = body.get("mtpflow")
    if m is None:
        return {}
    if not isinstance(m, dict):
        raise bad("mtpflow", "mtpflow must be an object: {\"strategy\": ..., \"overrides\": {...}, \"top_k\": ...}")
    unknown = set(m) - MTPFLOW_FIELDS
    if unknown:
        raise bad(f"mtpflow.{sorted(unknown)[0]}", f"unknown mtpflow field(s) {', '.join(sorted(unknown))}; known: "
                                                   f"{', '.join(sorted(MTPFLOW_FIELDS))}")
    out: dict[str, Any] = {}
    if m.get("strategy") is not None:
        if not isinstance(m["strategy"], str) or not m["strategy"]:
            raise bad("mtpflow.strategy", "mtpflow.strategy must be a strategy name")
        out["strategy"] = m["strategy"]
    overrides = m.get("overrides")
    if overrides is not None:
        if not isinstance(overrides, dict) or not all(isinstance(k, str) and k for k in overrides):
            raise bad("mtpflow.overrides", "mtpflow.overrides must be an object of strategy settings, e.g. "
                                           "{\"propose.max_ngram\": 5} or {\"k\": 4}")
        for k, v in overrides.items():
            if not (v is None or isinstance(v, (str, int, float, bool))):
                raise bad(f"mtpflow.overrides.{k}", f"mtpflow.overrides.{k} must be a number, string, boolean or "
                                                    "null")
        out["overrides"] = dict(overrides)
    top_k = _whole(m, "top_k", 0, param="mtpflow.top_k")
    if top_k is not None:
        out["top_k"] = top_k
    return out


def parse(kind: str, body: Any) -> Parsed:
    """Check a /v1/chat/completions (``kind="chat"``) or /v1/completions body."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", "user must be a string")
    for name, neutral in UNSUPPORTED:
        if name in body and not neutral(body[name]):
            raise bad(name, f"{name} is not supported by this server", code="unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("response_format", "only response_format {\"type\": \"text\"} is supported",
                  code="unsupported_parameter")
    n = _whole(body, "n", 1)
    if n not in (None, 1):
        raise bad("n", "n must be 1 (send several requests: they are batched together)")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict)
                                or not isinstance(options.get("include_usage", False), bool)):
        raise bad("stream_options", "stream_options must be {\"include_usage\": true|false}")
    seed = _whole(body, "seed")
    if seed is not None and not -(2 ** 63) <= seed < 2 ** 63:
        raise bad("seed", "seed must fit in 64 bits")
    # both are checked, though max_completion_tokens wins: a wrong value is an error wherever it is
    max_tokens = _whole(body, "max_completion_tokens", 1)
    legacy_max_tokens = _whole(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = legacy_max_tokens
    # absent fields stay None: the engine's defaults (the server's config), as for the CLI
    request: dict[str, Any] = {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, low_open=True),
        "max_new_tokens": max_tokens,
        "stop": _stop(body),
        "seed": seed,
        # mtpflow's own: seconds until the server ends the request (408); absent: the server's engine.request_timeout
        "timeout": _number(body, "timeout", 0.0, MAX_TIMEOUT_SECONDS, low_open=True),
        # a max_tokens given that does not fit the context after the prompt is a 400, as OpenAI answers it
        "refuse_past_context": True,
    }
    if kind == "chat":
        request.update(messages=_messages(body), chat=True)
    else:
        request.update(_prompt(body), chat=False)
    extra = _mtpflow(body)
    strategy = extra.pop("strategy", None)
    request["overrides"] = extra.pop("overrides", {})
    request.update(extra)  # top_k
    return Parsed(kind=kind, model=model or "", strategy=strategy, stream=bool(stream),
                  include_usage=bool(options and options.get("include_usage")), request=request)


# ----- responses --------------------------------------------------------------------------------------------
def finish_reason(stop_reason: str | None) -> str:
    return "length" if stop_reason in ("max_new_tokens", "context_full") else "stop"


def mtpflow_field(strategy: str, stats: dict) -> dict:
    """The run's figures: MAL, accepted draft tokens, the trace run id (null with trace=off) and why it stopped;
    ``runs`` names what decoded (``mtp -> suffix_cache`` for a strategy chosen by measurement, else the strategy)."""
    return {"strategy": strategy, "runs": stats.get("strategy") or strategy, "mal": stats.get("mal"), "accepted_tokens": stats.get("accepted_tokens"),
            "verify_forwards": stats.get("verify_forwards"), "stop_reason": stats.get("stop_reason"),
            "trace_run_id": stats.get("trace_run_id")}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens whose KV came from the engine's prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ResponseBuilder:
    """Builds the response object or the stream chunks of one request (one id and creation time)."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, reason: str, use: dict, extra: dict) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                      "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            obj = "text_completion"
        return {**self._base(obj), "choices": [choice], "usage": use, "mtpflow": extra}

    def chunk(self, text: str | None = None, reason: str | None = None, *, first: bool = False,
              with_usage: bool = False) -> dict:
        if self.kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            out = {**self._base("chat.completion.chunk"), "choices": [choice]}
        else:
            out = {**self._base("text_completion"),
                   "choices": [{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}]}
        if with_usage:
            out["usage"] = None  # OpenAI sends null on every chunk but the last when include_usage is on
        return out

    def usage_chunk(self, use: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._base(obj), "choices": [], "usage": use}


__all__ = ["ApiError", "Parsed", "ResponseBuilder", "parse", "error_body", "finish_reason", "mtpflow_field",
           "usage"]
