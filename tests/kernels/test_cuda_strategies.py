"""Every registered strategy on CUDA (skipped without a GPU): the built-ins and the example plugin's ``suffix``
(when installed) decode on a tiny random Llama in float32 on the GPU, token-identical to HF ``generate`` for the
lossless ones; speculative sampling stays in the target distribution there. The sweep itself is
``tests/strategy_sweep.py``, which the CPU runs too (tests/unit/test_device_following.py).
"""
from __future__ import annotations

import pytest
import torch

from strategy_sweep import (CPU_ONLY, PLUGIN_STRATEGIES, SAMPLING_STRATEGIES, check_strategy,
                            sampling_matches_plain_sampling, swept_strategies)

# ----- the CUDA tests -------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny_cuda():
    from helpers import tiny_loaded

    from mtpflow.model import LoadedModel

    cpu = tiny_loaded(seed=0)  # the model PROMPTS were chosen for
    model = cpu.model.to("cuda")
    return LoadedModel(model, cpu.tokenizer, cpu.model_id, torch.device("cuda"), torch.float32, 1024, (0,))


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("heads")


@cuda
@pytest.mark.parametrize("strategy", swept_strategies())
def test_every_strategy_on_cuda_matches_hf(tiny_cuda, heads_dir, strategy, monkeypatch):
    from mtpflow.plugins import entry_points
    from mtpflow.errors import UserError

    if strategy in PLUGIN_STRATEGIES:
        monkeypatch.setenv(entry_points.SELECT_ENV, PLUGIN_STRATEGIES[strategy])
        entry_points.clear_cache()
    try:
        if strategy in CPU_ONLY:  # by design CPU only (mtpflow's native forward): refused with one line
            with pytest.raises(UserError, match=CPU_ONLY[strategy]) as info:
                check_strategy(strategy, tiny_cuda, heads_dir)
            assert len(str(info.value).splitlines()) == 1
            return
        stats = check_strategy(strategy, tiny_cuda, heads_dir)
        assert stats["new_tokens"] > 0
    finally:
        entry_points.clear_cache()


@cuda
@pytest.mark.parametrize("strategy", SAMPLING_STRATEGIES)
def test_sampling_stays_in_distribution_on_cuda(strategy, heads_dir):
    sampling_matches_plain_sampling(strategy, "cuda", heads_dir)
