"""The tuning profile (``mtpflow.host``) and ``python -m mtpflow.tune``: one versioned file per host holds every cost
measurement; the suite runs on a fixed one; a missing entry is measured once with a one-line notice; a damaged or
foreign profile the user named is one line and exit 2, one at the default location is measured again."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import save_tiny_model, write_profile
from mtpflow import cost_model, host, machine
from mtpflow.backends.hf import HFBackend
from mtpflow.errors import UserError

FIXTURE = Path(__file__).parent.parent / "fixtures" / "profile.json"


def context(loaded, greedy=True, **config):
    return SimpleNamespace(model=loaded.model, model_id=loaded.model_id, device="cpu", config=config,
                           sampling=SimpleNamespace(greedy=greedy))


def fake_timer(calls: list):
    """``time_verify_forwards`` without a forward: K costs (1 + K / 10) ms, counted in ``calls``."""
    def timer(backend, ks, context, repeats, argmax_only=False):
        calls.append((tuple(ks), context, argmax_only))
        return {k: [0.001 * (1 + k / 10)] * 2 for k in ks}
    return timer


def no_measuring(*args, **kwargs):
    raise AssertionError("measured despite the profile")


@pytest.fixture()
def own_profile(tmp_path, monkeypatch):
    """A named, not yet existing profile: the first use tunes it."""
    path = tmp_path / "profile.json"
    monkeypatch.setenv(host.PROFILE_ENV, str(path))
    return path


@pytest.fixture()
def default_location(tmp_path, monkeypatch):
    """No profile named: the host's file under a fresh cache directory."""
    monkeypatch.delenv(host.PROFILE_ENV, raising=False)
    monkeypatch.setenv("MTPFLOW_CACHE", str(tmp_path / "cache"))
    return host.profile_path()


def test_the_suite_runs_on_the_fixed_profile(tiny, fixed_profile, monkeypatch):
    assert os.environ[host.PROFILE_ENV] == str(fixed_profile) and fixed_profile != FIXTURE  # a copy
    monkeypatch.setattr(cost_model, "time_verify_forwards", no_measuring)
    monkeypatch.setattr(cost_model, "measure_batch_costs", no_measuring)
    stored = json.loads(FIXTURE.read_text())
    assert stored["host"]["cpu"] == host.ANY_CPU and stored["fallback"] == "default"
    curve = {int(k): v for k, v in stored["entries"]["default"]["verify"]["256"].items()}
    costs, source = cost_model.load_verify_costs(context(tiny))  # any model, any host: the default entry
    assert source == "cached" and costs == curve
    # another context and Ks the entry lacks: the nearest curve, interpolated
    costs, _ = cost_model.load_verify_costs(context(tiny), ks=[0, 5], cost_context=16)
    assert costs[0] == curve[0] and curve[4] < costs[5] < curve[6]
    batch, source = cost_model.load_batch_costs(tiny, HFBackend(tiny.model))
    assert source == "cached" and batch.seconds(16, 17) == pytest.approx(0.4054)
    assert fixed_profile.read_text() == FIXTURE.read_text()  # read, never written


def test_host_facts_and_where_the_profile_lives(monkeypatch, tmp_path, default_location):
    facts = machine.host_facts()
    assert facts["cpu"] == machine.cpu_name() and facts["threads"] == torch.get_num_threads()
    assert facts["torch"] == torch.__version__ and set(facts["flags"]) <= set(machine.FLAGS)
    assert default_location.parent == machine.cache_dir() / "profiles"
    assert f"-x{torch.get_num_threads()}-torch" in default_location.name
    monkeypatch.setattr(host, "cpu_name", lambda: "Another CPU")  # another CPU: another file
    assert host.profile_path() != default_location
    monkeypatch.setenv(host.PROFILE_ENV, str(tmp_path / "env.json"))
    assert host.profile_path() == tmp_path / "env.json"
    assert host.profile_path(str(tmp_path / "cfg.json")) == tmp_path / "cfg.json"  # profile=PATH comes first


def test_a_missing_entry_is_measured_once_with_a_notice(tiny, own_profile, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cost_model, "time_verify_forwards", fake_timer(calls))
    assert host.profile_hash() is None
    costs, source = cost_model.load_verify_costs(context(tiny), ks=[0, 1, 4], cost_context=64)
    assert source == "measured" and costs == {0: 0.001, 1: pytest.approx(0.0011), 4: pytest.approx(0.0014)}
    assert capsys.readouterr().err.splitlines() == [host.TUNING_NOTICE]
    data = json.loads(own_profile.read_text())
    assert data["version"] == host.PROFILE_VERSION and data["host"] == machine.host_facts()
    key = cost_model.cost_key(HFBackend(tiny.model), tiny.model_id, "cpu", False)
    assert list(data["entries"]) == [key] and data["entries"][key]["verify"]["64"]["4"] == pytest.approx(0.0014)
    first_hash = host.profile_hash()
    assert first_hash and len(first_hash) == 12
    again, source = cost_model.load_verify_costs(context(tiny), ks=[0, 1], cost_context=64)
    assert source == "cached" and again == {0: 0.001, 1: pytest.approx(0.0011)} and len(calls) == 1
    assert capsys.readouterr().err == ""
    cost_model.load_verify_costs(context(tiny), ks=[0, 2], cost_context=64)  # a K the curve lacks: measured, merged
    assert sorted(json.loads(own_profile.read_text())["entries"][key]["verify"]["64"], key=int) == ["0", "1", "2", "4"]
    assert host.profile_hash() != first_hash


def test_the_key_names_the_forward_and_what_its_sequences_read(tiny):
    backend = HFBackend(tiny.model)
    logits = cost_model.cost_key(backend, tiny.model_id, "cpu", False)
    argmax = cost_model.cost_key(backend, tiny.model_id, "cpu", True)
    assert logits != argmax and backend.describe() in logits and tiny.model_id in logits and "float32" in logits
    assert cost_model.cost_key(backend, tiny.model_id, "NVIDIA H100", False) != logits


def test_a_sampling_run_and_a_greedy_one_read_their_own_curves(tiny, own_profile, monkeypatch):
    calls = []
    monkeypatch.setattr(cost_model, "time_verify_forwards", fake_timer(calls))

    class ArgmaxBackend(HFBackend):  # a backend with a cheaper head for greedy sequences
        def takes_argmax_only(self):
            return True

    backend = ArgmaxBackend(tiny.model)
    for greedy in (True, False, True, False):
        ctx = context(tiny, greedy=greedy)
        ctx.backend = backend
        cost_model.load_verify_costs(ctx, ks=[0, 1], cost_context=32)
    assert [c[2] for c in calls] == [True, False]  # one measurement each, then read
    assert len(json.loads(own_profile.read_text())["entries"]) == 2


def test_batch_grid_is_stored_and_read(tiny, own_profile, monkeypatch):
    grid = {(b, q): [0.01 * b * q] for b in (1, 4) for q in (1, 3)}
    calls = []
    monkeypatch.setattr(cost_model, "measure_batch_costs", lambda *a, **k: calls.append(k) or grid)
    backend = HFBackend(tiny.model)
    model, source = cost_model.load_batch_costs(tiny, backend)
    assert source == "measured" and calls[0]["argmax_only"] is False
    (entry,) = json.loads(own_profile.read_text())["entries"].values()
    assert entry["batch"]["128"] == [[1, 1, 0.01], [1, 3, 0.03], [4, 1, 0.04], [4, 3, 0.12]]
    again, source = cost_model.load_batch_costs(tiny, backend)
    assert source == "cached" and again.table == model.table and len(calls) == 1


@pytest.mark.parametrize("content, reason", [
    ("{damaged", "damaged"),
    (json.dumps({"version": 1, "host": {"cpu": "*"}}), "damaged"),
    (json.dumps({"version": 1, "host": {"cpu": "*"}, "entries": {"k": {"verify": {"256": {"1": 0.1}}}}}), "K=0"),
    (json.dumps({"version": 1, "host": {"cpu": "*"}, "entries": {"k": {"batch": {"128": [[1, 1, 0.1], [4, 3, 0.2]]}}}}),
     "does not hold every"),
    (json.dumps({"version": 2, "host": {"cpu": "*"}, "entries": {}}), "version 2"),
    (json.dumps({"version": 1, "host": {"cpu": "Another CPU", "threads": 2}, "entries": {}}), "another CPU"),
])
def test_a_named_damaged_or_foreign_profile_is_one_line_and_nothing_is_measured(tiny, own_profile, monkeypatch,
                                                                               content, reason):
    own_profile.write_text(content)
    monkeypatch.setattr(cost_model, "time_verify_forwards", no_measuring)
    with pytest.raises(UserError, match=reason) as err:
        cost_model.load_verify_costs(context(tiny))
    assert "\n" not in str(err.value) and str(own_profile) in str(err.value)
    assert own_profile.read_text() == content  # left as it was


def test_a_named_profile_of_other_threads_is_foreign(tiny, own_profile):
    write_profile(own_profile, {}, host={"cpu": machine.cpu_name(), "threads": torch.get_num_threads() + 1})
    with pytest.raises(UserError, match="threads"):
        host.load_profile()
    write_profile(own_profile, {}, host={"cpu": machine.cpu_name(), "threads": torch.get_num_threads()})
    assert host.load_profile()["entries"] == {}


@pytest.mark.parametrize("content", ["{damaged", json.dumps({"version": 1, "host": {"cpu": "Another CPU"}, "entries": {
    "any": {"verify": {"256": {"0": 0.5}}}}, "fallback": "any"})])
def test_a_damaged_or_foreign_profile_at_the_default_location_is_measured_again(tiny, default_location, monkeypatch,
                                                                                capsys, content):
    default_location.parent.mkdir(parents=True)
    default_location.write_text(content)
    calls = []
    monkeypatch.setattr(cost_model, "time_verify_forwards", fake_timer(calls))
    costs, source = cost_model.load_verify_costs(context(tiny), ks=[0, 1], cost_context=32)
    assert source == "measured" and costs[0] == 0.001  # never the foreign file's 0.5
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "measuring again" in err[0] and err[1] == host.TUNING_NOTICE
    data = json.loads(default_location.read_text())  # replaced by this host's profile
    assert data["host"]["cpu"] == machine.cpu_name() and "fallback" not in data


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny Llama saved as a model folder (``model.name=PATH``)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=5)


def run_cli(*args, env=None, module="mtpflow"):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_tune_writes_what_runs_read(tiny_folder, tmp_path, capsys):
    from mtpflow.tools.tune import main

    path = tmp_path / "tuned.json"
    assert main([f"model.name={tiny_folder}", f"profile={path}", "trace=off", "strategy=hardware_aware",
                 "strategy.select_k.cost_context=32"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}" in out and "K=32" in out and "q=17" in out
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["host"]["cpu"] == machine.cpu_name()
    for key, entry in data["entries"].items():
        assert str(tiny_folder) in key
        assert sorted(entry["verify"], key=int) == ["32", "256"]
        assert sorted(entry["verify"]["256"], key=int) == [str(k) for k in cost_model.CURVE_KS]  # K = 0..32
    assert sum("batch" in e for e in data["entries"].values()) == 1
    (grid,) = [e["batch"]["128"] for e in data["entries"].values() if "batch" in e]
    assert len(grid) == len(cost_model.BATCH_SIZES) * len(cost_model.BATCH_ROWS)
    before = path.read_bytes()
    # a run on the tuned profile reads it: nothing measured, no notice, the file unchanged
    run = run_cli(f"model.name={tiny_folder}", "prompt=the quick brown fox", "max_new_tokens=4", "trace=off",
                  "output=json", f"profile={path}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["stats"]["pld_costs"] == "cached" and host.TUNING_NOTICE not in run.stderr
    assert path.read_bytes() == before


def test_tune_shape_names_its_choices_in_one_line(capsys):
    from mtpflow.tools.tune import main

    assert main(["shape=2b"]) == 2
    assert capsys.readouterr().err.strip() == "mtpflow.tune: error: shape=2b: choose one of 1b, 3b, 8b"
    assert main(["shape=1b", "precisions=[int4]"]) == 2


def test_the_first_cli_run_without_a_profile_tunes_with_one_notice(tiny_folder, tmp_path):
    path = tmp_path / "first.json"
    run = run_cli(f"model.name={tiny_folder}", "prompt=the quick brown fox", "max_new_tokens=4", "trace=off",
                  "output=json", env={host.PROFILE_ENV: str(path)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["stats"]["pld_costs"] == "measured"
    assert run.stderr.count(host.TUNING_NOTICE) == 1 and path.exists()


DAMAGED = "{not json"
FOREIGN = json.dumps({"version": 1, "host": {"cpu": "Another CPU"}, "entries": {}})


@pytest.mark.parametrize("module, content, how", [("mtpflow", DAMAGED, "config"), ("mtpflow", FOREIGN, "env"),
                                                  ("mtpflow.tune", FOREIGN, "config"), ("mtpflow.serve", DAMAGED, "env")])
def test_the_cli_server_and_tune_exit_2_on_a_named_damaged_or_foreign_profile(tiny_folder, tmp_path, module, content, how):
    path = tmp_path / "named.json"
    path.write_text(content)
    args = [f"model.name={tiny_folder}", "trace=off"] + (["prompt=hi", "max_new_tokens=2"] if module == "mtpflow" else [])
    args, env = (args + [f"profile={path}"], None) if how == "config" else (args, {host.PROFILE_ENV: str(path)})
    run = run_cli(*args, env=env, module=module)
    assert run.returncode == 2, run.stderr[-2000:]
    (line,) = run.stderr.strip().splitlines()
    assert "error: the tuning profile" in line and str(path) in line
    assert path.read_text() == content
