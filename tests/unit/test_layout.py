"""The house rules that code can check: the inference path (engine, loop, API, CLI, every built-in stage)
never imports training, data-building or benchmark code; no folder of the checkout shadows another package."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mtpflow

COMMANDS = ("bench", "train_heads", "train_domain", "tune")  # python -m mtpflow.<name>: entry points into mtpflow.tools


def test_inference_path_imports_no_training_or_bench_code():
    code = (
        "import importlib, pkgutil, sys\n"
        "import mtpflow.engine, mtpflow.api, mtpflow.cli, mtpflow.serve.app, mtpflow.strategies\n"
        "for m in pkgutil.iter_modules(mtpflow.strategies.__path__):\n"
        "    importlib.import_module('mtpflow.strategies.' + m.name)\n"
        f"print(sorted(m for m in sys.modules if m.startswith('mtpflow.tools') or m in "
        f"{tuple('mtpflow.' + c for c in COMMANDS)!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_tools_live_in_their_own_subpackage():
    """Benchmarks, training and data building live in ``mtpflow.tools``; the short command modules only
    forward to it (no code of their own to drift)."""
    root = Path(mtpflow.__file__).parent
    for name in COMMANDS:
        code = [line for line in (root / f"{name}.py").read_text().splitlines()
                if line.strip() and not line.startswith(('"""', "import sys", "if __name__", "    sys.exit"))]
        assert code == [f"from mtpflow.tools.{name} import main"], (name, code)
        assert (root / "tools" / f"{name}.py").exists()
    top_level = {p.stem for p in root.glob("*.py")}
    assert not top_level & {"bench_batch", "bench_serve", "head_data", "domain_prompts"}


def test_the_plugin_machinery_lives_in_one_package():
    """Hook specs, third-party plugins (entry points), the manager, the core defaults and the listing are
    ``mtpflow.plugins``; the top-level modules they once were are gone. ``mtpflow/hookspecs.py`` stays only as the
    stable import path of the markers for plugins written against it: re-exports, no hook of its own."""
    import ast

    import mtpflow.hookspecs
    import mtpflow.plugins

    root = Path(mtpflow.__file__).parent
    assert {p.name for p in (root / "plugins").glob("*.py")} >= {"__init__.py", "hookspecs.py", "entry_points.py",
                                                                 "manager.py", "defaults.py", "__main__.py"}
    top_level = {p.stem for p in root.glob("*.py")}
    assert not top_level & {"plugins", "plugin_listing", "plugin_hookspecs", "runplugins", "thirdparty", "defaults"}
    alias = ast.parse((root / "hookspecs.py").read_text()).body
    kinds = [type(n).__name__ for n in alias]
    assert kinds == ["Expr", "ImportFrom", "Assign"], kinds  # docstring, the re-export, __all__
    assert alias[1].module == "mtpflow.plugins"
    for name in ("hookimpl", "hookspec", "PROJECT"):
        assert getattr(mtpflow.hookspecs, name) is getattr(mtpflow.plugins, name)


def test_no_top_level_folder_of_the_checkout_is_a_python_package():
    """``python -m ...`` run from the checkout puts it first on ``sys.path``: a top-level ``kernels/`` with an
    ``__init__.py`` was imported in place of the PyPI ``kernels`` that transformers (5.25) imports at start, and
    every model load failed. mtpflow's own packages live under ``mtpflow/``; plugins and tests have their own."""
    checkout = Path(mtpflow.__file__).resolve().parent.parent
    packages = sorted(p.parent.name for p in checkout.glob("*/__init__.py"))
    assert packages == ["mtpflow"], packages


def test_transformers_imports_from_the_checkout_as_working_directory():
    checkout = Path(mtpflow.__file__).resolve().parent.parent
    code = "import transformers.activations, mtpflow.kernels; print(mtpflow.kernels.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "mtpflow.kernels"


# ----- the import graph is a tree ------------------------------------------------------------------------------
# the native machinery (the C kernel, its mirror, its references, the certified head, OpenMP, the native backends):
# only mtpflow.backends imports it
NATIVE = "mtpflow.backends.native"
# what the kernels and the host-measurement cache may import of mtpflow: nothing above them
LEAVES = {"mtpflow.kernels": ("mtpflow.kernels", "mtpflow.errors", "mtpflow.host"), "mtpflow.host": ("mtpflow.errors", "mtpflow.machine"),
          "mtpflow.machine": ()}


def import_graph() -> dict[str, set[str]]:
    """{module: the mtpflow modules it imports}, imports inside functions included (those under
    ``if __name__ == "__main__":`` run only as a script and are left out)."""
    import ast

    root = Path(mtpflow.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        script = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        skipped = {id(n) for block in script for n in ast.walk(block)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("mtpflow") and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back_through_others():
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_imports_inside_functions():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "mtpflow.backends.execution" in graph["mtpflow.config"]  # ``validate`` imports it inside the function


def test_kernels_and_the_host_cache_import_nothing_above_them():
    for name, deps in import_graph().items():
        for leaf, allowed in LEAVES.items():
            if name == leaf or name.startswith(leaf + "."):
                assert all(d.startswith(allowed) for d in deps), (name, sorted(deps))


def test_only_the_backends_reach_the_native_machinery():
    graph = import_graph()
    assert any(m.startswith(NATIVE + ".") for m in graph)  # the package the rule is about exists
    for name, deps in graph.items():
        if name.startswith("mtpflow.backends"):
            continue
        native = sorted(d for d in deps if d == NATIVE or d.startswith(NATIVE + "."))
        assert not native, (name, native)


def test_the_kernels_package_holds_only_the_draft_tree_ops():
    """``mtpflow.kernels``: torch and Triton ops the strategies call (PFS, tree masks, n-grams, accept); no C
    source, no model machinery."""
    root = Path(mtpflow.__file__).parent / "kernels"
    assert not list(root.glob("*.c")) and not list(root.glob("*.h"))
    for gone in ("native_linear", "native_reference", "int8_reference", "certified_head", "openmp"):
        assert not (root / f"{gone}.py").exists(), gone


def imported_by(graph: dict[str, set[str]], name: str) -> set[str]:
    """Every mtpflow module ``name`` imports, directly or through what it imports."""
    seen, todo = set(), [name]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_config_reads_plugins_and_no_plugin_module_reads_config():
    """The config asks the plugins for their strategy folders; no module of ``mtpflow.plugins`` imports the
    config (nor anything that does), and the config builds no stage (no ``mtpflow.strategies`` module)."""
    graph = import_graph()
    plugin_modules = [m for m in graph if m == "mtpflow.plugins" or m.startswith("mtpflow.plugins.")]
    assert len(plugin_modules) >= 5, plugin_modules
    for name in plugin_modules:
        assert "mtpflow.config" not in imported_by(graph, name), name
    assert any(d.startswith("mtpflow.plugins") for d in graph["mtpflow.config"])
    assert not [d for d in graph["mtpflow.config"] if d.startswith("mtpflow.strategies")]


def test_checking_a_request_needs_no_forward_backend_or_strategy():
    graph = import_graph()
    reached = imported_by(graph, "mtpflow.request")
    below = sorted(m for m in reached if m == "mtpflow.forward" or m.startswith(("mtpflow.backends",
                                                                                   "mtpflow.strategies")))
    assert below == [], below
    assert "mtpflow.request" in graph["mtpflow.engine"]


def test_the_reachability_checks_see_what_they_guard():
    graph = {"mtpflow.request": {"mtpflow.errors"}, "mtpflow.errors": {"mtpflow.forward"}, "mtpflow.forward": set()}
    assert imported_by(graph, "mtpflow.request") == {"mtpflow.errors", "mtpflow.forward"}


# ----- floors and the walk of a request ----------------------------------------------------------------------------

def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 for a module that imports no other mtpflow module (the ground), else one above the
    highest module it imports. The import graph has no cycles, so every floor is defined."""
    import functools

    @functools.lru_cache(maxsize=None)
    def floor(module: str) -> int:
        return 1 + max((floor(d) for d in graph[module]), default=0)

    return {m: floor(m) for m in graph}


def test_at_most_12_floors_from_main_to_the_ground():
    graph = import_graph()
    floor = floors(graph)
    for entry in ("mtpflow.__main__", "mtpflow.serve.__main__", "mtpflow.playground.__main__"):
        assert floor[entry] <= 12, (entry, floor[entry])
    assert floor["mtpflow.errors"] == 1


def walk_of_submit(engine, request, graph: dict[str, set[str]], floor: dict[str, int]) -> list[str]:
    """The mtpflow modules a call of ``engine.submit(request)`` goes into, in order: a call from one module into
    another records the callee's module (repeats in a row kept once). The ground (floor-1 modules: errors, types,
    ...) is left out, since every floor calls it; a strategy's own stage objects are the strategy's business: what
    their construction calls is left out, and the stage modules it enters in a row are one step."""
    import sys as _sys

    walk: list[str] = []

    def inside_a_stage(frame) -> bool:
        frame = frame.f_back
        while frame is not None:
            if frame.f_globals.get("__name__", "").startswith("mtpflow.strategies."):
                return True
            frame = frame.f_back
        return False

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        if module not in graph or module == caller or floor[module] == 1 or inside_a_stage(frame):
            return
        stage = module.startswith("mtpflow.strategies.")
        if not walk or (walk[-1] != module and not (stage and walk[-1].startswith("mtpflow.strategies."))):
            walk.append(module)  # the stage modules one strategy's construction enters count as one step

    _sys.setprofile(profile)
    try:
        handle = engine.submit(request)
    finally:
        _sys.setprofile(None)
    handle.result()
    return walk


def climbs(walk: list[str], floor: dict[str, int]) -> list[tuple[str, str]]:
    """The steps of a walk that go into a module on a higher floor (``floor``: ``floors``) than the one before."""
    return [(a, b) for a, b in zip(walk, walk[1:]) if floor[b] > floor[a]]


@pytest.mark.parametrize("strategy", ["baseline", "pld", "mtp"])
def test_a_request_climbs_back_up_at_most_once(strategy):
    """From ``Engine.submit`` a request goes down: the request checked (request), its stage objects built
    (plugins.manager, the strategy), named by their owners (plugins.entry_points), registered against the specs
    (plugins.hookspecs); the one step up is from the request's checks to the plugin manager."""
    from helpers import make_pipeline, tiny_loaded

    from mtpflow.request import Request

    engine = make_pipeline(tiny_loaded(seed=0), strategy, "max_new_tokens=2", "trace=off").engine
    try:
        engine.generate(Request(prompt_ids=[5, 6, 7]))  # the strategy composed, caches warm
        request = Request(prompt_ids=[5, 6, 7, 8])
        graph = import_graph()
        floor = floors(graph)
        walk = walk_of_submit(engine, request, graph, floor)
    finally:
        engine.close()
    assert walk[0] == "mtpflow.engine" and "mtpflow.plugins.manager" in walk, walk
    up = climbs(walk, floor)
    assert len(up) <= 1, (walk, up)


def test_the_walk_counts_what_it_should():
    floor = {"mtpflow.engine": 8, "mtpflow.request": 2, "mtpflow.plugins.manager": 7, "mtpflow.plugins.hookspecs": 2}
    assert climbs(["mtpflow.engine", "mtpflow.request", "mtpflow.plugins.manager"], floor) == \
        [("mtpflow.request", "mtpflow.plugins.manager")]
    assert climbs(["mtpflow.engine", "mtpflow.plugins.manager", "mtpflow.plugins.hookspecs"], floor) == []
