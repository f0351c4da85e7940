"""SuffixProposer: drafts on a hand-made state, the entry point and strategy, and lossless decoding on a
tiny random Llama (token-identical to HF greedy) where a repeated request gets longer accepted drafts."""
from __future__ import annotations

import importlib.metadata

import pytest
import torch

from mtpflow.plugins import entry_points
from mtpflow.errors import ConfigError
from mtpflow.types import DecodeState, SamplingParams
from mtpflow_plugin_example import suffix
from mtpflow_plugin_example.suffix import SuffixProposer


@pytest.fixture(autouse=True)
def fresh_histories(monkeypatch):
    monkeypatch.setenv(entry_points.SELECT_ENV, "example")  # load this plugin whatever the caller's setting
    entry_points.clear_cache()
    suffix.HISTORIES.clear()
    yield
    suffix.HISTORIES.clear()
    entry_points.clear_cache()


class Context:  # the parts of mtpflow.loop.RunContext the proposer reads
    def __init__(self, prompt):
        self.prompt_tokens = torch.tensor(prompt)
        self.model_id = "hand-made"
        self.tokenizer = None


class Result:
    def __init__(self, ids):
        self.token_ids = ids


def state(tokens, prompt_len):
    return DecodeState(tokens=torch.tensor(tokens), prompt_len=prompt_len, step=0, next_position=len(tokens) - 1,
                       sampling=SamplingParams(), max_new_tokens=64)


def test_drafts_an_earlier_output_of_the_process():
    first = SuffixProposer(use_request=False, spec_factor=4.0)
    first.on_run_start(Context([1, 2, 3]))
    assert first.propose(state([1, 2, 3, 40], 3), k=8).num_nodes == 0  # nothing seen yet
    first.on_run_end(Result([40, 41, 42, 43, 44, 45]), "complete")
    second = SuffixProposer(use_request=False, spec_factor=4.0)
    assert second.on_run_start(Context([7, 2, 3])) == {"suffix_history_outputs": 1}
    draft = second.propose(state([7, 2, 3, 40], 3), k=8)
    assert draft.source == "suffix" and draft.is_chain
    assert draft.tokens.tolist() == [41, 42, 43, 44, 45]  # the stored prompt tail lets step 0 match
    assert second.propose(state([7, 2, 3, 40], 3), k=2).tokens.tolist() == [41, 42]  # at most K deep


def test_failed_runs_are_not_learned():
    p = SuffixProposer()
    p.on_run_start(Context([1, 2, 3]))
    p.on_run_end(Result([4, 5, 6]), "failed")
    assert SuffixProposer().on_run_start(Context([1])) == {"suffix_history_outputs": 0}


def test_the_request_itself_is_matched_like_prompt_lookup():
    p = SuffixProposer(use_request=True)
    p.on_run_start(Context([5, 6, 7, 8, 9, 5, 6]))
    draft = p.propose(state([5, 6, 7, 8, 9, 5, 6], 7), k=3)
    assert draft.tokens.tolist() == [7, 8, 9]
    assert not SuffixProposer(use_request=False).propose(state([5, 6, 7, 8, 9, 5, 6], 7), k=3).num_nodes


@pytest.mark.parametrize("kwargs", [{"min_match": 0}, {"min_match": 4, "max_match": 3}, {"spec_factor": 0},
                                    {"min_prob": 1.5}, {"max_nodes": 2.5}, {"max_outputs": True}])
def test_bad_parameters_are_config_errors(kwargs):
    with pytest.raises(ConfigError, match="strategy.propose"):
        SuffixProposer(**kwargs)


def test_entry_point_and_strategy_are_installed():
    eps = importlib.metadata.entry_points(group="mtpflow")
    assert any(ep.name == "example" and ep.value == "mtpflow_plugin_example" for ep in eps)
    (plugin,) = [p for p in entry_points.third_party_plugins() if p.name == "example"]
    assert plugin.error is None and plugin.strategies == ("suffix",)
    from mtpflow.config import compose

    assert compose(["strategy=suffix"]).strategy.propose._target_ == "mtpflow_plugin_example.suffix.SuffixProposer"


def tiny_loaded():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from mtpflow.model import LoadedModel

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["suffix decoding drafts from earlier outputs"] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 0
    return LoadedModel(model, tokenizer, "tiny-llama-suffix", torch.device("cpu"), torch.float32, 512, (0,))


def test_lossless_and_a_repeated_request_is_drafted_from_history():
    import mtpflow

    loaded = tiny_loaded()
    pipe = mtpflow.pipeline("suffix", ["max_new_tokens=40", "strategy.propose.use_request=false"], loaded=loaded)
    prompts = [[11, 12, 13, 14], [21, 22, 23], [11, 12, 13, 14]]
    results = [pipe(prompt_ids=p) for p in prompts]
    for p, r in zip(prompts, results):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=40, pad_token_id=0)[0, len(p):].tolist()
        assert r.token_ids == ref
    assert results[0].stats["accepted_tokens"] == 0  # nothing to draft from the first time
    assert results[2].stats["suffix_history_outputs"] == 2
    assert results[2].stats["mal"] > 3 * max(results[0].stats["mal"], 1.0)
    assert {s.draft.source for s in results[2].steps} == {"suffix"}
    stats = results[2].stats  # the proposer's own counts, through the run_stats hook
    assert stats["suffix_drafts"] == sum(1 for s in results[2].steps if s.draft.num_nodes)
    assert stats["suffix_accepted_tokens"] == stats["accepted_tokens"] > 0
