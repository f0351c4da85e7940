"""One decision of how the target computes (``mtpflow.backends.ExecutionSpec``): every key that picks the path read
once, with one-line errors; the engine builds its backend from it; a forward the native kernel declines is a named
fallback, counted in the backend's stats and the run's."""
from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, make_pipeline, tiny_loaded
from mtpflow.backends import ExecutionSpec, create
from mtpflow.backends.native import kernel
from mtpflow.errors import ConfigError
from mtpflow.request import Request

needs_native = pytest.mark.skipif(not kernel.available(), reason="no C compiler to build the native kernel")


def test_the_defaults_and_what_a_config_sets():
    spec = ExecutionSpec.from_config({})
    assert spec == ExecutionSpec() and spec.backend == "auto" and spec.certified_head and spec.lean_forward
    spec = ExecutionSpec.from_config({"model": {"backend": "native_cpu", "quantize": "int8", "certified_head": False,
                                                "graph_rows": [4, 1, 2]}, "kernels": "torch"})
    assert (spec.backend, spec.quantize, spec.certified_head, spec.graph_rows, spec.kernels) == \
        ("native_cpu", "int8", False, (1, 2, 4), "torch")
    assert spec.describe() == "backend=native_cpu quantize=int8 certified_head=false"


@pytest.mark.parametrize("config, message", [
    ({"model": {"backend": "fast"}}, "model.backend must be one of auto, hf, native_cpu, cuda_graph, got 'fast'"),
    ({"model": {"quantize": "int4"}}, "model.quantize must be null or one of int8, got 'int4'"),
    ({"model": {"quantize": "int8", "backend": "cuda_graph"}}, "model.quantize=int8 runs on the native_cpu backend"),
    ({"model": {"dtype": "float8"}}, "model.dtype: unknown dtype 'float8'"),
    ({"model": {"certified_head": "yes"}}, "model.certified_head must be true or false, got 'yes'"),
    ({"model": {"lean_forward": 0}}, "model.lean_forward must be true or false, got 0"),
    ({"model": {"graph_capacity": 8}}, "model.graph_capacity must be a whole number >= 16, got 8"),
    ({"model": {"graph_rows": [0, 4]}}, "model.graph_rows must be whole numbers from 1 to 1024"),
    ({"model": {"graph_rows": [1.5]}}, "model.graph_rows must be whole numbers"),
    ({"kernels": "cuda"}, "kernels must be one of auto, torch, triton, got 'cuda'"),
])
def test_every_bad_value_is_one_line(config, message):
    with pytest.raises(ConfigError) as refused:
        ExecutionSpec.from_config(config)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_engine_builds_its_backend_from_its_spec():
    pipe = make_pipeline(tiny_loaded(seed=3), "baseline", "model.certified_head=false", "max_new_tokens=4")
    engine = pipe.engine
    assert engine.execution == ExecutionSpec.from_config(engine.cfg) and not engine.execution.certified_head
    assert engine.backend.spec is engine.execution
    assert not engine.backend.takes_argmax_only()  # certified_head=false reached the backend through the spec


@needs_native
def test_a_declined_verify_is_a_named_fallback_in_the_run_stats():
    """A weight replaced after the backend was built: the native kernel no longer points at it, so every verify runs
    the torch forward, named and counted; the tokens stay HF's. The hidden state of an inner layer, by contrast, is
    a tap of the kernel: no fallback."""
    loaded = tiny_loaded(seed=3)
    prompt = list(range(7, 27)) * 2
    pipe = make_pipeline(loaded, "pld", "max_new_tokens=12", "trace=off")
    down = loaded.model.model.layers[1].mlp.down_proj
    with torch.no_grad():
        down.weight = torch.nn.Parameter(down.weight.detach().clone())  # the same values, a new tensor
    result = pipe.engine.generate(Request(prompt_ids=prompt))
    assert result.token_ids == hf_greedy(loaded.model, prompt, 12)
    assert pipe.engine.backend.name == "native_cpu"
    verifies = result.stats["verify_forwards"]
    assert result.stats["backend_fallbacks"] == {"a weight was replaced": verifies} and verifies > 0
    assert pipe.engine.backend.stats()["backend_fallbacks"]["a weight was replaced"] >= verifies
    tapped = make_pipeline(tiny_loaded(seed=3), "pld", "+strategy.needs_hidden_states=[0]", "max_new_tokens=12",
                           "trace=off").engine.generate(Request(prompt_ids=prompt))
    assert tapped.token_ids == result.token_ids
    assert "backend_fallbacks" not in tapped.stats  # the kernel ran every verify, with the tap


def test_no_environment_variable_picks_the_path(monkeypatch):
    """The variables that used to switch the native kernel and the lean forward change nothing now."""
    from mtpflow import forward as lean

    loaded = tiny_loaded(seed=3)
    monkeypatch.setenv("MTPFLOW_NATIVE", "0")
    monkeypatch.setenv("MTPFLOW_LEAN_FORWARD", "0")
    assert lean.supports(loaded.model)
    assert create(loaded.model).name == ("native_cpu" if kernel.available() else "hf")
    assert create(loaded.model, "hf").lean
