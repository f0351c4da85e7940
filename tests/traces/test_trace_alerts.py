"""conf/prometheus/alerts.yml: promtool checks the rules and runs their unit tests (alerts_test.yml) when the
Debian `prometheus` package is installed; a schema test of the YAML runs everywhere."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "conf" / "prometheus" / "alerts.yml"
PROMTOOL = shutil.which("promtool")


def test_rules_schema():
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert all(set(g) <= {"name", "rules", "interval"} and g["name"] for g in doc["groups"])
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    records = {r["record"] for r in rules if "record" in r}
    for r in rules:
        assert ("alert" in r) != ("record" in r) and isinstance(r["expr"], str) and r["expr"].strip()
    assert alerts["MtpHitRateLow"]["labels"]["severity"] == "warning"
    assert "< 0.88" in alerts["MtpHitRateLow"]["expr"] and alerts["MtpHitRateLow"]["for"] == "5m"
    assert alerts["MtpErrorPropagationHigh"]["labels"]["severity"] == "critical"
    assert "> 0.015" in alerts["MtpErrorPropagationHigh"]["expr"]
    assert "mtpflow_configured_k" in alerts["MtpAvgKFarBelowConfigured"]["expr"]
    # every recorded series an alert reads is defined, and every raw metric exists in the exporter
    from mtpflow.traces.metrics import PREFIX

    for a in alerts.values():
        for name in ("mtpflow:mtp_hit_rate:1h", "mtpflow:mtp_error_propagation_rate:1h", "mtpflow:mtp_avg_k_used:1h"):
            if name in a["expr"]:
                assert name in records
    exported = {f"{PREFIX}_{n}_total" for n in ("num_steps", "num_drafts", "num_hit_steps", "k_used",
                                                  "num_error_tokens", "num_judged_tokens")}
    text = RULES.read_text()
    for metric in exported:
        assert metric in text


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


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_checks_and_unit_tests_the_rules():
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=Path(__file__).parent,
                          capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr
