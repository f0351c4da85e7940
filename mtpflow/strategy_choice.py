"""A strategy chosen by measurement (``mtp``): a strategy YAML with a ``choose`` node names lossless candidate
strategies and a default; ``python -m mtpflow.tune strategy=mtp`` times the candidates on this host and stores the
winner in the tuning profile (``mtpflow.host``), and ``resolve_choice`` turns the strategy into that candidate's
stages for an engine: its model, backend and precision pick the profile entry (``choice_key``), as cost curves do.

Where the profile holds no choice, the default runs with a one-line notice: timing every candidate takes a minute or
more, too long to hide in a first request (a missing cost curve, by contrast, is measured in seconds). A stored
choice that cannot run here (not a candidate, not a strategy, not lossless, a stage that cannot be built or lacks
what it needs, such as trained heads) falls back to the default with one line, never a traceback. ``strategy.*=``
settings given to the choosing strategy are settings of its own stages, the default's: with them the default runs
(one line where the profile names another candidate; to set a candidate's parameters, name that strategy).
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf, open_dict

from mtpflow.config import available_strategies, compose
from mtpflow.cost_model import cost_key, device_name
from mtpflow.errors import UserError
from mtpflow.host import load_profile

CHOOSE = "choose"  # the strategy key that makes a strategy chosen by measurement


def choice_key(backend, loaded) -> str:
    """The profile entry a choice is stored in: the cost key (``cost_model.cost_key``: model, dtype, device, what
    computes the forwards and its precision) of a greedy sequence's forward, the one a lossless run takes."""
    return cost_key(backend, loaded.model_id, device_name(str(loaded.device)), backend.takes_argmax_only())


def choice_settings(strategy: DictConfig) -> tuple[list[str], str] | None:
    """(candidates, default) of a strategy chosen by measurement, or None for an ordinary strategy."""
    node = strategy.get(CHOOSE)
    if node is None:
        return None
    candidates = [str(c) for c in node.get("candidates") or []]
    default = str(node.get("default") or (candidates[0] if candidates else ""))
    if not candidates or default not in candidates:
        raise UserError(f"strategy {strategy.get('name')!r}: choose.candidates must list strategies and "
                        f"choose.default must be one of them, got {candidates} and {default!r}")
    return candidates, default


def stored_choice(profile: dict, key: str, name: str) -> dict | None:
    """The choice stored for strategy ``name`` under the exact entry ``key`` (a fallback entry serves cost curves,
    never a choice: a winner measured on one model says nothing of another), or None."""
    entry = profile.get("entries", {}).get(key) or {}
    return (entry.get("choice") or {}).get(name)


def candidate_problem(name: str, candidates: list[str], model_config: dict, build_stages) -> str | None:
    """Why candidate ``name`` cannot run here (one phrase), or None: not listed, not a strategy, not lossless, a
    stage that cannot be built, or a stage that says what it lacks (``unavailable(model_config)``, e.g. trained
    heads for the model). ``build_stages``: ``mtpflow.plugins.manager.build_stages``, handed in by the engine (this
    module sits below the plugin manager)."""
    if name not in candidates:
        return f"is not one of its candidates ({', '.join(candidates)})"
    if name not in available_strategies():
        return "is not a strategy here"
    try:
        node = compose([f"strategy={name}"]).strategy
        if not node.get("lossless"):
            return "is not lossless"
        for _, stage in build_stages(node):
            unavailable = getattr(stage, "unavailable", None)
            reason = unavailable(model_config) if callable(unavailable) else None
            if reason:
                return f"cannot run: {reason}"
    except UserError as exc:
        return f"cannot run: {exc}"
    return None


def candidate_node(strategy: DictConfig, chosen: str, chosen_by: str, own: bool = False) -> DictConfig:
    """The chosen candidate's strategy node under the choosing strategy's name, with ``chosen`` (the candidate) and
    ``chosen_by`` (``measured``, ``default`` or ``overrides``) added: runs, stats and traces name it
    ``mtp -> chosen``. ``own``: the choosing strategy's own stages (its default's, with the user's overrides)."""
    source = strategy if own else compose([f"strategy={chosen}"]).strategy
    node = OmegaConf.create(OmegaConf.to_container(source, resolve=True))
    with open_dict(node):
        node.name = str(strategy.get("name"))
        node.chosen, node.chosen_by = chosen, chosen_by
    return node


def has_overrides(strategy: DictConfig, name: str) -> bool:
    """Whether ``strategy`` differs from the strategy ``name`` as shipped (``strategy.*=`` overrides were given)."""
    if name not in available_strategies():
        return True
    shipped = compose([f"strategy={name}"]).strategy
    return OmegaConf.to_container(strategy, resolve=True) != OmegaConf.to_container(shipped, resolve=True)


def resolve_choice(strategy: DictConfig, loaded, backend, model_config: dict, build_stages,
                   profile: str | None = None) -> tuple[DictConfig, str | None]:
    """(the strategy node that runs, a one-line notice or None). An ordinary strategy comes back as it is; one
    chosen by measurement becomes the candidate its profile entry names, else its default (``build_stages`` as for
    ``candidate_problem``)."""
    settings = choice_settings(strategy)
    if settings is None:
        return strategy, None
    candidates, default = settings
    name = str(strategy.get("name"))
    stored = stored_choice(load_profile(profile, quiet=True), choice_key(backend, loaded), name)
    if has_overrides(strategy, name):  # settings for its own stages (the default's): they run, with them
        other = stored is not None and str(stored.get("chosen")) != default
        return candidate_node(strategy, default, "overrides", own=True), (
            f"mtpflow: strategy {name} with strategy.* settings runs {default} with them, not the measured choice "
            f"{stored.get('chosen')!r} (name that strategy to change its settings)" if other else None)
    if stored is None:
        return candidate_node(strategy, default, "default"), (
            f"mtpflow: no measured choice for strategy {name} on this host and model; running {default} "
            f"(python -m mtpflow.tune strategy={name} measures {', '.join(candidates)})")
    chosen = str(stored.get("chosen"))
    problem = candidate_problem(chosen, candidates, model_config, build_stages)
    if problem is not None:
        return candidate_node(strategy, default, "default"), (
            f"mtpflow: the tuning profile chose {chosen!r} for strategy {name}, which {problem}; running {default}")
    return candidate_node(strategy, chosen, "measured"), None
