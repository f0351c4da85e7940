"""Length-scheduled K and hardware-aware K: schedule boundaries, device-name mapping with faked names, the
k=auto choice with faked costs, the on-disk cost cache, and both strategies end to end on the tiny model."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from mtpflow.errors import ConfigError
from mtpflow.types import Draft
from mtpflow import cost_model
from mtpflow.strategies import hardware
from mtpflow.strategies.hardware import HardwareAwareK, best_k, expected_tokens
from mtpflow.strategies.length import LengthScheduleK
from helpers import hf_greedy, make_pipeline

CPU_LIKE = {0: 0.065, 1: 0.110, 2: 0.115, 3: 0.118, 4: 0.120, 6: 0.125, 8: 0.130}  # 1 token is a GEMV
GPU_LIKE = {0: 0.0100, 1: 0.0101, 2: 0.0102, 3: 0.0102, 4: 0.0103, 6: 0.0104, 8: 0.0105}  # memory bound


def fake_context(device="cpu", prompt="hello", model=None, tokenizer=None, prompt_tokens=None, model_id="m"):
    return SimpleNamespace(device=device, prompt=prompt, model=model, tokenizer=tokenizer, model_id=model_id,
                           prompt_tokens=prompt_tokens if prompt_tokens is not None else torch.zeros(5))


def fake_record(drafted: int, accepted: int):
    draft = Draft.chain(list(range(drafted)))
    return SimpleNamespace(draft=draft, decision=SimpleNamespace(num_accepted=accepted))


# ---- length schedule ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length, k", [(1, 4), (127, 4), (128, 3), (300, 3), (512, 3), (513, 2), (4000, 2)])
def test_length_schedule_boundaries(length, k):
    assert LengthScheduleK().k_for_length(length) == k


def test_length_schedule_is_configurable():
    sel = LengthScheduleK(short_below=10, long_above=20, short_k=7, medium_k=5, long_k=0)
    assert [sel.k_for_length(n) for n in (9, 10, 20, 21)] == [7, 5, 5, 0]
    assert LengthScheduleK(k=6).k_for_length(5000) == 6


@pytest.mark.parametrize("kwargs", [dict(short_below=600), dict(short_k=-1), dict(measure="chars"),
                                    dict(long_above=0), dict(medium_k=2.5)])
def test_length_schedule_rejects_bad_settings(kwargs):
    with pytest.raises(ConfigError):
        LengthScheduleK(**kwargs)


def test_length_counts_the_request_not_the_chat_template(tiny):
    text = "the quick brown fox " * 40
    n_request = len(tiny.tokenizer(text.strip(), add_special_tokens=False)["input_ids"])
    templated = f"<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
    ctx = fake_context(prompt=templated, tokenizer=tiny.tokenizer, prompt_tokens=torch.zeros(1000))
    facts = LengthScheduleK().on_run_start(ctx)
    assert facts["prompt_length_tokens"] == n_request
    assert LengthScheduleK(measure="input").on_run_start(ctx)["prompt_length_tokens"] == 1000


def test_length_dynamic_end_to_end_is_lossless_and_reports_k(tiny):
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    pipe = make_pipeline(tiny, "length_dynamic", "max_new_tokens=24", "chat=false", "trace=off")
    result = pipe(prompt)
    ids = pipe.encode(prompt)
    assert result.token_ids == hf_greedy(tiny.model, ids, 24)
    assert result.stats["length_k"] == 4 and result.stats["prompt_length_tokens"] < 128
    assert result.stats["mtp_avg_k_used"] <= 4
    long_pipe = make_pipeline(tiny, "length_dynamic", "max_new_tokens=4", "chat=false", "trace=off",
                              "strategy.select_k.short_below=2", "strategy.select_k.long_above=3")
    assert long_pipe(prompt).stats["length_k"] == 2


# ---- hardware-aware K -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, k", [
    ("NVIDIA A100-SXM4-80GB", 4), ("NVIDIA H100 80GB HBM3", 6), ("NVIDIA H200", 6), ("NVIDIA L40S", 2),
    ("NVIDIA L40", 3), ("Tesla T4", 3), ("NVIDIA GeForce RTX 4090", 3),
])
def test_device_name_maps_to_k(monkeypatch, name, k):
    monkeypatch.setattr(hardware, "device_name", lambda device: name)
    sel = HardwareAwareK()
    facts = sel.on_run_start(fake_context(device="cuda:0"))
    assert facts == {"hardware_device": name, "hardware_k": k}
    assert sel.select_k(state=None) == k


def test_device_table_is_configurable():
    sel = HardwareAwareK(device_k={"RTX 4090": 5, "H100": 8}, other_gpu_k=1, device_name="NVIDIA GeForce RTX 4090")
    assert sel.k_for_device("NVIDIA GeForce RTX 4090", "cuda") == 5
    assert sel.k_for_device("NVIDIA H100 PCIe", "cuda") == 8
    assert sel.k_for_device("Tesla V100", "cuda") == 1
    assert HardwareAwareK(cpu_k=2).k_for_device("cpu", "cpu") == 2
    assert HardwareAwareK().k_for_device("cpu", "cpu") == "auto"


@pytest.mark.parametrize("kwargs", [dict(k="fast"), dict(cpu_k=-1), dict(auto_ks=[]), dict(acceptance_prior=1.5),
                                    dict(device_k={"A100": "many"}), dict(cost_repeats=0)])
def test_hardware_rejects_bad_settings(kwargs):
    with pytest.raises(ConfigError):
        HardwareAwareK(**kwargs)


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5.0


def test_auto_picks_k_by_cost_and_acceptance():
    # On a CPU-like profile drafting doubles the forward: only worth it when drafts are usually accepted.
    assert best_k(CPU_LIKE, 0.3) == 0
    assert best_k(CPU_LIKE, 0.9) == 8
    # On a memory-bound GPU extra draft tokens are nearly free: draft even at modest acceptance.
    assert best_k(GPU_LIKE, 0.3) > 0
    assert best_k(GPU_LIKE, 0.8) == 8


def test_auto_follows_the_runs_acceptance():
    sel = HardwareAwareK(k="auto", costs=CPU_LIKE, acceptance_prior=0.3, probe_every=4)
    facts = sel.on_run_start(fake_context())
    assert facts["hardware_k"] == "auto" and facts["auto_start_k"] == 0 and facts["auto_costs"] == "given"
    assert sel.select_k(state=None) == 0
    for _ in range(4):  # no drafts: after probe_every steps it probes with its best drafting K
        sel.on_step_end(fake_record(0, 0))
    probe = sel.select_k(state=None)
    assert probe > 0
    for _ in range(6):  # every draft fully accepted: acceptance climbs and K grows
        sel.on_step_end(fake_record(probe, probe))
    assert sel.acceptance > 0.85 and sel.select_k(state=None) == 8
    for _ in range(12):  # every draft rejected at once: back to plain decoding
        sel.on_step_end(fake_record(8, 0))
    assert sel.select_k(state=None) == 0


def test_auto_measures_once_and_caches_in_the_profile(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MTPFLOW_PROFILE", str(tmp_path / "profile.json"))  # an empty profile: tuned on first use
    ctx = fake_context(model=tiny.model, model_id=tiny.model_id)
    first = HardwareAwareK(k="auto", auto_ks=[0, 1, 2], cost_context=16, cost_repeats=1)
    facts = first.on_run_start(ctx)
    assert facts["auto_costs"] == "measured" and set(first.costs) == {0, 1, 2}
    (key,) = json.loads((tmp_path / "profile.json").read_text())["entries"]
    assert key.startswith(tiny.model_id)

    def no_measure(*args, **kwargs):
        raise AssertionError("measured again despite the profile")

    monkeypatch.setattr(cost_model, "time_verify_forwards", no_measure)
    second = HardwareAwareK(k="auto", auto_ks=[0, 1, 2], cost_context=16, cost_repeats=1)
    assert second.on_run_start(ctx)["auto_costs"] == "cached" and second.costs == first.costs
    other_device = HardwareAwareK(k="auto", auto_ks=[0, 1, 2], cost_context=16, device_name="NVIDIA H100")
    with pytest.raises(AssertionError):  # keyed by device: a new device is measured
        other_device.on_run_start(ctx)


def test_hardware_aware_end_to_end(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MTPFLOW_CACHE", str(tmp_path))
    prompt = "def add(a, b):\n    return a + b\n" * 2
    pipe = make_pipeline(tiny, "hardware_aware", "max_new_tokens=20", "chat=false", "trace=off",
                         "strategy.select_k.device_name=NVIDIA H100 80GB HBM3")
    result = pipe(prompt)
    assert result.token_ids == hf_greedy(tiny.model, pipe.encode(prompt), 20)
    assert result.stats["hardware_device"] == "NVIDIA H100 80GB HBM3" and result.stats["hardware_k"] == 6
    auto = make_pipeline(tiny, "hardware_aware", "max_new_tokens=20", "chat=false", "trace=off",
                         "strategy.select_k.cost_repeats=1", "strategy.select_k.cost_context=16")
    result = auto(prompt)  # the CPU default is auto: the curve comes from the suite's fixed profile
    assert result.stats["hardware_k"] == "auto" and result.stats["auto_costs"] == "cached"
    assert result.token_ids == hf_greedy(tiny.model, auto.encode(prompt), 20)
