"""The ``cuda_graph`` backend on a GPU: each (batch, rows) bucket is captured once and replayed, and fp32 greedy
decoding stays token-identical to HF ``generate`` (skipped without CUDA; the static-shape code itself is tested on
the CPU in tests/unit/test_cuda_graph_backend.py)."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_loaded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("strategy", ["baseline", "pld", "mtp"])
def test_captured_graphs_decode_as_hf(strategy):
    from dataclasses import replace

    from mtpflow.config import compose
    from mtpflow.engine import Engine
    from mtpflow.request import Request

    loaded = tiny_loaded(seed=5)
    loaded = replace(loaded, model=loaded.model.to("cuda"), device=torch.device("cuda"))
    prompts = ["the cat sat on the mat and the cat sat on the", "one two three one two three"]
    with Engine(compose(["trace=off", "model.backend=cuda_graph", "model.graph_capacity=256", "model.device=cuda",
                         f"strategy={strategy}", "max_new_tokens=32"]), loaded=loaded) as engine:
        assert engine.backend.graphs
        results = engine.generate([Request(prompt=p, chat=False) for p in prompts])
        stats = engine.backend.stats()
    assert stats["graphs_captured"] >= 1 and stats["graph_capture_seconds"] > 0
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([loaded.tokenizer(prompt)["input_ids"]], device="cuda")
        with torch.inference_mode():
            reference = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                              max_new_tokens=len(result.token_ids), pad_token_id=0)
        assert result.token_ids == reference[0, ids.shape[1]:].tolist(), prompt
