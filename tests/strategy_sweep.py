"""The all-strategies sweep, shared by the tests that run it on a device or a backend: every registered strategy
(the built-ins and the example plugin's ``suffix`` when installed) decodes on a tiny random model, token-identical to
HF ``generate`` (or a backend's own reference) for the lossless ones; speculative sampling stays in the target
distribution. Used by tests/kernels/test_cuda_strategies.py (CUDA), tests/unit/test_device_following.py (the CPU)
and tests/native/test_int8_model.py (the int8 model)."""
from __future__ import annotations

import importlib.metadata
from collections import Counter

import pytest
import torch

from mtpflow.config import available_strategies, compose

NEW_TOKENS = 24
# on the tiny model of seed 0: a plain prompt, and two whose greedy continuations repeat (the lookup and suffix
# drafters find matches, drafts get accepted), the second ending at EOS
PROMPTS = [[7, 19, 3, 250, 41, 8, 77, 12], [130, 96, 53, 114, 44, 188, 144, 269, 267] * 2,
           [48, 146, 287, 234, 292, 288, 248, 54, 4]]
PLUGIN_STRATEGIES = {"suffix": "example"}  # strategy -> the entry point of the installed plugin shipping it
CPU_ONLY = {"int8_draft": "native"}  # strategies that refuse a GPU model with one line (the word it contains)
SAMPLING_STRATEGIES = ["sampling", "mtp_heads"]  # a prompt-lookup chain; a head tree with every graft


def plugin_installed(strategy: str) -> bool:
    try:
        importlib.metadata.distribution("mtpflow-plugin-example")
    except importlib.metadata.PackageNotFoundError:
        return False
    return strategy in PLUGIN_STRATEGIES


def swept_strategies() -> list[str]:
    """Every strategy this installation registers: the built-ins (the test session loads no plugin) and the
    example plugin's, when it is installed."""
    return sorted(set(available_strategies()) | {s for s in PLUGIN_STRATEGIES if plugin_installed(s)})


def random_heads(loaded, kind: str, folder, seed: int = 0, scale: float = 0.05):
    """Randomly initialised draft heads of ``kind`` for ``loaded``'s model, saved into ``folder`` (float32)."""
    from mtpflow.request import hidden_taps_of
    from mtpflow.strategies.head_modules import Eagle3Drafter, EagleDrafter, MedusaHeads, save_heads

    torch.manual_seed(seed)
    hidden = loaded.model.config.hidden_size
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    common = {"num_heads": 1, "attention_heads": 4, "intermediate_size": 2 * hidden, "window": 8}
    if kind == "medusa":
        module = MedusaHeads(hidden, 3)
        for block in module.blocks:  # the default zero init would make every head repeat the root
            torch.nn.init.normal_(block.linear.weight, std=scale)
        extra = {"num_heads": 3}
    elif kind == "eagle":
        module, extra = EagleDrafter(hidden, 4, 2 * hidden, window=8), common
    else:
        taps = list(hidden_taps_of(loaded.model, "eagle3"))
        module, extra = Eagle3Drafter(hidden, 4, 2 * hidden, window=8, taps=len(taps)), {**common, "taps": taps}
    config = {"model_id": loaded.model_id, "hidden_size": hidden, "vocab_size": vocab, "kind": kind, **extra}
    save_heads(folder, module.cpu(), torch.arange(vocab), config, dtype=torch.float32)
    return folder


def sweep_overrides(strategy: str, loaded, heads_dir) -> list[str]:
    """Overrides that let ``strategy`` run (and really draft) on a tiny random model: no measured verify costs
    (a tiny model's would rightly stop drafting), a fixed K where K comes from measurements, random heads for
    the head drafters, the self-draft from one layer, no n-gram table built for another tokenizer."""
    s = compose([f"strategy={strategy}"]).strategy
    out: list[str] = []
    select_k, propose, gate = s.get("select_k") or {}, s.get("propose") or {}, s.get("gate") or {}
    if str(select_k.get("_target_", "")).endswith("HardwareAwareK"):
        out.append("k=3")
    if "costs" in propose:
        out.append("strategy.propose.costs=null")
    for i, pruner in enumerate(s.get("prune") or []):
        if "costs" in pruner:
            out.append(f"strategy.prune.{i}.costs=null")
        if str(pruner.get("_target_", "")).endswith("PFSPruner"):
            out.append(f"strategy.prune.{i}.threshold=0.0")
    target = str(propose.get("_target_", ""))
    if target.endswith("MTPHeadsProposer"):
        kind = str(propose.get("kind"))
        folder = heads_dir / f"{loaded.model_id}-{kind}"
        if not (folder / "heads.json").exists():
            random_heads(loaded, kind, folder)
        out.append(f"strategy.propose.heads={folder}")
    if target.endswith("DraftModelProposer"):
        out.append("strategy.propose.cost_aware=false")
        if propose.get("quantize") is None:
            out.append("strategy.propose.layers=1")
    if str(gate.get("_target_", "")).endswith("CompositeConfidenceGate"):
        out += ["strategy.gate.ngram_table=null", "strategy.gate.global_weight=0"]
    return out


def hf_greedy_on(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain HF generate, greedy, on the model's own device."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def check_strategy(strategy: str, loaded, heads_dir, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> dict:
    """Decode ``prompts`` greedily with ``strategy`` on ``loaded`` (whatever its device): token-identical to HF
    ``generate`` when the strategy is lossless, a full-length or EOS-ended output when it is lossy. Returns the
    summed stats that say the strategy really ran (draft and accepted tokens)."""
    from helpers import make_pipeline

    lossless = bool(compose([f"strategy={strategy}"]).strategy.get("lossless", False))
    overrides = sweep_overrides(strategy, loaded, heads_dir)
    pipe = make_pipeline(loaded, strategy, "trace=off", "temperature=0", f"max_new_tokens={new_tokens}", *overrides)
    totals = Counter()
    try:
        for i, ids in enumerate(prompts):
            result = pipe(prompt_ids=ids)
            if lossless:
                want = hf_greedy_on(loaded.model, ids, new_tokens)
                assert result.token_ids == want, f"{strategy} on {loaded.device}, prompt {i}"
            else:
                assert 0 < len(result.token_ids) <= new_tokens
            totals.update({k: result.stats.get(k, 0) for k in ("draft_tokens", "accepted_tokens", "new_tokens")})
    finally:
        pipe.engine.close()
    return dict(totals)


def sampling_counts(strategy: str, device: str, heads_dir, runs: int) -> tuple[Counter, int]:
    """(counts of the second emitted token, draft tokens) over ``runs`` seeds of ``strategy`` sampling at
    temperature 1 on an 8-token model on ``device``."""
    from helpers import make_pipeline, make_tiny_model, make_tiny_tokenizer
    from mtpflow.model import LoadedModel

    # init 0.2: a flat enough distribution that a gate which keeps a draft token it should refuse shows (checked:
    # always accepting the first draft token gives p ~ 1e-5 here, against ~1 for the real gate)
    model = make_tiny_model(8, seed=2, init=0.2).to(device)
    model.generation_config.eos_token_id = None
    loaded = LoadedModel(model, make_tiny_tokenizer(), "tiny-8", torch.device(device), torch.float32, 1024, (-1,))
    extra = [] if strategy == "baseline" else sweep_overrides(strategy, loaded, heads_dir)
    if strategy == "sampling":
        extra.append("strategy.propose.min_ngram=1")
    pipe = make_pipeline(loaded, strategy, "trace=off", "max_new_tokens=4", "temperature=1.0", *extra)
    counts, drafted = Counter(), 0
    try:
        for seed in range(runs):
            pipe.cfg.seed = seed
            r = pipe(prompt_ids=[1, 2, 3, 1, 2, 3, 1, 2])
            drafted += r.stats["draft_tokens"]
            counts[tuple(r.token_ids[:2])] += 1  # the first two tokens: the second decided by the gate when drafted
    finally:
        pipe.engine.close()
    return counts, drafted


_plain_counts: dict[tuple[str, int], Counter] = {}  # plain sampling's counts per (device, runs): taken once


def sampling_matches_plain_sampling(strategy: str, device: str, heads_dir, runs: int = 200) -> None:
    """Speculative sampling with ``strategy`` against plain sampling (baseline) on an 8-token model on
    ``device``: the first two emitted tokens have the same joint distribution (chi-square contingency test, as
    tests/unit/test_sampling_distribution.py does on the CPU)."""
    from scipy.stats import chi2_contingency

    if (device, runs) not in _plain_counts:
        _plain_counts[device, runs] = sampling_counts("baseline", device, heads_dir, runs)[0]
    plain = _plain_counts[device, runs]
    spec, drafted = sampling_counts(strategy, device, heads_dir, runs)
    assert drafted > runs // 2, f"{strategy} hardly drafted ({drafted} draft tokens in {runs} runs)"
    rows = [(plain.get(k, 0), spec.get(k, 0)) for k in sorted(set(plain) | set(spec))]
    rows = [r for r in rows if sum(r) >= 10]
    p = chi2_contingency([[a for a, _ in rows], [b for _, b in rows]]).pvalue
    assert p > 1e-3, f"{strategy} on {device}: sampled tokens differ from plain sampling (p = {p:.2g})"
