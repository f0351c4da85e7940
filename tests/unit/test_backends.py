"""The seam between the loop and the target's forwards (``mtpflow.backends``): which backend a model gets, the
one-line errors for one that does not apply, and the rule that a backend never changes the user's model."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import make_tiny_model, save_tiny_gpt2, tiny_loaded
from mtpflow import backends
from mtpflow.backends.native import cpu as native_cpu
from mtpflow.errors import ConfigError, UserError
from mtpflow.backends.native import kernel, products

needs_native = pytest.mark.skipif(not kernel.available(), reason="the native kernels cannot be built here")


def snapshot(model):
    """Everything of the model a backend might change: each module's class and attribute names, every
    parameter's and buffer's values."""
    structure = [(name, type(m), sorted(vars(m))) for name, m in model.named_modules()]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return structure, state


def assert_unchanged(model, before):
    structure, state = snapshot(model)
    assert structure == before[0]
    assert state.keys() == before[1].keys()
    for key, value in state.items():
        assert torch.equal(value, before[1][key]), key
    for name, m in model.named_modules():
        assert not [a for a in vars(m) if "mtpflow" in a], name
        assert not type(m).__module__.startswith("mtpflow"), name


@pytest.mark.default_model
def test_every_strategy_leaves_the_model_as_loaded(default_loaded):
    """Decode with every registered strategy (one engine batch, the default backend), then the model's module
    classes, attribute names and state dict are what they were."""
    from mtpflow.config import available_strategies
    from mtpflow.engine import Engine
    from mtpflow.config import compose
    from mtpflow.request import Request

    model = default_loaded.model
    before = snapshot(model)
    engine = Engine(compose(["trace=off", "max_new_tokens=12", "max_batch_size=32"]), loaded=default_loaded)
    try:
        requests = [Request(prompt=f"Summarize in one line: item {i} costs {i + 3} dollars.", strategy=name)
                    for i, name in enumerate(available_strategies())]
        results = engine.generate(requests)
    finally:
        engine.close()
    assert len(results) == len(requests) and all(r.token_ids for r in results)
    assert_unchanged(model, before)


def test_auto_is_native_cpu_where_it_applies_and_hf_elsewhere():
    loaded = tiny_loaded(seed=3)
    backend = backends.create(loaded.model, "auto")
    assert backend.name == ("native_cpu" if kernel.available() else "hf")
    assert backends.create(loaded.model, "hf").name == "hf"
    eager = make_tiny_model(64, seed=1)  # the kernel's own attention: the model's attention implementation aside
    eager.config._attn_implementation = "eager"
    assert backends.create(eager, "auto").name == ("native_cpu" if kernel.available() else "hf")
    assert backends.create(make_tiny_model(64, seed=1).to(torch.bfloat16), "auto").name == "hf"


@needs_native
def test_a_backend_that_does_not_apply_is_one_line():
    model = make_tiny_model(64, seed=1).to(torch.bfloat16)
    with pytest.raises(UserError, match="model.backend=native_cpu does not apply here: it runs float32 weights"):
        backends.create(model, "native_cpu")
    with pytest.raises(ConfigError, match="model.backend must be one of auto, hf, native_cpu, cuda_graph, got 'fast'"):
        backends.create(model, "fast")
    with pytest.raises(UserError, match="model.quantize=int8 runs on the native_cpu backend, not model.backend=hf"):
        backends.create(make_tiny_model(64, seed=1), "hf", int8=backends.quantize_int8(make_tiny_model(64, seed=1)))


@needs_native
def test_two_backends_over_one_model_share_its_fused_weights():
    """Fusing q/k/v and gate/up makes the parts views into one weight; a second backend finds them laid out
    already and holds no second copy."""
    model = make_tiny_model(64, seed=2)
    first = native_cpu.NativeCPUBackend(model)
    second = native_cpu.NativeCPUBackend(model)
    for a, b in zip(first.qkv + first.gate_up, second.qkv + second.gate_up):
        assert a.weight.data_ptr() == b.weight.data_ptr() and a.ready() and b.ready()
    block = model.model.layers[0]
    assert block.self_attn.k_proj.weight.data_ptr() == first.qkv[0].weight[64:].data_ptr()


@needs_native
def test_describe_names_what_computes_the_forwards():
    model = make_tiny_model(64, seed=2)
    hf, native = backends.create(model, "hf"), backends.create(model, "native_cpu")
    assert hf.describe() == "hf cpu float32"
    assert native.describe().startswith("native_cpu cpu float32 certified-head kernel:")
    assert kernel.source_hash()[:10] in native.describe()
    assert not backends.create(model, "native_cpu", certified_head=False).takes_argmax_only()


@pytest.mark.parametrize("argv, message", [
    (["model.backend=fast"], "model.backend must be one of auto, hf, native_cpu, cuda_graph, got 'fast'"),
    (["model.backend=hf", "model.quantize=int8"], "model.quantize=int8 runs on the native_cpu backend"),
])
def test_backend_config_errors_are_one_line_exit_2(argv, message):
    out = subprocess.run([sys.executable, "-m", "mtpflow", "prompt=hi", "trace=off", *argv], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], out.stderr


@needs_native
@pytest.mark.parametrize("backend", ["native_cpu", "auto"])
def test_a_model_the_description_does_not_know(tmp_path, backend):
    """GPT-2 (LayerNorm, learned positions): ``model.backend=native_cpu`` is one line, exit 2, naming what the
    layer description lacks; ``auto`` runs it on ``hf`` and says why in one line."""
    save_tiny_gpt2(tmp_path / "gpt2")
    out = subprocess.run([sys.executable, "-m", "mtpflow", "model=hf", f"model.name={tmp_path / 'gpt2'}",
                          f"model.backend={backend}", "prompt=hi", "trace=off", "chat=false", "max_new_tokens=4"],
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stderr.strip().splitlines() if line.strip() and "warning: plugin" not in line]
    why = "GPT2LMHeadModel: its family is not one the layer description knows"
    if backend == "native_cpu":
        assert out.returncode == 2, out.stderr[-2000:]
        assert len(lines) == 1 and f"model.backend=native_cpu does not apply here: {why}" in lines[0], lines
    else:
        assert out.returncode == 0, out.stderr[-2000:]
        said = [line for line in lines if "model.backend=auto runs hf" in line]
        assert len(said) == 1 and why in said[0], out.stderr


@needs_native
def test_native_cpu_on_another_device_is_one_line():
    """The CPU backend asked for a model that lives elsewhere (CUDA on a GPU machine; ``meta`` here stands in:
    the check reads only where the weights live)."""
    model = make_tiny_model(64, seed=1).to("meta")
    with pytest.raises(UserError, match="model.backend=native_cpu does not apply here: it runs on the CPU and the "
                                        "model is on meta"):
        backends.create(model, "native_cpu")
    assert backends.create(model, "auto").name == "hf"


def test_tree_allowed_is_the_root_the_node_and_its_ancestors():
    import random

    from mtpflow.backends.base import tree_allowed

    rng = random.Random(0)
    for n in [0, 1, 2, 5, 12, 33] * 20:
        parents = [rng.randrange(-1, i) if i else -1 for i in range(n)]
        allowed = tree_allowed(torch.tensor(parents, dtype=torch.long))
        assert allowed.dtype == torch.bool and allowed.shape == (n + 1, n + 1)
        for row in range(n + 1):
            seen, node = {0, row}, row - 1
            while node >= 0:  # the node's ancestors, by their rows
                seen.add(node + 1)
                node = parents[node]
            assert allowed[row].tolist() == [col in seen for col in range(n + 1)]
