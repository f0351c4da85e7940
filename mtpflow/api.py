"""The Python API: load the model once, decode many prompts.

    import mtpflow
    pipe = mtpflow.pipeline("pld", overrides=["max_new_tokens=64"])
    result = pipe("Summarize: ...")          # DecodeResult(text, token_ids, stats, steps)
    for piece in pipe.stream("Hello"): ...   # text as tokens are accepted
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from mtpflow.config import compose, effective_temperature, read_prompt, stop_strings, validate
from mtpflow.engine import Engine
from mtpflow.errors import UserError
from mtpflow.model import load_configured
from mtpflow.plugins.manager import build_stages, default_run_plugins
from mtpflow.request import Request, encode_prompt
from mtpflow.types import DecodeResult, StepRecord, strategy_label

# Factories called once per run to add run-level plugins (trace recorder, metrics); see ``add_run_plugin``.
RunPluginFactory = Callable[["Pipeline"], object]


class Pipeline:
    """A composed strategy config on an engine: each call is one request with fresh stage objects.

    The pipeline owns an ``Engine`` unless it is handed one (``engine=``), so pipelines of several strategies
    can share one model and decode in one batch (the playground, the benchmark)."""

    def __init__(self, cfg: DictConfig, run_plugins: tuple[RunPluginFactory, ...] = (), loaded=None,
                 engine: Engine | None = None):
        validate(cfg)
        build_stages(cfg.strategy)  # validate every stage's parameters before the (slow) model load
        if engine is None:
            m = cfg.model
            # ``loaded`` lets tests and the playground hand in a model that is already in memory
            loaded = loaded or load_configured(m)
            engine = Engine(cfg, loaded=loaded)
        # a strategy chosen by measurement (mtp) runs the candidate the engine's tuning profile names
        strategy = engine.resolve_strategy(cfg.strategy)
        if strategy is not cfg.strategy or cfg.get("k") is not None:
            cfg = cfg.copy()
            cfg.strategy = strategy
        if cfg.get("k") is not None:
            selector = cfg.strategy.get("select_k")
            if selector is None or "k" not in selector:
                raise UserError(f"k= does not apply to strategy {strategy_label(cfg.strategy)!r}: its K selector "
                                "has no k parameter (see its strategy.select_k settings)")
            OmegaConf.update(cfg, "strategy.select_k.k", int(cfg.k))
        self.cfg = cfg
        self.engine = engine
        self.loaded = engine.loaded
        self.run_plugins = list(run_plugins)
        self.shared = engine.shared

    def with_overrides(self, overrides: list[str]) -> Pipeline:
        """A pipeline composed from ``overrides`` (with the config's run plugins) on this one's loaded model: the
        chat's ``/strategy`` and ``/set``."""
        cfg = compose(list(overrides))
        return Pipeline(cfg, run_plugins=default_run_plugins(cfg), loaded=self.loaded)

    @property
    def strategy_name(self) -> str:
        """The strategy as runs name it: ``pld``, or ``mtp -> suffix_cache`` for one chosen by measurement."""
        return strategy_label(self.cfg.strategy)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def backend(self):
        """The engine's backend (``mtpflow.backends``): what runs the target's forwards."""
        return self.engine.backend

    def encode(self, prompt: str) -> torch.Tensor:
        """The prompt's token ids as this pipeline would feed them (chat template, system prompt)."""
        ids = encode_prompt(self.loaded.tokenizer, prompt, bool(self.cfg.chat), self.cfg.get("system_prompt"))
        if len(ids) + 1 > self.loaded.max_context:
            raise UserError(f"the prompt is {len(ids)} tokens; the model's context is {self.loaded.max_context}")
        return torch.tensor(ids, dtype=torch.long)

    def request(self, prompt: str | None = None, prompt_ids=None) -> Request:
        """The engine request for one prompt with this pipeline's settings."""
        cfg = self.cfg
        if prompt_ids is None and prompt is None:
            prompt = read_prompt(cfg)
        return Request(
            prompt=None if prompt_ids is not None else prompt,
            prompt_ids=prompt_ids, strategy=str(self.cfg.strategy.get("name", "?")),
            temperature=effective_temperature(cfg),
            top_p=float(cfg.top_p), top_k=int(cfg.top_k), max_new_tokens=int(cfg.max_new_tokens),
            stop=list(stop_strings(cfg)), seed=int(cfg.seed), chat=bool(cfg.chat),
            system_prompt=cfg.get("system_prompt"),
        )

    def submit(self, prompt: str | None = None, *, prompt_ids=None, on_step=None, extra_plugins=()):
        plugins = tuple(f(self) for f in self.run_plugins) + tuple(extra_plugins)
        return self.engine.submit(self.request(prompt, prompt_ids), on_step=on_step, extra_plugins=plugins,
                                  strategy_config=self.cfg.strategy, keep_steps=True)

    def __call__(self, prompt: str | None = None, *, prompt_ids: torch.Tensor | list[int] | None = None,
                 on_step: Callable[[StepRecord | None, list[int]], None] | None = None,
                 extra_plugins: tuple[object, ...] = ()) -> DecodeResult:
        """Decode one prompt (text through the chat template, or ready ``prompt_ids``)."""
        handle = self.submit(prompt, prompt_ids=prompt_ids, on_step=on_step, extra_plugins=extra_plugins)
        try:
            result = handle.result()
        except BaseException:
            handle.cancel(wait=True)  # the run is recorded interrupted before the caller goes on
            raise
        if handle.status == "interrupted":
            raise KeyboardInterrupt
        return result

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[str]:
        """Yield text pieces as tokens are committed; ``last_result`` holds the result afterwards."""
        handle = self.submit(prompt, **kwargs)
        try:
            yield from handle.stream()
        except BaseException:
            handle.cancel(wait=True)
            raise
        self.last_result = handle.result()


def pipeline(strategy: str = "pld", overrides: list[str] | tuple[str, ...] = (), **kwargs) -> Pipeline:
    """Compose ``strategy`` with Hydra ``overrides`` (e.g. ``["max_new_tokens=64", "model.name=..."]``)."""
    return Pipeline(compose([f"strategy={strategy}", *overrides]), **kwargs)
