"""mtpflow/conf/prometheus/alerts.yml, tested by behaviour: the rule unit tests in alerts_test.yml (made-up series:
each threshold from both sides, ``for:`` pending, an alert that clears, the recorded rates' values) run through
a small PromQL evaluator everywhere (promql_eval.py), and through ``promtool`` too where the Debian
`prometheus` package is installed. A rule whose threshold or expression changes fails them."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from promql_eval import Database, parse_series, run_unit_tests

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "mtpflow" / "conf" / "prometheus" / "alerts.yml"
UNIT_TESTS = Path(__file__).with_name("alerts_test.yml")
PROMTOOL = shutil.which("promtool")


def test_rules_are_well_formed():
    doc = yaml.safe_load(RULES.read_text())
    assert all(set(g) <= {"name", "rules", "interval"} and g["name"] for g in doc["groups"])
    for rule in (r for g in doc["groups"] for r in g["rules"]):
        assert ("alert" in rule) != ("record" in rule) and isinstance(rule["expr"], str) and rule["expr"].strip()
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]


def test_rules_behave_as_their_unit_tests_say():
    assert run_unit_tests(UNIT_TESTS) == []


def copy_with(tmp_path: Path, old: str, new: str) -> Path:
    """alerts_test.yml beside a copy of the rules with ``old`` replaced by ``new``."""
    text = RULES.read_text()
    assert old in text
    (tmp_path / "alerts.yml").write_text(text.replace(old, new))
    spec = yaml.safe_load(UNIT_TESTS.read_text())
    spec["rule_files"] = ["alerts.yml"]
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return tmp_path / "alerts_test.yml"


@pytest.mark.parametrize("old,new,alert", [
    ("< 0.88", "< 0.86", "MtpHitRateLow"),  # hit_low (0.87) would no longer alert
    ("> 0.015", "> 0.017", "MtpErrorPropagationHigh"),
    ("(0.5 * mtpflow_configured_k)", "(0.4 * mtpflow_configured_k)", "MtpAvgKFarBelowConfigured"),
    ("for: 15m", "for: 5m", "MtpAvgKFarBelowConfigured"),  # would fire at 10m
    ("increase(mtpflow_spec_decode_num_drafts_total[1h])) > 0", "increase(mtpflow_spec_decode_num_drafts_total[1h])) >= 0",
     "MtpHitRateLow"),  # baseline, which never drafts, would alert
])
def test_unit_tests_catch_a_changed_rule(tmp_path, old, new, alert):
    failures = run_unit_tests(copy_with(tmp_path, old, new))
    assert failures and all(alert in f for f in failures), failures


def test_the_evaluator_follows_prometheus():
    """increase() extrapolates like Prometheus; comparisons filter; ``and on`` keeps the left side."""
    db = Database()
    for i in range(61):
        db.add(parse_series('c{s="a"}'), 60.0 * i, 60.0 * i)
        db.add(parse_series('c{s="b"}'), 60.0 * i, 30.0 * i + 10)  # does not start at zero
        db.add(parse_series('k{s="a"}'), 60.0 * i, 4.0)
    assert db.evaluate("increase(c[1h])", 1800.0)[frozenset({("s", "a")})] == pytest.approx(1800.0)
    # 900 over the 30 sampled minutes, extrapolated back to where the counter was zero (20 s, under half an
    # interval): 900 * 1820 / 1800
    assert db.evaluate("increase(c[1h])", 1800.0)[frozenset({("s", "b")})] == pytest.approx(910.0)
    assert db.evaluate("rate(c[5m])", 3600.0)[frozenset({("s", "a")})] == pytest.approx(1.0)
    assert set(db.evaluate('c > 1000', 1800.0)) == {parse_series('c{s="a"}')}
    assert db.evaluate("sum by (s) (increase(c[1h])) / on (s) k", 1800.0)[frozenset({("s", "a")})] == 450.0
    assert set(db.evaluate("c and on (s) (k > 5)", 1800.0)) == set()
    assert db.evaluate("c", 3600.0 + 301) == {}  # past the 5 minute lookback


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", UNIT_TESTS.name], cwd=UNIT_TESTS.parent,
                          capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    broken = copy_with(tmp_path, "< 0.88", "< 0.86")  # promtool too fails a changed threshold
    assert subprocess.run([PROMTOOL, "test", "rules", broken.name], cwd=tmp_path, capture_output=True).returncode != 0


def test_exporter_names_match_the_rules(tmp_path):
    """The rules read metrics the exporter really produces (a renamed counter would silence an alert)."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    from mtpflow.traces import TraceStore
    from mtpflow.traces.metrics import exposition
    from test_trace_store import add_run

    store = TraceStore(tmp_path / "t.db")
    add_run(store)
    names = set()
    for family in text_string_to_metric_families(exposition(store).decode()):
        names.update(s.name for s in family.samples)
    used = set(re.findall(r"\b(mtpflow_[a-z_]+)\b", RULES.read_text()))
    assert used and used <= names, used - names
