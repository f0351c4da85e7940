"""The ``cuda_graph`` backend's static-shape verify forward, run on the CPU with graphs off: everything but the
capture (buckets, the preallocated pool, the in-forward mask, padding rows and sequences) is tested here, token
for token against HF ``generate``; the capture itself is exercised on a GPU (tests/kernels/test_cuda.py)."""
from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, make_tiny_model, tiny_loaded
from mtpflow.backends import create
from mtpflow.backends.cuda_graph import CUDAGraphBackend
from mtpflow.config import compose
from mtpflow.engine import Engine
from mtpflow.errors import UserError
from mtpflow.request import Request

LOSSLESS = ["baseline", "pld", "jacobi", "recycling", "suffix_cache", "mtp", "adaptive"]


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded(seed=5)


def engine(loaded, *overrides):
    return Engine(compose(["trace=off", "model.backend=cuda_graph", "model.graph_capacity=256", *overrides]),
                  loaded=loaded)


@pytest.mark.parametrize("strategy", LOSSLESS)
def test_greedy_equals_hf_alone(loaded, strategy):
    prompt = "the cat sat on the mat and the cat sat on the"
    ids = loaded.tokenizer(prompt)["input_ids"]
    with engine(loaded, f"strategy={strategy}", "max_new_tokens=40", "chat=false") as e:
        assert e.backend.name == "cuda_graph" and not e.backend.graphs
        result = e.generate(Request(prompt=prompt, chat=False))
    assert result.token_ids == hf_greedy(loaded.model, ids, len(result.token_ids))


def test_a_mixed_batch_pads_rows_and_sequences_and_stays_identical(loaded):
    prompts = ["one two three one two three one", "a b c d a b c", "the cat sat on the mat", "x y z"]
    strategies = ["pld", "baseline", "mtp", "jacobi"]
    with engine(loaded, "max_new_tokens=32", "max_batch_size=6") as e:
        results = e.generate([Request(prompt=p, strategy=s, chat=False) for p, s in zip(prompts, strategies)])
        buckets = sorted(e.backend._buckets)
    for prompt, result in zip(prompts, results):
        ids = loaded.tokenizer(prompt)["input_ids"]
        assert result.token_ids == hf_greedy(loaded.model, ids, len(result.token_ids)), prompt
    assert buckets and all(b in (1, 2, 4, 6) for b, _ in buckets)  # batch buckets up to max_batch_size
    assert any(b == 4 for b, _ in buckets)  # four sequences together took the 4-sequence bucket


def test_the_pool_is_allocated_once_and_never_moves(loaded):
    with engine(loaded, "max_new_tokens=24") as e:
        keys = [k.data_ptr() for k in e.pool.keys]
        assert e.pool.capacity == 256 and keys
        e.generate([Request(prompt="hello there", chat=False), Request(prompt="a b a b a b", chat=False)])
        assert [k.data_ptr() for k in e.pool.keys] == keys and e.pool.used == 0


def test_a_prompt_longer_than_the_capacity_fails_alone_with_one_line(loaded):
    with engine(loaded, "max_new_tokens=8") as e:
        long = Request(prompt=" ".join(["word"] * 120), chat=False)
        short = Request(prompt="hello", chat=False)
        handles = [e.submit(long), e.submit(short)]
        with pytest.raises(UserError, match="backend holds 192 per sequence"):
            handles[0].result()
        assert handles[1].result().token_ids


def test_rows_it_cannot_capture_are_one_line():
    model = make_tiny_model(64, seed=1)
    with pytest.raises(UserError, match="model.graph_rows must be whole numbers from 1 to 128"):
        CUDAGraphBackend(model, capacity=256, rows=[1, 4, 200])
    with pytest.raises(UserError, match="model.graph_rows"):
        CUDAGraphBackend(model, capacity=256, rows=[0])
    with pytest.raises(UserError, match="CUDA graphs need the model on a CUDA device"):
        CUDAGraphBackend(model, capacity=256, graphs=True)
    eager = make_tiny_model(64, seed=1)
    eager.config._attn_implementation = "eager"
    with pytest.raises(UserError, match="model.backend=cuda_graph does not apply here"):
        create(eager, "cuda_graph")


def test_graph_rows_are_checked_before_the_model_loads():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "mtpflow", "prompt=hi", "model.backend=cuda_graph",
                          "model.graph_rows=[1,5000]", "model.name=/nonexistent/model"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "model.graph_rows must be whole numbers" in lines[0], out.stderr


def test_the_static_forward_equals_the_dynamic_one(loaded):
    """One bucket's logits equal the hf backend's for the same sequences (padding rows and slots included)."""
    from mtpflow.target import Target
    from mtpflow.types import Draft

    backend = CUDAGraphBackend(loaded.model, capacity=128, rows=(4,))
    pool = backend.make_pool(3)
    hf = create(loaded.model, "hf")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 300, (n,), generator=g) for n in (5, 9)]
    drafts = [Draft.chain(torch.tensor([7, 8])), Draft(torch.tensor([3, 4, 5]), torch.tensor([-1, -1, 0]))]
    outs = []
    for b in (backend, hf):
        targets = [Target(b, pool=pool) for _ in prompts]
        for t, p in zip(targets, prompts):
            t.prefill(p)
        outs.append(b.verify(targets, [11, 12], drafts, [int(p.numel()) for p in prompts]))
        for t in targets:
            t.release()
    for static, dynamic in zip(*outs):
        assert torch.allclose(static.logits, dynamic.logits, atol=1e-5)
