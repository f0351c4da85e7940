"""The Python API: load the model once, decode many prompts.

    import mtpflow
    pipe = mtpflow.pipeline("pld", overrides=["max_new_tokens=64"])
    result = pipe("Summarize: ...")          # DecodeResult(text, token_ids, stats, steps)
    for piece in pipe.stream("Hello"): ...   # text as tokens are accepted
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from mtpflow.config import compose, effective_temperature, read_prompt, stop_strings, to_container, validate
from mtpflow.errors import UserError
from mtpflow.kernels import cpu_linear
from mtpflow.kernels.dispatch import use_backend
from mtpflow.loop import DecodeLoop
from mtpflow.types import RunContext
from mtpflow.model import encode_prompt, load_model
from mtpflow.plugins import build_stages, make_plugin_manager
from mtpflow.shared import SharedState
from mtpflow.types import DecodeResult, SamplingParams, StepRecord

# Factories called once per run to add run-level plugins (trace recorder, metrics); see ``add_run_plugin``.
RunPluginFactory = Callable[["Pipeline"], object]


class Pipeline:
    """A composed config plus its loaded model; each call runs one decode with fresh stage objects."""

    def __init__(self, cfg: DictConfig, run_plugins: tuple[RunPluginFactory, ...] = (), loaded=None):
        validate(cfg)
        if cfg.get("k") is not None:
            selector = cfg.strategy.get("select_k")
            if selector is None or "k" not in selector:
                raise UserError(f"k= does not apply to strategy {cfg.strategy.get('name')!r}: its K selector "
                                "has no k parameter (see its strategy.select_k settings)")
            cfg = cfg.copy()
            OmegaConf.update(cfg, "strategy.select_k.k", int(cfg.k))
        self.cfg = cfg
        build_stages(cfg.strategy)  # validate every stage's parameters before the (slow) model load
        m = cfg.model
        # ``loaded`` lets tests and the playground hand in a model that is already in memory.
        self.loaded = loaded or load_model(m.name, m.get("gguf_file"), m.dtype, m.device, m.attn_implementation)
        self.run_plugins = list(run_plugins)
        self.shared = SharedState()  # state shared on purpose across this pipeline's runs (mtpflow.shared)
        # float32 CPU verify forwards through oneDNN packed linears (see mtpflow.kernels.cpu_linear)
        self.packed_linear = cpu_linear.prepare(self.loaded.model, m.get("cpu_linear", "auto"))

    @property
    def strategy_name(self) -> str:
        return str(self.cfg.strategy.get("name", "?"))

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def encode(self, prompt: str) -> torch.Tensor:
        ids = encode_prompt(self.loaded.tokenizer, prompt, bool(self.cfg.chat), self.cfg.get("system_prompt"))
        if len(ids) + 1 > self.loaded.max_context:
            raise UserError(f"the prompt is {len(ids)} tokens; the model's context is {self.loaded.max_context}")
        return torch.tensor(ids, dtype=torch.long)

    def sampling(self) -> SamplingParams:
        return SamplingParams(effective_temperature(self.cfg), int(self.cfg.top_k), float(self.cfg.top_p))

    def check_ids(self, prompt_ids) -> torch.Tensor:
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
        vocab = self.loaded.model.get_input_embeddings().num_embeddings
        outside = ids[(ids < 0) | (ids >= vocab)]
        if outside.numel():
            raise UserError(f"prompt_ids must be token ids in [0, {vocab}), got {int(outside[0])}")
        return ids.long()

    def __call__(self, prompt: str | None = None, *, prompt_ids: torch.Tensor | list[int] | None = None,
                 on_step: Callable[[StepRecord | None, list[int]], None] | None = None,
                 extra_plugins: tuple[object, ...] = ()) -> DecodeResult:
        """Decode one prompt (text through the chat template, or ready ``prompt_ids``)."""
        cfg = self.cfg
        if prompt_ids is None:
            if prompt is None:
                prompt = read_prompt(cfg)
            elif not str(prompt).strip():
                raise UserError("empty prompt")
            ids = self.encode(prompt)
        else:
            ids = self.check_ids(prompt_ids)
            prompt = prompt if prompt is not None else self.loaded.tokenizer.decode(ids.tolist())
        plugins = tuple(f(self) for f in self.run_plugins) + tuple(extra_plugins)
        pm = make_plugin_manager(cfg.strategy, plugins)
        loop = DecodeLoop(pm, self.loaded, need_hidden=bool(cfg.strategy.get("needs_hidden_states", False)),
                          context_window=cfg.strategy.get("context_window"))
        context = RunContext(
            prompt=prompt, prompt_tokens=ids, strategy=self.strategy_name, model_id=self.loaded.model_id,
            device=str(self.loaded.device), max_new_tokens=int(cfg.max_new_tokens), sampling=self.sampling(),
            seed=int(cfg.seed), config=to_container(cfg), tokenizer=self.loaded.tokenizer, model=self.loaded.model,
            shared=self.shared,
        )
        # both scoped to this run's thread
        with use_backend(cfg.get("kernels") or "auto"), cpu_linear.packed(self.packed_linear):
            result = loop.run(context, stop=stop_strings(cfg), on_step=on_step)
        result.stats.setdefault("strategy", self.strategy_name)
        return result

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[str]:
        """Yield text pieces as tokens are committed (decoding runs in a worker thread)."""
        pieces: queue.Queue = queue.Queue()
        tokenizer = self.loaded.tokenizer
        emitted: list[int] = []
        printed = [0]
        cancelled = threading.Event()

        def on_step(record, tokens):
            if cancelled.is_set():  # the consumer stopped (Ctrl-C, closed generator): end the run as interrupted
                raise KeyboardInterrupt
            emitted.extend(tokens)
            text = tokenizer.decode(emitted, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # wait for a complete UTF-8 character
                pieces.put(text[printed[0]:])
                printed[0] = len(text)

        done = object()
        box: dict = {}

        def work():
            try:
                box["result"] = self(prompt, on_step=on_step, **kwargs)
            except BaseException as exc:  # handed to the consumer
                box["error"] = exc
            finally:
                pieces.put(done)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        try:
            while (item := pieces.get()) is not done:
                if item:
                    yield item
        except BaseException:
            # Let the worker end its run at the next step so on_run_end records it as interrupted.
            cancelled.set()
            worker.join()
            raise
        if "error" in box:
            raise box["error"]
        self.last_result = box["result"]


def pipeline(strategy: str = "pld", overrides: list[str] | tuple[str, ...] = (), **kwargs) -> Pipeline:
    """Compose ``strategy`` with Hydra ``overrides`` (e.g. ``["max_new_tokens=64", "model.name=..."]``)."""
    return Pipeline(compose([f"strategy={strategy}", *overrides]), **kwargs)
