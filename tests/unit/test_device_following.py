"""Every strategy's stages follow the model's device. On the CPU: the all-strategies sweep of
``tests/strategy_sweep.py`` (every registered strategy on a tiny random Llama, token-identical to
HF ``generate`` when lossless), so the sweep the GPU runs is itself exercised here; the samplers draw where the
run's generator lives; ``model.device=cuda`` on a machine without CUDA is one line and exit 2 before any model
loads."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from test_heads_lossless import one_thread  # noqa: F401 (fixture: tiny-model stages run faster on one thread)
from strategy_sweep import (
    CPU_ONLY, PLUGIN_STRATEGIES, check_strategy, sampling_matches_plain_sampling, swept_strategies,
)


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("heads")


@pytest.mark.parametrize("strategy", swept_strategies())
def test_every_strategy_on_cpu_matches_hf(tiny, heads_dir, strategy, monkeypatch):
    from mtpflow.plugins import entry_points
    from mtpflow.errors import UserError

    if strategy in PLUGIN_STRATEGIES:
        monkeypatch.setenv(entry_points.SELECT_ENV, PLUGIN_STRATEGIES[strategy])
        entry_points.clear_cache()
    try:
        try:
            stats = check_strategy(strategy, tiny, heads_dir)
        except UserError as exc:  # a CPU-only strategy whose native forward could not be built here
            if strategy in CPU_ONLY and CPU_ONLY[strategy] in str(exc):
                pytest.skip(f"{strategy}: {exc}")
            raise
        assert stats["new_tokens"] > 0
    finally:
        entry_points.clear_cache()


def test_the_sweep_drafts(tiny, heads_dir):
    """The sweep's overrides make the drafters really draft (and get accepted) on a tiny random model, so the
    device paths of their stages run."""
    for strategy in ("pld", "recycling", "mtp_heads", "eagle", "suffix_cache", "typical"):
        stats = check_strategy(strategy, tiny, heads_dir)
        assert stats["draft_tokens"] > 0, strategy
        if strategy != "eagle":  # random EAGLE heads draft, but the tiny model rarely agrees with them
            assert stats["accepted_tokens"] > 0, strategy


def test_sampling_through_a_head_tree_stays_in_distribution(heads_dir):
    """The CUDA test's distribution check, here on the CPU: mtp_heads' tree (heads, lookup, recycling and
    suffix grafts) under speculative sampling samples what plain sampling samples."""
    sampling_matches_plain_sampling("mtp_heads", "cpu", heads_dir)


def test_sample_draws_on_the_generators_device(monkeypatch):
    """``sample`` moves the probabilities to the generator's device before drawing (multinomial refuses a
    generator of another device): checked by watching the device it asks for."""
    from mtpflow import sampling

    probs = torch.tensor([0.1, 0.0, 0.9])
    moved = []
    real_to = torch.Tensor.to

    class OtherDevice:  # a generator that says it lives elsewhere
        device = torch.device("meta")

    def fake_multinomial(p, n, generator=None):
        return torch.tensor([2])

    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: moved.append(a) or self)
    monkeypatch.setattr(torch, "multinomial", fake_multinomial)
    assert sampling.sample(probs, OtherDevice()) == 2
    monkeypatch.setattr(torch.Tensor, "to", real_to)
    assert moved == [(torch.device("meta"),)]
    g = torch.Generator().manual_seed(0)
    monkeypatch.undo()
    assert sampling.sample(probs, g) in (0, 2)  # same device: no copy, a plain draw


def test_cuda_on_a_machine_without_cuda_is_one_line_and_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    db = tmp_path / "traces.db"
    proc = subprocess.run([sys.executable, "-m", "mtpflow", "model.device=cuda", "prompt=hi", f"trace.db={db}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "mtpflow: error: model.device=cuda but CUDA is not available on this machine"]
    assert proc.stdout == ""


def test_resolve_device_refuses_devices_this_machine_lacks():
    from mtpflow.errors import UserError
    from mtpflow.backends.execution import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad, message in [("tpu", "unknown device"), ("meta", "unknown device"), ("cuda:x", "unknown device"),
                         (f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}",
                          "CUDA device" if torch.cuda.is_available() else "CUDA is not available")]:
        with pytest.raises(UserError, match=message):
            resolve_device(bad)
