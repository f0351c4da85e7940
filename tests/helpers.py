"""Helpers shared by the test suite: tiny randomly initialised Llama models with a tiny byte-level tokenizer,
the HF greedy reference and a pipeline builder. Import with ``from helpers import ...`` (a plain module, so
the several ``conftest.py`` files in sub-folders never shadow it)."""
from __future__ import annotations

import random

import torch

from mtpflow.plugins import hookimpl
from mtpflow.types import Draft

TINY_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return a + b\n",
    "Summarize the following text in one sentence.",
    "speculative decoding drafts tokens and verifies them in one forward pass",
] * 4


def count_runs(monkeypatch, module, name: str) -> list:
    """Patch ``module.<name>`` to record every call that ran rather than declined (returned something)."""
    ran, real = [], getattr(module, name)

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        if out is not None:
            ran.append(out)
        return out

    monkeypatch.setattr(module, name, counting)
    return ran


def write_profile(path, entries: dict, host: dict | None = None, fallback: str | None = None, version: int = 1):
    """A tuning profile file (``mtpflow.host``) at ``path`` with ``entries`` ({key: {"verify": {context: {K:
    seconds}}, "batch": {context: [[B, q, seconds], ...]}}}); ``host`` defaults to ``{"cpu": "*"}`` (any host)."""
    import json
    from pathlib import Path

    data = {"version": version, "host": host or {"cpu": "*"}, "entries": entries}
    if fallback is not None:
        data["fallback"] = fallback
    Path(path).write_text(json.dumps(data))
    return Path(path)


def make_tiny_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TINY_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def make_tiny_model(vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 64, init: float = 0.2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=init,
        eos_token_id=0, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 0
    return model


def save_tiny_model(folder, seed: int = 0):
    """A tiny Llama and its tokenizer saved as a model folder (``model.name=PATH``, a peer's or a tool's input);
    returns the folder."""
    tok = make_tiny_tokenizer()
    make_tiny_model(len(tok), seed=seed).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def save_tiny_gpt2(folder):
    """A tiny random GPT-2 and the tiny tokenizer saved as a model folder: a model the native layer description
    does not know (LayerNorm, learned positions), which the native backends decline; returns the folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = make_tiny_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=256, eos_token_id=0,
                        pad_token_id=0, bos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def prompt_rows(ids: torch.Tensor, slot: int):
    """A prompt's rows over an empty pool slot, causal: one chunk of a prefill as the native decoder stacks take it
    (``mtpflow.backends.native.rows.VerifyRows``)."""
    from mtpflow.backends.native.rows import VerifyRows

    n = len(ids)
    causal = torch.ones(n, n, dtype=torch.bool).tril_().to(torch.uint8)
    return VerifyRows(ids, torch.arange(n), causal, [slot] * n, list(range(n)), [0] * n, [0] * n, [n] * n, [0], [n])


def tiny_loaded(seed: int = 0, **kwargs):
    from mtpflow.model import LoadedModel

    tok = make_tiny_tokenizer()
    model = make_tiny_model(len(tok), seed=seed, **kwargs)
    return LoadedModel(model, tok, f"tiny-llama-{seed}", torch.device("cpu"), torch.float32, 1024, (0,))


def hf_greedy(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """Reference: plain HF generate, greedy."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)[None]
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def make_pipeline(loaded, strategy: str, *overrides: str, **kwargs):
    import mtpflow.api as api

    return api.pipeline(strategy, list(overrides), loaded=loaded, **kwargs)


class OracleTreeProposer:
    """Knows the reference continuation; drafts a random tree that contains a (possibly corrupted) copy."""

    def __init__(self, reference: list[int], vocab: int, seed: int, wrong_rate: float = 0.2, branch: int = 3):
        self.reference, self.vocab = reference, vocab
        self.rng = random.Random(seed)
        self.wrong_rate, self.branch = wrong_rate, branch

    @hookimpl
    def propose(self, state, k):
        done = state.num_generated
        truth = self.reference[done : done + k]
        tokens, parents = [], []
        parent = -1
        for depth, tok in enumerate(truth):
            siblings = [self.rng.randrange(1, self.vocab) for _ in range(self.rng.randrange(0, self.branch))]
            right = tok if self.rng.random() > self.wrong_rate else self.rng.randrange(1, self.vocab)
            options = siblings + [right]
            self.rng.shuffle(options)
            chosen = None
            for t in options:
                tokens.append(t)
                parents.append(parent)
                if t == right and chosen is None:
                    chosen = len(tokens) - 1
                elif self.rng.random() < 0.3:  # dead-end branches with a child of their own
                    tokens.append(self.rng.randrange(1, self.vocab))
                    parents.append(len(tokens) - 2)
            parent = chosen
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), source="oracle")
