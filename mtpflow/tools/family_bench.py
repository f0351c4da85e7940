"""The model families on the native backend, measured: each family's tiny model on ``native_cpu`` against ``hf``, and
where a real model's decode step goes, part by part. One run, one manifest.

    python -m mtpflow.tools.family_bench                                # mode=tiny: every family's tiny model
    python -m mtpflow.tools.family_bench mode=parts model=gemma3-270m   # where a step of Gemma 3 270M goes

``mode=tiny``: for each family of ``FAMILIES`` a tiny random model built from its transformers config class
(``make_family_model``: 4 layers, hidden 64, grouped-query attention, the family's sliding window, soft-caps,
norms, rotary variants), greedy ``baseline`` decoding of the same prompts through the ``native_cpu`` and the ``hf``
backends in one process, and HF ``generate``; tokens/s of each (the fastest of ``repeats`` passes) and whether both
backends' tokens are HF's. Writes family_tiny.csv.

``mode=parts``: one model (``model=``, float32 and its int8 model), a prompt (the shipped benchmark prompts' text)
prefilled, then the parts of a decode
step timed alone, each the fastest of ``repeats`` at the same position: the decoder layers (``mtpflow_llama_rows``
without the head; ``mtpflow_w8a8_rows`` without and with its int8 head), the certified int8 head and the float32
head over the step's rows, the whole verify forward through the backend, and HF's own one-token forward over a
``DynamicCache``; for 1 and 1 + ``k`` rows. Writes family_parts.csv with the bytes each part reads and the GB/s
that makes.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from mtpflow.errors import UserError

DEFAULTS = {
    "mode": "tiny",  # tiny | parts
    "families": None,  # mode=tiny: these families only (default: all)
    "max_new_tokens": 64,
    "prompts": 4,  # mode=tiny: prompts of random token ids per family
    "repeats": 3,
    "model": "gemma3-270m",  # mode=parts
    "k": 10,  # mode=parts: the draft a verify carries (1 + k rows)
    "context": 128,  # mode=parts: prompt tokens before the timed step
    "out": "bench-results/families",
}

WINDOW = 12  # the tiny models' sliding window: shorter than the tests' contexts
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.2, eos_token_id=0, pad_token_id=0, bos_token_id=None)
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "gemma", "gemma2", "gemma3")


def family_config(family: str, vocab: int):
    """The transformers config of ``family``'s tiny model (see the module docstring)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, GemmaConfig, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config, SmolLM3Config)

    c = dict(COMMON, vocab_size=vocab)
    configs = {
        # Llama 1 / 2: every head its own keys and values; separate head
        "llama": lambda: LlamaConfig(**{**c, "num_key_value_heads": 4}, tie_word_embeddings=False),
        # Llama 3.x: grouped-query attention, llama3 rope scaling (its table from the model's own rotary_emb), tied
        "llama3": lambda: LlamaConfig(**c, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        "mistral": lambda: MistralConfig(**c, sliding_window=WINDOW, tie_word_embeddings=False),
        # biases on q, k, v; the layers from the second on slide
        "qwen2": lambda: Qwen2Config(**c, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                     tie_word_embeddings=False),
        # q / k norms
        "qwen3": lambda: Qwen3Config(**c, head_dim=16, tie_word_embeddings=True),
        # fused q/k/v and gate/up, partial rotary, every layer sliding
        "phi3": lambda: Phi3Config(**c, partial_rotary_factor=0.5, sliding_window=WINDOW, tie_word_embeddings=False),
        # layers without rotary (every second)
        "smollm3": lambda: SmolLM3Config(**c, no_rope_layer_interval=2, tie_word_embeddings=True),
        # (1 + w) norms, GELU-tanh, scaled embedding
        "gemma": lambda: GemmaConfig(**c, head_dim=16, hidden_act="gelu_pytorch_tanh"),
        # + norms around each block, soft-capped scores and logits, alternating sliding layers, eager attention
        "gemma2": lambda: Gemma2Config(**c, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                       attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                       attn_implementation="eager"),
        # + q / k norms, local and global rope tables (the global one linearly scaled)
        "gemma3": lambda: Gemma3TextConfig(**c, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                           layer_types=["sliding_attention", "full_attention"] * 2,
                                           rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                  "rope_theta": 10000.0},
                                                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                               "rope_theta": 1000000.0}}),
    }
    if family not in configs:
        raise UserError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    return configs[family]()


def make_family_model(family: str, vocab: int = 320, seed: int = 0):
    """A tiny random model of ``family`` (float32, eval mode; EOS and pad token 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = family_config(family, vocab)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation or "sdpa").eval()
    model.generation_config.eos_token_id = None  # the benchmark decodes max_new_tokens; tests set their EOS
    model.generation_config.pad_token_id = 0
    return model


def _best(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` (seconds): load on a shared machine only ever adds time."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_tiny(opts) -> list[dict]:
    from mtpflow.backends import create
    from mtpflow.target import Target
    from mtpflow.types import Draft

    rows = []
    families = list(opts.families or FAMILIES)
    generator = torch.Generator().manual_seed(0)
    for family in families:
        model = make_family_model(family)
        prompts = [torch.randint(1, 320, (24,), generator=generator) for _ in range(int(opts.prompts))]
        n = int(opts.max_new_tokens)

        def hf_generate():
            outs = []
            with torch.inference_mode():
                for p in prompts:
                    out = model.generate(p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long),
                                         do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
                    outs.append(out[0, p.numel():].tolist())
            return outs

        def greedy(backend):
            def decode():
                outs = []
                with torch.inference_mode():
                    for p in prompts:
                        target = Target(backend)
                        logits, _ = target.prefill(p)
                        token, out = int(logits[-1].argmax()), []
                        while len(out) < n:
                            out.append(token)
                            v = target.verify(token, Draft.chain([]), target.cache_len)
                            token = int(v.logits[-1].argmax())
                        target.release()
                        outs.append(out)
                return outs
            return decode

        want = hf_generate()
        timings = {"hf_generate": _best(hf_generate, int(opts.repeats))}
        same = {}
        for name in ("hf", "native_cpu"):
            backend = create(model, name)
            decode = greedy(backend)
            same[name] = decode() == want
            timings[name] = _best(decode, int(opts.repeats))
        tokens = n * len(prompts)
        rows.append({"family": family, "model_class": type(model).__name__, "tokens": tokens,
                     "hf_generate_tok_s": round(tokens / timings["hf_generate"], 1),
                     "hf_backend_tok_s": round(tokens / timings["hf"], 1),
                     "native_cpu_tok_s": round(tokens / timings["native_cpu"], 1),
                     "native_vs_hf_backend": round(timings["hf"] / timings["native_cpu"], 2),
                     "native_vs_hf_generate": round(timings["hf_generate"] / timings["native_cpu"], 2),
                     "hf_backend_identical": same["hf"], "native_identical": same["native_cpu"]})
        print(rows[-1], file=sys.stderr)
    return rows


def run_parts(opts) -> tuple[list[dict], dict]:
    """(rows, the model's facts) of ``mode=parts`` (see the module docstring)."""
    from transformers import DynamicCache

    from mtpflow.backends import create, quantize_int8, verify_rows
    from mtpflow.model import load_model
    from mtpflow.target import Target
    from mtpflow.types import Draft

    repeats, k, context = int(opts.repeats), int(opts.k), int(opts.context)
    loaded = load_model(str(opts.model))
    model = loaded.model
    vocab = int(model.config.vocab_size)
    # text, not random ids: the certified head's cost depends on how sure each row is (a near-tie costs exact rows),
    # so the prompt and the draft are the shipped benchmark prompts' tokens, one after another
    from mtpflow.tools.specbench import load_prompt_suite

    text = "\n\n".join(row["prompt"] for row in load_prompt_suite())
    ids = torch.tensor(loaded.tokenizer(text)["input_ids"], dtype=torch.long)
    if ids.numel() < context + 1 + k:
        raise UserError(f"context={context} and k={k} ask for more tokens than the benchmark prompts have")
    prompt, draft = ids[:context], ids[context:context + 1 + k]  # the root, then k draft tokens
    rows = []

    def add(precision, part, n, seconds, nbytes=None):
        rows.append({"precision": precision, "part": part, "rows": n, "ms": round(seconds * 1e3, 3),
                     "mb_read": None if nbytes is None else round(nbytes / 1e6, 1),
                     "gb_per_s": None if nbytes is None else round(nbytes / seconds / 1e9, 1)})
        print(rows[-1], file=sys.stderr)

    def chain_rows(target, n):
        return verify_rows([target], [int(draft[0])], [Draft.chain(draft[1:n].tolist())],
                           [target.cache_len + target.position_shift])

    # float32: the native backend's parts, then HF's own forward
    native = create(model, "native_cpu")
    desc = native.description
    layer_bytes = sum(m.weight.numel() * 4 for layer in desc.layers
                      for m in (*layer.qkv, layer.o, *layer.gate_up, layer.down))
    head = model.lm_head
    with torch.inference_mode():
        target = Target(native)
        target.prefill(prompt)
        length = target.cache_len
        for n in (1, 1 + k):
            step = chain_rows(target, n)
            _, normed = native._rows.run_groups(target.pool, step, taps=(-1,), head_from=None)
            add("float32", "decoder layers (mtpflow_llama_rows)", n,
                _best(lambda: native._rows.run_groups(target.pool, step, head_from=None), repeats), layer_bytes)
            native.head_logits(normed, True)  # builds the certified head once
            add("float32", "certified int8 head", n, _best(lambda: native.head_logits(normed, True), repeats),
                native._head.nbytes)
            add("float32", "float32 head (native product)", n,
                _best(lambda: native.head_logits(normed, False), repeats), head.weight.numel() * 4)

            def whole():
                target.cache_len = length
                native.verify([target], [int(draft[0])], [Draft.chain(draft[1:n].tolist())], [length])

            target.argmax_only = True
            add("float32", "whole verify forward (native_cpu, certified head)", n, _best(whole, repeats))
            target.cache_len = length
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt[None], cache=cache, use_cache=True)
        hf_length = cache.get_seq_length()

        def hf_step():
            extra = cache.get_seq_length() - hf_length
            if extra:
                cache.crop(-extra)  # transformers 5: a negative count removes that many entries
            model(input_ids=draft[:1][None], cache=cache, use_cache=True)

        add("float32", "HF forward of one token (DynamicCache)", 1, _best(hf_step, repeats))
    target.release()
    facts = {"model": loaded.model_id, "layers_mb_float32": round(layer_bytes / 1e6, 1),
             "head_mb_float32": round(head.weight.numel() * 4 / 1e6, 1), "vocab": vocab}
    # int8: the kernel without and with its head
    del native, target
    weights = quantize_int8(model)
    int8 = create(model, int8=weights)
    int8_layers = sum(lin.nbytes for layer in weights.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    with torch.inference_mode():
        target = Target(int8)
        target.prefill(prompt)
        for n in (1, 1 + k):
            step = chain_rows(target, n)
            no_head = _best(lambda: int8.run(target.pool, step, head_from=None), repeats)
            add("int8", "decoder layers (mtpflow_w8a8_rows)", n, no_head, int8_layers)
            with_head = _best(lambda: int8.run(target.pool, step), repeats)
            add("int8", "decoder layers + int8 head", n, with_head, int8_layers + weights.head.nbytes)
            add("int8", "int8 head (the difference)", n, with_head - no_head, weights.head.nbytes)
    facts.update(layers_mb_int8=round(int8_layers / 1e6, 1), head_mb_int8=round(weights.head.nbytes / 1e6, 1))
    return rows, facts


def run(opts, argv: list[str]) -> int:
    import pandas as pd

    from mtpflow.errors import writable_folder
    from mtpflow.tools import manifest

    out = Path(str(opts.out))
    writable_folder(out)
    if opts.mode == "tiny":
        rows, facts, name = run_tiny(opts), {"name": "tiny random models of every family"}, "family_tiny.csv"
    elif opts.mode == "parts":
        rows, facts = run_parts(opts)
        name = "family_parts.csv"
    else:
        raise UserError(f"mode must be tiny or parts, got {opts.mode!r}")
    table = pd.DataFrame(rows)
    table.to_csv(out / name, index=False)
    print(table.to_string(index=False))
    record = manifest.collect(f"family_{opts.mode}", argv, model=facts,
                              settings={k: OmegaConf.to_container(opts)[k] for k in DEFAULTS})
    record["command"] = " ".join(["python", "-m", "mtpflow.tools.family_bench", *argv])
    manifest.write(out, record, [name])
    return 0


def main(argv=None) -> int:
    from mtpflow.errors import run_command

    def parse_and_run(args: list[str]) -> int:
        try:
            opts = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist(args))
        except Exception as exc:
            raise UserError(f"bad arguments: {exc}".splitlines()[0]) from None
        return run(opts, args)

    return run_command("mtpflow.tools.family_bench", parse_and_run, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
