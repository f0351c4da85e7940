"""Decode comparison on a RANDOMLY initialised model of SmolLM2-135M's shape (no weights to fetch: the device
machines have no network, and the embedded GGUF is too big to carry): kernels=torch vs kernels=triton, attention
SDPA vs mtpflow, strategies baseline and pld, on repetitive prompt ids so prompt lookup drafts. Checks every
setting gives the same tokens as the first one (and as HF ``generate``) and writes a markdown table.

    python -m mtpflow.tools.random_model_decode --out decode.md             # on CUDA: SmolLM2-135M shape, bf16
    python -m mtpflow.tools.random_model_decode --tiny --settings torch-sdpa  # quick CPU smoke run

Token ids go in directly; the tokenizer is a word-level one over names ``t0 .. t{V-1}`` (any id decodes).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch


def id_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", unk_token="t1")


def build(tiny: bool, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from mtpflow.model import LoadedModel

    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512) if tiny else
             dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152))  # HuggingFaceTB/SmolLM2-135M
    torch.manual_seed(seed)
    config = LlamaConfig(**shape, max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=0, pad_token_id=0,
                         initializer_range=0.02)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    tok = id_tokenizer(shape["vocab_size"])
    # No eos ids: every run decodes exactly max_new_tokens (a random model may emit any id).
    return LoadedModel(model, tok, "random-smollm2-135m-shape", device, dtype, 2048, ())


def prompt_ids(vocab: int, seed: int) -> list[int]:
    """A 32-token random phrase repeated 6 times with small edits: plenty of n-grams for prompt lookup."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(2, vocab, (32,), generator=g).tolist()
    ids: list[int] = []
    for r in range(6):
        ids += phrase[:-r or None] if r % 2 else phrase
    return ids


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m mtpflow.tools.random_model_decode",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="decode_random.md")
    parser.add_argument("--tiny", action="store_true", help="2-layer hidden-64 model (CPU smoke run)")
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settings", default="torch-sdpa,triton-sdpa,torch-mtpflow,triton-mtpflow")
    parser.add_argument("--strategies", default="baseline,pld")
    args = parser.parse_args(argv)
    if args.max_new < 1 or args.repeats < 1:
        parser.error("--max-new and --repeats must be >= 1")

    from mtpflow.api import pipeline
    from mtpflow.kernels.hf_attention import register

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    register()
    loaded = build(args.tiny, device, dtype, seed=0)
    vocab = loaded.model.config.vocab_size
    ids = prompt_ids(vocab, seed=1)

    # HF generate reference (SDPA), greedy.
    loaded.model.set_attn_implementation("sdpa")
    x = torch.tensor([ids], device=device)

    def hf():
        with torch.inference_mode():
            return loaded.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=args.max_new,
                                         pad_token_id=0)[0, len(ids):].tolist()

    hf()
    hf_times = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        hf_tokens = hf()
        sync()
        hf_times.append(time.perf_counter() - t0)
    hf_tps = len(hf_tokens) / statistics.median(hf_times)
    print(f"HF generate (sdpa): {hf_tps:.1f} tokens/s, {len(hf_tokens)} tokens", flush=True)

    def write_table(final: bool) -> None:
        name = torch.cuda.get_device_name() if cuda else "cpu"
        lines = [f"Decode on a random model of SmolLM2-135M's shape ({'tiny' if args.tiny else '30 layers, hidden 576, 9/3 heads, vocab 49152'}), "
                 f"{str(dtype).replace('torch.', '')}, {name}, {datetime.date.today()}, torch {torch.__version__}; "
                 f"prompt {len(ids)} ids (a 32-id phrase repeated), {args.max_new} new tokens, median of {args.repeats} runs "
                 f"after one warm-up; HF generate (SDPA) {hf_tps:.1f} tokens/s.", "",
                 "| setting | strategy | tokens/s | vs HF generate | MAL | proposed | acceptance | same tokens as first baseline | same as HF | same over repeats |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['setting']} | {r['strategy']} | {r['tps']:.1f} | {r['vs_hf']:.2f}x | {r['mal']} | {r['proposed']} | {r['accept']} | "
                         f"{r['same_first']} | {r['same_hf']} | {r['stable']} |")
        text = "\n".join(lines) + "\n"
        if final:
            print(text)
        Path(args.out).write_text(text)

    rows = []
    first: dict[str, list[int]] = {}
    for setting in args.settings.split(","):
        backend, attn = setting.split("-")
        loaded.model.set_attn_implementation(attn)
        for strategy in args.strategies.split(","):
            pipe = pipeline(strategy, [f"max_new_tokens={args.max_new}", f"kernels={backend}", "trace=off"], loaded=loaded)
            pipe(prompt_ids=ids)  # warm-up (compiles the Triton kernels on first use)
            runs = []
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                result = pipe(prompt_ids=ids)
                sync()
                runs.append((time.perf_counter() - t0, result))
            wall = statistics.median(t for t, _ in runs)
            result = runs[-1][1]
            tokens = result.token_ids
            same_runs = all(r.token_ids == tokens for _, r in runs)
            first.setdefault(strategy, tokens)
            tps = len(tokens) / wall
            row = dict(setting=f"kernels={backend}, attn={attn}", strategy=strategy, tokens=len(tokens),
                       tps=tps, vs_hf=tps / hf_tps, mal=result.stats.get("mal"), proposed=result.stats.get("proposed_tokens"),
                       accept=result.stats.get("acceptance_rate"),
                       same_first=tokens == first["baseline" if "baseline" in first else strategy],
                       same_hf=tokens == hf_tokens, stable=same_runs)
            rows.append(row)
            print(row, flush=True)
            write_table(final=False)

    write_table(final=True)
    return rows


if __name__ == "__main__":
    main()
