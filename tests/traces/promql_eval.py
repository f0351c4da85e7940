"""A small PromQL evaluator and rule-unit-test runner, so the alert rules in mtpflow/conf/prometheus/alerts.yml are
tested by behaviour on every machine: it runs the same promtool unit-test file (tests/traces/alerts_test.yml)
that ``promtool test rules`` runs where Prometheus is installed.

It covers the PromQL the rules use, with Prometheus' semantics: instant selectors (5 minute lookback), range
selectors, ``increase``/``rate`` (with Prometheus' extrapolation), ``sum``/``avg``/``min``/``max``/``count``
``by``/``without``, arithmetic, comparisons (filtering or ``bool``), ``and``/``or``/``unless``, ``on``/
``ignoring`` matching; rule groups evaluated in order every ``evaluation_interval``, ``for:`` pending, and the
``humanize``/``humanizePercentage`` annotation templates. Anything else is an error, never a silent pass.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

LOOKBACK = 300.0  # seconds an instant selector looks back for a sample
Labels = frozenset  # of (name, value) pairs; "__name__" is the metric name


def duration(text: str) -> float:
    """Seconds in a Prometheus duration such as ``1h30m`` or ``5m``."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"bad duration {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def expand_values(text: str) -> list[float | None]:
    """promtool's expanding notation: ``0+60x3`` is 0 60 120 180, ``10x2`` is 10 10 10, ``_`` is missing."""
    out: list[float | None] = []
    for item in str(text).split():
        m = re.fullmatch(r"([-+]?[\d.e]+|_)(?:([-+][\d.e]+)?x(\d+))?", item)
        if not m:
            raise ValueError(f"bad series values {item!r}")
        start, step, times = m.groups()
        if start == "_":
            out += [None] * (1 + int(times or 0))
            continue
        for i in range(int(times or 0) + 1):
            out.append(float(start) + i * float(step or 0))
    return out


def parse_series(text: str) -> Labels:
    """``name{a="b"}`` as a label set."""
    m = re.fullmatch(r"\s*([a-zA-Z_:][\w:]*)?\s*(?:\{(.*)\})?\s*", text)
    if not m:
        raise ValueError(f"bad series {text!r}")
    labels = dict(re.findall(r'([a-zA-Z_]\w*)\s*=\s*"((?:[^"\\]|\\.)*)"', m.group(2) or ""))
    if m.group(1):
        labels["__name__"] = m.group(1)
    return frozenset(labels.items())


# ----- parsing ---------------------------------------------------------------------------------------------------
TOKEN = re.compile(r"""\s*(?:
    (?P<number>\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w:]))
  | (?P<duration>\[\d[\dmshdwy]*\])
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<op>==|!=|<=|>=|=~|!~|[-+*/%^<>=(){},])
  | (?P<ident>[a-zA-Z_:][\w:]*)
)""", re.X)
AGGREGATIONS = {"sum", "avg", "min", "max", "count"}
FUNCTIONS = {"increase", "rate", "abs", "clamp_min", "clamp_max"}
# binary operators by precedence, lowest first
LEVELS = [("or",), ("and", "unless"), ("==", "!=", "<=", "<", ">=", ">"), ("+", "-"), ("*", "/", "%"), ("^",)]
COMPARISONS = {"==", "!=", "<=", "<", ">=", ">"}


def tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot parse {text[pos:pos + 20]!r} in {text!r}")
        kind = m.lastgroup
        tokens.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return tokens


@dataclass
class Parser:
    tokens: list[tuple[str, str]]
    pos: int = 0

    def peek(self, offset: int = 0) -> tuple[str, str] | None:
        i = self.pos + offset
        return self.tokens[i] if i < len(self.tokens) else None

    def take(self, value: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (value is not None and tok[1] != value):
            raise ValueError(f"expected {value!r}, got {tok}")
        self.pos += 1
        return tok[1]

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek()[1] != ")":
            names.append(self.take())
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return tuple(names)

    def expression(self, level: int = 0):
        if level == len(LEVELS):
            return self.unary()
        left = self.expression(level + 1)
        while (tok := self.peek()) is not None and tok[1] in LEVELS[level]:
            op = self.take()
            modifiers = {"bool": False, "on": None, "ignoring": None}
            while (tok := self.peek()) is not None and tok[1] in ("bool", "on", "ignoring"):
                word = self.take()
                modifiers[word] = True if word == "bool" else self.label_list()
            right = self.expression(level + 1) if op != "^" else self.expression(level)
            left = ("binary", op, left, right, modifiers)
        return left

    def unary(self):
        if self.peek()[1] == "-":
            self.take("-")
            return ("binary", "*", ("number", -1.0), self.unary(), {"bool": False, "on": None, "ignoring": None})
        return self.primary()

    def primary(self):
        kind, value = self.peek()
        if kind == "number":
            self.take()
            return ("number", float(value))
        if value == "(":
            self.take("(")
            inner = self.expression()
            self.take(")")
            return inner
        if kind != "ident":
            raise ValueError(f"unexpected {value!r}")
        if value in AGGREGATIONS:
            self.take()
            grouping = None
            if self.peek()[1] in ("by", "without"):
                grouping = (self.take(), self.label_list())
            self.take("(")
            inner = self.expression()
            self.take(")")
            if grouping is None and self.peek() is not None and self.peek()[1] in ("by", "without"):
                grouping = (self.take(), self.label_list())
            return ("aggregate", value, grouping or ("by", ()), inner)
        if value in FUNCTIONS and self.peek(1) is not None and self.peek(1)[1] == "(":
            self.take()
            self.take("(")
            args = [self.expression()]
            while self.peek()[1] == ",":
                self.take(",")
                args.append(self.expression())
            self.take(")")
            return ("call", value, args)
        return self.selector()

    def selector(self):
        name = self.take()
        matchers = [("__name__", "=", name)]
        if self.peek() is not None and self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label, op, text = self.take(), self.take(), self.take()
                matchers.append((label, op, bytes(text[1:-1], "utf-8").decode("unicode_escape")))
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        if self.peek() is not None and self.peek()[0] == "duration":
            return ("range", matchers, duration(self.take()[1:-1]))
        return ("instant", matchers)


def parse(text: str):
    parser = Parser(tokenize(text))
    tree = parser.expression()
    if parser.peek() is not None:
        raise ValueError(f"unexpected {parser.peek()} in {text!r}")
    return tree


# ----- evaluation -------------------------------------------------------------------------------------------------
def matches(labels: Labels, matchers) -> bool:
    have = dict(labels)
    for name, op, value in matchers:
        got = have.get(name, "")
        ok = {"=": got == value, "!=": got != value, "=~": re.fullmatch(value, got) is not None,
              "!~": re.fullmatch(value, got) is None}[op]
        if not ok:
            return False
    return True


def without_name(labels: Labels) -> Labels:
    return frozenset((k, v) for k, v in labels if k != "__name__")


def extrapolated_increase(samples: list[tuple[float, float]], start: float, end: float, per_second: bool):
    """Prometheus' ``extrapolatedRate`` for a counter over (start, end]."""
    if len(samples) < 2:
        return None
    value, previous = 0.0, samples[0][1]
    for _, v in samples[1:]:
        value += v - previous if v >= previous else v  # a counter reset starts again from zero
        previous = v
    first_t, first_v = samples[0]
    last_t = samples[-1][0]
    sampled = last_t - first_t
    average = sampled / (len(samples) - 1)
    to_start, to_end = first_t - start, end - last_t
    threshold = average * 1.1
    if to_start >= threshold:
        to_start = average / 2
    if value > 0 and first_v >= 0:
        to_start = min(to_start, sampled * (first_v / value))  # a counter does not extrapolate below zero
    if to_end >= threshold:
        to_end = average / 2
    value *= (sampled + to_start + to_end) / sampled
    return value / (end - start) if per_second else value


def compare(op: str, a: float, b: float) -> bool:
    return {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]


def arithmetic(op: str, a: float, b: float) -> float:
    try:
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            return a / b
        if op == "%":
            return math.fmod(a, b)
        if op == "^":
            return a ** b
    except ZeroDivisionError:
        if op == "%" or a == 0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    raise ValueError(op)


@dataclass
class Database:
    """Samples by series: {labels: [(t seconds, value), ...]} in time order."""

    series: dict[Labels, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, labels: Labels, t: float, value: float) -> None:
        self.series.setdefault(labels, []).append((t, value))

    def evaluate(self, text_or_tree, t: float):
        tree = parse(text_or_tree) if isinstance(text_or_tree, str) else text_or_tree
        return self._eval(tree, t)

    def _eval(self, node, t):
        kind = node[0]
        if kind == "number":
            return node[1]
        if kind == "instant":
            out = {}
            for labels, samples in self.series.items():
                if matches(labels, node[1]):
                    recent = [v for ts, v in samples if t - LOOKBACK < ts <= t]
                    if recent:
                        out[labels] = recent[-1]
            return out
        if kind == "range":
            raise ValueError("a range vector must be a function argument")
        if kind == "call":
            return self._call(node[1], node[2], t)
        if kind == "aggregate":
            return self._aggregate(node[1], node[2], self._eval(node[3], t))
        if kind == "binary":
            return self._binary(node[1], self._eval(node[2], t), self._eval(node[3], t), node[4])
        raise ValueError(kind)

    def _call(self, name, args, t):
        if name in ("increase", "rate"):
            (arg,) = args
            if arg[0] != "range":
                raise ValueError(f"{name} takes a range vector")
            _, matchers, width = arg
            out = {}
            for labels, samples in self.series.items():
                if matches(labels, matchers):
                    window = [(ts, v) for ts, v in samples if t - width < ts <= t]  # left-open, as Prometheus 3
                    value = extrapolated_increase(window, t - width, t, per_second=name == "rate")
                    if value is not None:
                        out[without_name(labels)] = value
            return out
        vector = self._eval(args[0], t)
        if name == "abs":
            return {k: abs(v) for k, v in vector.items()}
        bound = self._eval(args[1], t)
        pick = max if name == "clamp_min" else min
        return {without_name(k): pick(v, bound) for k, v in vector.items()}

    @staticmethod
    def _aggregate(op, grouping, vector):
        mode, names = grouping
        groups: dict[Labels, list[float]] = {}
        for labels, value in vector.items():
            if mode == "by":
                key = frozenset((k, v) for k, v in labels if k in names)
            else:
                key = frozenset((k, v) for k, v in labels if k not in names and k != "__name__")
            groups.setdefault(key, []).append(value)
        reduce = {"sum": sum, "min": min, "max": max, "count": len, "avg": lambda xs: sum(xs) / len(xs)}[op]
        return {k: float(reduce(vs)) for k, vs in groups.items()}

    @staticmethod
    def _binary(op, left, right, modifiers):
        keep_bool = modifiers["bool"]
        if not isinstance(left, dict) and not isinstance(right, dict):
            return float(compare(op, left, right)) if op in COMPARISONS else arithmetic(op, left, right)
        if not isinstance(left, dict) or not isinstance(right, dict):  # vector and scalar
            vector, scalar, vector_left = (left, right, True) if isinstance(left, dict) else (right, left, False)
            out = {}
            for labels, v in vector.items():
                a, b = (v, scalar) if vector_left else (scalar, v)
                if op in COMPARISONS:
                    hit = compare(op, a, b)
                    if keep_bool:
                        out[without_name(labels)] = float(hit)
                    elif hit:
                        out[labels] = v
                else:
                    out[without_name(labels)] = arithmetic(op, a, b)
            return out

        def signature(labels: Labels) -> Labels:
            if modifiers["on"] is not None:
                return frozenset((k, v) for k, v in labels if k in modifiers["on"])
            ignored = set(modifiers["ignoring"] or ()) | {"__name__"}
            return frozenset((k, v) for k, v in labels if k not in ignored)

        right_by_signature: dict[Labels, list[tuple[Labels, float]]] = {}
        for labels, v in right.items():
            right_by_signature.setdefault(signature(labels), []).append((labels, v))
        if op == "and":
            return {k: v for k, v in left.items() if signature(k) in right_by_signature}
        if op == "unless":
            return {k: v for k, v in left.items() if signature(k) not in right_by_signature}
        if op == "or":
            left_signatures = {signature(k) for k in left}
            return {**left, **{k: v for k, v in right.items() if signature(k) not in left_signatures}}
        out = {}
        for labels, a in left.items():
            found = right_by_signature.get(signature(labels), [])
            if len(found) > 1:
                raise ValueError(f"many-to-many matching for {op} (group_left/right is not supported)")
            if not found:
                continue
            b = found[0][1]
            result = labels if op in COMPARISONS and not keep_bool else without_name(labels)
            if modifiers["on"] is not None:  # one-to-one matching keeps only the ``on`` labels (no name)
                result = frozenset((k, v) for k, v in result if k in modifiers["on"])
            elif modifiers["ignoring"] is not None:
                result = frozenset((k, v) for k, v in result if k not in modifiers["ignoring"])
            if op in COMPARISONS:
                hit = compare(op, a, b)
                if keep_bool:
                    out[result] = float(hit)
                elif hit:
                    out[result] = a
            else:
                out[result] = arithmetic(op, a, b)
        return out


# ----- templates and rules -----------------------------------------------------------------------------------------
def humanize(v: float) -> str:
    if v == 0 or math.isnan(v) or math.isinf(v):
        return f"{v:.4g}"
    prefixes, scale = ("", "k", "M", "G", "T", "P", "E", "Z", "Y"), 1000.0
    if abs(v) < 1:
        prefixes, scale = ("", "m", "u", "n", "p", "f", "a", "z", "y"), 1 / 1000.0
    i = 0
    while i + 1 < len(prefixes) and (abs(v) >= 1000 if scale > 1 else abs(v) < 1):
        v, i = v / scale, i + 1
    return f"{v:.4g}{prefixes[i]}"


def render(template: str, labels: dict[str, str], value: float) -> str:
    """The annotation template subset the rules use: ``$labels.x``, ``$value`` piped through ``humanize`` or
    ``humanizePercentage``."""
    def one(m: re.Match) -> str:
        parts = [p.strip() for p in m.group(1).split("|")]
        head, filters = parts[0], parts[1:]
        if head.startswith("$labels."):
            if filters:
                raise ValueError(f"unsupported template {m.group(0)!r}")
            return labels.get(head[len("$labels."):], "")
        if head != "$value":
            raise ValueError(f"unsupported template {m.group(0)!r}")
        if not filters:
            return f"{value:g}"
        if filters == ["humanizePercentage"]:
            return f"{value * 100:.4g}%"
        if filters == ["humanize"]:
            return humanize(value)
        raise ValueError(f"unsupported template {m.group(0)!r}")

    return re.sub(r"\{\{\s*(.*?)\s*\}\}", one, template)


@dataclass
class RuleEngine:
    """Rule groups evaluated in order at every evaluation step, recording rules writing back into ``db``."""

    groups: list[dict]
    db: Database
    active: dict[tuple[str, Labels], float] = field(default_factory=dict)  # alert -> since when it holds

    def step(self, t: float) -> dict[str, list[dict]]:
        """Evaluate every rule at ``t``; the firing alerts by name, each {labels, annotations}."""
        firing: dict[str, list[dict]] = {}
        for group in self.groups:
            for rule in group["rules"]:
                vector = self.db.evaluate(rule["expr"], t)
                if not isinstance(vector, dict):
                    vector = {frozenset(): vector}
                if "record" in rule:
                    for labels, value in vector.items():
                        name = ("__name__", rule["record"])
                        self.db.add(without_name(labels) | {name} | frozenset(rule.get("labels", {}).items()), t, value)
                    continue
                alert, hold = rule["alert"], duration(str(rule.get("for", "0s"))) if rule.get("for") else 0.0
                now = set()
                for labels, value in vector.items():
                    full = dict(without_name(labels)) | {k: str(v) for k, v in rule.get("labels", {}).items()}
                    key = (alert, frozenset(full.items()))
                    now.add(key)
                    since = self.active.setdefault(key, t)
                    if t - since >= hold:
                        full["alertname"] = alert
                        annotations = {k: render(str(v), dict(without_name(labels)), value)
                                       for k, v in rule.get("annotations", {}).items()}
                        firing.setdefault(alert, []).append({"labels": full, "annotations": annotations})
                for key in [k for k in self.active if k[0] == alert and k not in now]:
                    del self.active[key]
        return firing


def run_unit_tests(test_file: Path) -> list[str]:
    """Run a promtool rule unit-test file (input_series, alert_rule_test, promql_expr_test); the failures, as
    lines (empty when everything passed)."""
    spec = yaml.safe_load(test_file.read_text())
    groups = []
    for rule_file in spec["rule_files"]:
        groups += yaml.safe_load((test_file.parent / rule_file).read_text())["groups"]
    every = duration(str(spec.get("evaluation_interval", "1m")))
    failures = []
    for n, test in enumerate(spec["tests"]):
        def replay(until: float):
            """The input series, then every rule evaluated from 0 to ``until``: (database, firing at ``until``)."""
            db = Database()
            interval = duration(str(test.get("interval", "1m")))
            for item in test.get("input_series", []):
                labels = parse_series(item["series"])
                for i, value in enumerate(expand_values(item["values"])):
                    if value is not None:
                        db.add(labels, i * interval, value)
            engine, firing, steps = RuleEngine(groups, db), {}, 0
            while steps * every <= until:
                firing = engine.step(steps * every)
                steps += 1
            return db, firing

        for check in test.get("alert_rule_test", []):
            _, firing = replay(duration(str(check["eval_time"])))
            want = sorted(({"labels": {**c.get("exp_labels", {}), "alertname": check["alertname"]},
                            "annotations": c.get("exp_annotations", {})} for c in check.get("exp_alerts") or []),
                          key=repr)
            got = sorted(firing.get(check["alertname"], []), key=repr)
            if got != want:
                failures.append(f"test {n} at {check['eval_time']}: {check['alertname']}: want {want}, got {got}")
        for check in test.get("promql_expr_test", []):
            until = duration(str(check["eval_time"]))
            value = replay(until)[0].evaluate(check["expr"], until)
            got = value if isinstance(value, dict) else {frozenset(): value}
            want = {parse_series(s.get("labels", "{}")): float(s["value"]) for s in check.get("exp_samples") or []}
            if set(got) != set(want) or any(not math.isclose(got[k], want[k], rel_tol=1e-9, abs_tol=1e-12)
                                             for k in want):
                failures.append(f"test {n}: {check['expr']} at {check['eval_time']}: want {want}, got {got}")
    return failures
