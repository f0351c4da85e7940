"""Hydra configuration: compose ``mtpflow/conf/config.yaml`` with overrides (the same path for the CLI, the Python
API, the benchmark and the playground), list strategies, and validate values before any model loads.

We use Hydra's compose API rather than ``@hydra.main`` so runs never create ``outputs/`` folders and every
configuration mistake becomes one clear line.
"""
from __future__ import annotations

import threading
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from mtpflow.conf import conf_dir
from mtpflow.errors import ConfigError, UserError, check_int, check_k, check_range

_compose_lock = threading.Lock()  # Hydra's global state is not thread-safe


def strategy_dirs() -> list[Path]:
    """Folders holding strategy YAMLs: the built-in one, then those contributed by plugins."""
    from mtpflow.plugins.entry_points import plugin_strategy_dirs

    return [conf_dir() / "strategy", *plugin_strategy_dirs()]


def available_strategies() -> list[str]:
    names = set()
    for d in strategy_dirs():
        names.update(p.stem for p in Path(d).glob("*.yaml"))
    return sorted(names)


def _search_path_override() -> list[str]:
    extra = []
    for d in strategy_dirs()[1:]:
        # a plugin folder is named strategy/ (checked when the plugin loads): add its parent as a conf root,
        # quoted so paths with spaces or commas survive Hydra's override grammar
        root = str(Path(d).parent).replace("\\", "\\\\").replace("'", "\\'")
        extra.append(f"'file://{root}'")
    return [f"hydra.searchpath=[{','.join(extra)}]"] if extra else []


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The fully composed config, or UserError for a bad override or an unknown strategy."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides, free_text = _split_free_text(list(overrides))
    for o in overrides:
        if o.startswith("strategy=") and "/" not in o:
            name = o.split("=", 1)[1]
            if name not in available_strategies():
                from mtpflow.plugins.entry_points import trouble_note

                raise UserError(f"unknown strategy {name!r}; available: {', '.join(available_strategies())}"
                                f"{trouble_note()}")
    with _compose_lock:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
                cfg = hydra_compose(config_name="config", overrides=overrides + _search_path_override())
        except (HydraException, OmegaConfBaseException) as exc:
            first = " ".join(str(exc).strip().split("\n")[0].split())
            raise UserError(f"bad configuration: {first}") from None
        finally:
            GlobalHydra.instance().clear()
    for key, value in free_text.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


FREE_TEXT_KEYS = ("prompt", "system_prompt", "prompt_file")


def _split_free_text(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """Take ``prompt=...`` style overrides out of Hydra's grammar: prompts are free text (colons, commas,
    brackets, quotes) that the shell has already unquoted."""
    rest, free = [], {}
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and key.lstrip("+") in FREE_TEXT_KEYS:
            free[key.lstrip("+")] = value
        else:
            rest.append(o)
    return rest, free


def effective_temperature(cfg: DictConfig) -> float:
    if cfg.get("temperature") is not None:
        return float(cfg.temperature)
    return float(cfg.strategy.get("temperature", 0.0) or 0.0)


def stop_strings(cfg: DictConfig) -> tuple[str, ...]:
    """``stop`` as strings: null, one value or a list (Hydra reads ``stop=5`` as a number; it means the text)."""
    stop = cfg.get("stop")
    items = [] if stop is None else list(stop) if isinstance(stop, ListConfig) else [stop]
    if any(s is None or isinstance(s, (bool, DictConfig, ListConfig)) or str(s) == "" for s in items):
        raise ConfigError(f"stop must be a non-empty string or a list of them, e.g. stop=[\"\\n\\n\"], got {stop!r}")
    return tuple(str(s) for s in items)


BATCH_K = ("auto", "off")


def check_batch_k(value) -> str:
    """The engine's batch-aware K setting, ``auto`` or ``off``; a YAML 1.1 reader turns a bare ``off`` into
    false, which means ``off`` here."""
    word = "off" if value is False else str(value)
    if word not in BATCH_K:
        raise ConfigError(f"batch_k must be auto or off, got {value!r}")
    return word


def validate(cfg: DictConfig) -> None:
    """Check user-facing values (raises ConfigError with one line)."""
    if cfg.output not in ("text", "json"):
        raise ConfigError(f"output must be text or json, got {cfg.output!r}")
    if not isinstance(cfg.get("chat", True), bool):
        raise ConfigError(f"chat must be true or false, got {cfg.chat!r}")
    stop_strings(cfg)
    check_int("max_new_tokens", cfg.max_new_tokens, 1)
    t = cfg.get("temperature")
    if t is not None:
        check_range("temperature", t, 0, None)
    check_range("top_p", cfg.top_p, 0, 1, low_inclusive=False)
    check_int("top_k", cfg.top_k, 0)
    check_int("seed", cfg.seed)
    if cfg.get("k") is not None:
        check_k("k", cfg.k)
    from mtpflow.backends.execution import ExecutionSpec
    from mtpflow.kernels.dispatch import check_impl_usable

    spec = ExecutionSpec.from_config(cfg)  # every key that picks how the target computes: one line for a bad one
    check_impl_usable(spec.kernels)
    for stage in ("select_k", "propose", "gate", "rescore", "window"):
        node = cfg.strategy.get(stage)
        if node is not None and not (isinstance(node, DictConfig) and "_target_" in node):
            raise ConfigError(f"strategy.{stage} must be null or a mapping with _target_")


def read_prompt(cfg: DictConfig) -> str:
    """The prompt text from ``prompt=`` or ``prompt_file=``; UserError when empty or unreadable."""
    if cfg.get("prompt_file"):
        path = Path(str(cfg.prompt_file)).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read prompt_file {path}: {exc.strerror if isinstance(exc, OSError) else 'not UTF-8 text'}") from None
    else:
        text = "" if cfg.get("prompt") is None else str(cfg.prompt)
    if not text.strip():
        raise UserError("empty prompt: pass prompt=\"...\" or prompt_file=PATH")
    return text


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
