"""The compiled verify forward (``model.compile=true``, ``mtpflow.compiled``): greedy decoding through it equals
HF ``generate`` alone and in a batch of mixed strategies; a bounded number of graphs serves every batch and draft
size; a second process loads the first one's compiled artifacts; a failed compile runs eager with one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import hf_greedy, tiny_loaded
from mtpflow import compiled
from mtpflow.config import compose
from mtpflow.engine import Engine
from mtpflow.errors import UserError
from mtpflow.kernels import cpu_linear, native_linear
from mtpflow.model import check_compile
from mtpflow.request import Request

NEW = 24
STRATEGIES = [("baseline", {}), ("pld", {"propose.costs": None}), ("jacobi", {"k": 3}), ("adaptive", {"propose.costs": None})]


@pytest.fixture(autouse=True)
def _graph_not_native_rows(monkeypatch):
    """Where mtpflow_llama_rows applies (a native plan) it runs instead of the graph; these tests are about the graph."""
    monkeypatch.setenv("MTPFLOW_NATIVE_ROW", "0")


def compiled_tiny(seed: int):
    loaded = tiny_loaded(seed=seed, layers=3)
    if native_linear.available():  # the linears go through the custom op to mtpflow's own kernel
        cpu_linear.install(loaded.model, plans=("native",) * len(cpu_linear.ROW_BUCKETS))
    assert compiled.enable(loaded.model, f"tiny-{seed}")
    return loaded


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(1, 300, (int(k),), generator=g).tolist() for k in torch.randint(2, 30, (n,), generator=g)]
    return [p * 3 if i % 2 == 0 else p for i, p in enumerate(out)]  # repeats: lookup drafts get accepted


def graphs() -> int:
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(compiled._layer.__code__))


def test_compiled_batch_equals_hf_greedy(max_batch_size=4):
    loaded = compiled_tiny(seed=max_batch_size)
    engine = Engine(compose(["strategy=pld", "trace=off", f"max_new_tokens={NEW}", "batch_k=off",
                             f"max_batch_size={max_batch_size}"]), loaded=loaded)
    before = graphs()
    requests = [Request(prompt_ids=p, strategy=STRATEGIES[i % 4][0], overrides=STRATEGIES[i % 4][1])
                for i, p in enumerate(prompts(8, seed=max_batch_size))]
    try:
        results = engine.generate(requests)
    finally:
        engine.close()
    drafted = 0
    for request, result in zip(requests, results):
        want = hf_greedy(loaded.model, request.prompt_ids, NEW)
        assert result.token_ids == want, (request.strategy, request.prompt_ids, result.token_ids, want)
        drafted += result.stats["draft_tokens"]
    state = compiled.describe(loaded.model)
    assert state["compiled"] and state["compile_seconds"] > 0 and drafted > 0
    # every batch size, draft size and cache length of the run: one new entry in all, one per sequence, drafts
    # (the slices into the pool used to split a class in two, "every slot used" or not, depending on which batch
    # size the scheduler happened to trace first: 5 graphs on one CI run; torch._check in write_rows keeps it 3)
    assert graphs() - before <= 3, f"{graphs() - before} graphs; TORCH_LOGS=recompiles says why"


def test_failed_compile_runs_eager_with_one_line(capsys, monkeypatch):
    loaded = compiled_tiny(seed=7)

    def broken(self):
        raise RuntimeError("no C++ compiler\nsecond line of a long error")

    monkeypatch.setattr(compiled.Compiled, "_build", broken)
    engine = Engine(compose(["strategy=pld", "trace=off", f"max_new_tokens={NEW}"]), loaded=loaded)
    prompt = prompts(1, seed=7)[0]
    try:
        result = engine.generate([Request(prompt_ids=prompt)])[0]
    finally:
        engine.close()
    assert result.token_ids == hf_greedy(loaded.model, prompt, NEW)
    lines = [line for line in capsys.readouterr().err.splitlines() if "model.compile" in line]
    assert lines == ["mtpflow: model.compile: compiling the verify forward failed, running eager "
                     "(RuntimeError: no C++ compiler)"]
    assert compiled.describe(loaded.model)["compiled"] is False


def test_unsupported_model_stays_eager_with_one_line(capsys):
    loaded = tiny_loaded(seed=3)
    loaded.model.config._attn_implementation = "eager"
    loaded.model.__dict__.pop("_mtpflow_lean", None)
    assert not compiled.enable(loaded.model, "tiny-eager")
    assert "has no compiled forward (Llama-family models on SDPA only); running eager" in capsys.readouterr().err
    assert compiled.describe(loaded.model) == {"compiled": False}


def test_compile_setting_is_checked():
    assert check_compile(True) is True and check_compile(False) is False
    with pytest.raises(UserError, match="model.compile must be true or false, got 'yes'"):
        check_compile("yes")


SECOND_PROCESS = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from helpers import tiny_loaded
    from mtpflow import compiled
    from mtpflow.config import compose
    from mtpflow.engine import Engine
    from mtpflow.request import Request
    loaded = tiny_loaded(seed=11, layers=3)
    compiled.enable(loaded.model, "tiny-11")
    engine = Engine(compose(["strategy=pld", "trace=off", "max_new_tokens=8"]), loaded=loaded)
    result = engine.generate([Request(prompt_ids=[5, 9, 12, 5, 9, 12, 5, 9])])[0]
    engine.close()
    print(json.dumps(dict(compiled.describe(loaded.model), tokens=result.token_ids)))
""")


def test_a_second_process_loads_the_compiled_artifacts(tmp_path):
    """The artifacts file alone carries the compile: each process gets a fresh, empty Inductor cache folder."""
    script = tmp_path / "run.py"
    script.write_text(SECOND_PROCESS.format(tests=os.path.dirname(__file__) + "/.."))
    runs = []
    for i in range(2):
        env = dict(os.environ, MTPFLOW_CACHE=str(tmp_path / "cache"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"ind{i}"))
        out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["compiled"] and not first["compile_cache_loaded"]
    assert second["compiled"] and second["compile_cache_loaded"] and second["tokens"] == first["tokens"]
    assert list((tmp_path / "cache" / "compiled").glob("*.bin"))
