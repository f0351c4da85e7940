"""The Python side of each verify row's argmax, log-normalizer and top ids in one native pass (``kernel.logit_stats``,
logit_stats.c; its values against torch on every build: tests/native/test_native_harness.py): what it declines and
clamps, the native backends handing them to every Verification, and only the top ids a run's stages read."""
from __future__ import annotations

import pytest
import torch

from helpers import make_tiny_model
from mtpflow.backends.native import cpu as native_cpu
from mtpflow.backends.native import kernel
from mtpflow.target import Target
from mtpflow.types import Draft

pytestmark = pytest.mark.skipif(not kernel.available(), reason="the native CPU kernels could not be built")


def test_strided_rows_and_what_it_declines():
    x = torch.randn(16, 3000)[::2]  # rows 6000 floats apart
    argmax, log_norm, top_ids = kernel.logit_stats(x, 2, top=16)
    assert torch.equal(argmax, x.argmax(-1))
    torch.testing.assert_close(log_norm, torch.logsumexp(x, -1))
    assert torch.equal(top_ids, x.topk(16, dim=-1).indices)
    assert kernel.logit_stats(x, 2, top=40)[2].shape == (8, kernel.TOP_IDS_MAX)  # at most TOP_IDS_MAX
    assert kernel.logit_stats(torch.randn(2, 3), 2, top=8)[2].shape == (2, 3)  # at most the vocabulary
    assert kernel.logit_stats(x.double(), 2) is None  # only float32
    assert kernel.logit_stats(x.t(), 2) is None  # rows must be contiguous
    assert kernel.logit_stats(torch.zeros(3, 0), 2) is None


def test_native_verification_carries_them():
    """A native verify's Verification comes with the three already computed, equal to torch's over its logits; a
    target whose stages read no top ids gets none."""
    model = make_tiny_model(96, layers=2)
    with torch.inference_mode():
        target = Target(native_cpu.NativeCPUBackend(model))
        target.top_ids = 6  # what token recycling's stage would declare
        target.prefill(torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(0)))
        draft = Draft(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 0, 2]))
        v = target.verify(1, draft, root_position=target.cache_len)
    assert {"_target_argmax", "_log_norm", "_top_ids"} <= set(v.__dict__)  # handed over, not computed on demand
    assert torch.equal(v.target_argmax(), v.logits.argmax(-1))
    torch.testing.assert_close(v.log_norm(), torch.logsumexp(v.logits, -1))
    assert torch.equal(v.top_ids(4), v.logits.topk(4, dim=-1).indices)
    assert torch.equal(v.top_ids(20), v.logits.topk(20, dim=-1).indices)  # more than it came with: torch's
    target.top_ids = 0
    with torch.inference_mode():
        v = target.verify(1, draft, root_position=target.cache_len)
    assert "_top_ids" not in v.__dict__ and "_log_norm" in v.__dict__
    assert torch.equal(v.top_ids(4), v.logits.topk(4, dim=-1).indices)


@pytest.mark.parametrize("strategy,reads", [("baseline", 0), ("pld", 0), ("recycling", 8), ("mtp_heads", 8)])
def test_a_run_reads_the_top_ids_its_stages_declare(strategy, reads):
    """Token recycling (alone or grafted into mtp_heads' tree) declares its top-k; other stages none."""
    from mtpflow.config import compose
    from mtpflow.loop import reads_top_ids
    from mtpflow.plugins.manager import make_plugin_manager

    assert reads_top_ids(make_plugin_manager(compose([f"strategy={strategy}"]).strategy)) == reads
