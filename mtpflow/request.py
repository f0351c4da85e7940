"""A request is data, not config: the prompt, the strategy (a name plus parameter overrides), sampling,
length and stop settings of one generation. ``resolve_request`` checks it against an engine's defaults and
turns it into a ``Prepared`` request (token ids, the strategy's config node, a ``RunContext``) without
composing Hydra again: each strategy is composed once per engine, overrides are applied to a copy.

Every mistake a caller can make raises one ``UserError`` line, before anything runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mtpflow.errors import ConfigError, UserError, check_int, check_k, check_range, check_seconds
from mtpflow.types import RunContext, SamplingParams, hidden_taps, strategy_label


@dataclass
class Request:
    """One generation. Give exactly one of ``prompt`` (text, through the chat template when ``chat``),
    ``messages`` (chat messages ``[{"role": ..., "content": ...}]``) or ``prompt_ids`` (token ids).
    ``None`` settings take the engine's defaults (its config)."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_ids: list[int] | torch.Tensor | None = None
    strategy: str | None = None  # None: the engine's default strategy
    overrides: dict[str, Any] = field(default_factory=dict)  # strategy parameters: {"propose.max_ngram": 5, "k": 4}
    temperature: float | None = None  # None: the strategy's own (0 = greedy)
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    seed: int | None = None
    chat: bool | None = None
    system_prompt: str | None = None
    timeout: float | None = None  # seconds from submit until the engine ends it (DeadlineExceeded); None: the
    # engine's engine.request_timeout
    # True: a max_new_tokens that does not fit the model's context after the prompt is refused
    # (ContextLengthExceeded, as OpenAI's API does) instead of decoding until the context is full; a strategy with a
    # KV window (``window`` stage) runs past the context and is exempt
    refuse_past_context: bool = False


# A temperature under this is greedy (vLLM's rule): logits divided by 5e-324 overflow to inf and the softmax is
# NaN, while the distribution it stands for is the argmax anyway (found by fuzzing the server)
GREEDY_BELOW = 1e-5


class ContextLengthExceeded(UserError):
    """The prompt plus ``max_new_tokens`` do not fit the model's context (``Request.refuse_past_context``)."""


@dataclass
class Prepared:
    """A checked request, ready for the engine."""

    request: Request
    prompt_ids: torch.Tensor  # [prompt_len]
    strategy: DictConfig  # the strategy's config node with the request's overrides
    context: RunContext
    stop: tuple[str, ...]
    need_hidden: tuple[int, ...]  # hidden-state taps its forwards return (mtpflow.types.hidden_taps)
    context_window: int | None
    timeout: float | None = None  # the request's own deadline in seconds (None: the engine's default)


# Override keys a request may never set: code to run (``_target_``) and plugins to load.
FORBIDDEN_OVERRIDE_PARTS = ("_target_", "plugins")


def apply_overrides(strategy: DictConfig, overrides: dict[str, Any]) -> DictConfig:
    """A copy of ``strategy`` with ``overrides`` ({dotted key relative to the strategy: value}) applied.
    ``k`` is the shortcut for ``select_k.k``. Unknown keys are a UserError, never silently added."""
    if not isinstance(overrides, dict):
        raise UserError(f"overrides must be a mapping of strategy parameters, got {type(overrides).__name__}")
    out = strategy.copy()
    for key, value in overrides.items():
        key = str(key)
        if key.startswith("strategy."):
            key = key[len("strategy."):]
        if key == "k":
            selector = out.get("select_k")
            if selector is None or "k" not in selector:
                raise UserError(f"k does not apply to strategy {out.get('name')!r}: its K selector has no k parameter")
            value = check_k("k", value)
            key = "select_k.k"
        if any(part in FORBIDDEN_OVERRIDE_PARTS for part in key.split(".")):
            raise UserError(f"override {key!r} is not allowed in a request")
        if OmegaConf.select(out, key, default="__missing__") == "__missing__":
            raise UserError(f"unknown parameter {key!r} for strategy {out.get('name')!r}")
        try:
            OmegaConf.update(out, key, value, merge=False)
        except (OmegaConfBaseException, ValueError) as exc:
            raise UserError(f"bad value for {key}: {str(exc).splitlines()[0]}") from None
    return out


def _stop_tuple(stop) -> tuple[str, ...]:
    items = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if any(not isinstance(s, str) or s == "" for s in items):
        raise ConfigError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(items)


def hidden_taps_of(model, spec) -> tuple[int, ...]:
    """A strategy's ``needs_hidden_states`` as the taps its forwards return; a bad value is a ConfigError."""
    if OmegaConf.is_config(spec):
        spec = OmegaConf.to_container(spec)
    try:
        return hidden_taps(model, spec)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def encode_prompt(tokenizer, prompt: str, chat: bool = True, system_prompt: str | None = None) -> list[int]:
    """Token ids of a prompt, through the tokenizer's chat template unless ``chat`` is false."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt, add_special_tokens=True)["input_ids"]]


def check_messages(messages) -> list[dict[str, str]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError("messages must be a non-empty list of {role, content} objects")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UserError("every message needs a string role and a string content")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in out):
        raise UserError("empty prompt: every message is empty")
    return out


def check_ids(prompt_ids, vocab: int) -> torch.Tensor:
    """``prompt_ids`` as a flat long tensor: a non-empty list (or a [1, n] tensor, as tokenizers return) of
    token ids inside the model's vocabulary; anything else is a UserError naming the problem."""
    try:
        ids = torch.as_tensor(prompt_ids)
    except (TypeError, ValueError, RuntimeError):
        raise UserError("prompt_ids must be a list of token ids") from None
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise UserError(f"prompt_ids must be a non-empty flat list of token ids (whole numbers), got shape "
                        f"{tuple(ids.shape)} of {ids.dtype}")
    outside = ids[(ids < 0) | (ids >= vocab)]
    if outside.numel():
        raise UserError(f"prompt_ids must be token ids in [0, {vocab}), got {int(outside[0])}")
    return ids.long()


def resolve_request(request: Request, cfg: DictConfig, strategy: DictConfig, loaded) -> tuple[Prepared, dict]:
    """Check ``request`` against the engine config ``cfg`` and its strategy node; returns the prepared
    request and the resolved top-level settings (for the run's recorded config)."""
    if not isinstance(request, Request):
        raise UserError(f"expected a Request, got {type(request).__name__}")
    pick = lambda value, default: default if value is None else value  # noqa: E731
    temperature = request.temperature
    if temperature is None:
        temperature = cfg.get("temperature")
    if temperature is None:
        temperature = strategy.get("temperature", 0.0) or 0.0
    temperature = float(check_range("temperature", temperature, 0, None))
    if not math.isfinite(temperature):
        raise ConfigError(f"temperature must be a finite number, got {temperature}")
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_p = float(check_range("top_p", pick(request.top_p, cfg.top_p), 0, 1, low_inclusive=False))
    top_k = check_int("top_k", pick(request.top_k, cfg.top_k), 0)
    max_new_tokens = check_int("max_new_tokens", pick(request.max_new_tokens, cfg.max_new_tokens), 1)
    seed = check_int("seed", pick(request.seed, cfg.seed))
    chat = pick(request.chat, cfg.get("chat", True))
    if not isinstance(chat, bool):
        raise ConfigError(f"chat must be true or false, got {chat!r}")
    stop_value = request.stop if request.stop is not None else cfg.get("stop")
    if stop_value is not None and not isinstance(stop_value, (str, list, tuple)):
        stop_value = OmegaConf.to_container(stop_value) if OmegaConf.is_config(stop_value) else stop_value
    stop = _stop_tuple(stop_value)

    given = [x is not None for x in (request.prompt, request.messages, request.prompt_ids)]
    if sum(given) != 1:
        raise UserError("give exactly one of prompt, messages or prompt_ids" if any(given) else
                        "empty prompt: give a prompt, messages or prompt_ids")
    tokenizer = loaded.tokenizer
    system_prompt = pick(request.system_prompt, cfg.get("system_prompt"))
    if request.prompt is not None:
        prompt = str(request.prompt)
        if not prompt.strip():
            raise UserError("empty prompt")
        ids = torch.tensor(encode_prompt(tokenizer, prompt, chat, system_prompt), dtype=torch.long)
    elif request.messages is not None:
        messages = check_messages(request.messages)
        if system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": str(system_prompt)}, *messages]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # a template that rejects the roles or order given
            raise UserError(f"the model's chat template rejected the messages: {str(exc).splitlines()[0]}") from None
        if hasattr(ids, "keys") and "input_ids" in ids:  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    else:
        ids = check_ids(request.prompt_ids, loaded.model.get_input_embeddings().num_embeddings)
        prompt = tokenizer.decode(ids.tolist())
    if ids.numel() + 1 > loaded.max_context:
        raise UserError(f"the prompt is {ids.numel()} tokens; the model's context is {loaded.max_context}")
    if (request.refuse_past_context and request.max_new_tokens is not None and strategy.get("window") is None
            and ids.numel() + max_new_tokens > loaded.max_context):
        raise ContextLengthExceeded(
            f"the model's context is {loaded.max_context} tokens and the prompt takes {ids.numel()}: at most "
            f"{loaded.max_context - ids.numel()} new tokens fit, {max_new_tokens} were asked for")
    timeout = None if request.timeout is None else check_seconds("timeout", request.timeout)

    settings = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_new_tokens": max_new_tokens,
                "seed": seed, "chat": chat, "stop": list(stop), "system_prompt": system_prompt}
    context = RunContext(
        prompt=prompt, prompt_tokens=ids,
        strategy=strategy_label(strategy) if strategy.get("name") else str(request.strategy or "?"),
        model_id=loaded.model_id, device=str(loaded.device), max_new_tokens=max_new_tokens,
        sampling=SamplingParams(temperature, top_k, top_p), seed=seed, tokenizer=tokenizer, model=loaded.model,
    )
    prepared = Prepared(request=request, prompt_ids=ids, strategy=strategy, context=context, stop=stop,
                        need_hidden=hidden_taps_of(loaded.model, strategy.get("needs_hidden_states", False)),
                        context_window=strategy.get("context_window"), timeout=timeout)
    return prepared, settings
