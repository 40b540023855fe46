"""The architecture as a test: the core never imports Dagster, production never imports the lab.

Every module is parsed (imports inside functions included, and ``importlib.import_module("...")``
with a literal name); the lab sits on top and may import anything.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "prodrl_pipelines"
DAGSTER_LAYER = ("assets", "resources", "ops", "sensors.py", "definitions.py", "lab")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.add(node.args[0].value)
    return out


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(PKG), _imports(path)


def _hits(imports: set[str], root: str) -> list[str]:
    return sorted(m for m in imports if m == root or m.startswith(root + "."))


def test_no_production_module_imports_the_lab():
    bad = {str(rel): _hits(imps, "prodrl_pipelines.lab") for rel, imps in _modules()
           if rel.parts[0] != "lab" and _hits(imps, "prodrl_pipelines.lab")}
    assert not bad, f"production modules importing the lab (use a plug point instead): {bad}"


def test_only_the_dagster_layer_imports_dagster():
    bad = {str(rel): _hits(imps, "dagster") + _hits(imps, "dagster_pipes") for rel, imps in _modules()
           if rel.parts[0] not in DAGSTER_LAYER and (_hits(imps, "dagster") or _hits(imps, "dagster_pipes"))}
    assert not bad, f"core modules importing Dagster: {bad}"


def test_the_scan_sees_lazy_imports(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from prodrl_pipelines.lab import tasks\n    import importlib\n"
                 "    importlib.import_module('dagster')\n")
    assert _hits(_imports(p), "prodrl_pipelines.lab") and _hits(_imports(p), "dagster")


def test_the_lab_plugs_in_through_entry_points():
    from importlib.metadata import entry_points

    groups = ("prodrl_pipelines.eval_suites", "prodrl_pipelines.model_sources", "prodrl_pipelines.definitions",
              "prodrl_pipelines.cli")
    for g in groups:
        assert any(ep.value.startswith("prodrl_pipelines.lab.") for ep in entry_points(group=g)), g


def test_quant_depends_on_neither_engines_nor_training():
    bad = {str(rel): _hits(imps, "prodrl_pipelines.engines") + _hits(imps, "prodrl_pipelines.rl")
           for rel, imps in _modules() if rel.parts[0] == "quant"
           and (_hits(imps, "prodrl_pipelines.engines") or _hits(imps, "prodrl_pipelines.rl"))}
    assert not bad, bad


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["prodrl_pipelines", *parts])


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (lazy imports included; ``from pkg import mod``
    resolved to the module; a package's ``__init__`` counts as the package)."""
    mods = {_module_name(rel): imps for rel, imps in _modules()}
    graph = {}
    for m, imps in mods.items():
        deps = set()
        for name in imps:
            if any(i.startswith(name + ".") and i in mods for i in imps):
                continue  # `from pkg import mod`: an edge to the module, not to the package
            while name and name not in mods:  # `pkg.mod.attr` -> `pkg.mod`
                name = name.rpartition(".")[0]
            if name and name != m and name != "prodrl_pipelines":
                deps.add(name)
        graph[m] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert not _circles(_import_graph()), _circles(_import_graph())


def test_the_circle_check_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The floors, lowest first: a module imports only its own floor and the ones below. A package's
# modules share its floor unless a module is named on its own (``config.settings`` gathers the
# configurations of the packages below it; the environment and preflight checks sit at the bottom).
FLOORS = [
    ("storage", "config.environment", "config.preflight"),
    ("rl", "quant", "trajectories", "engines", "evaluation", "rewards", "recorder", "deploy_targets"),
    ("harnesses",),  # each harness is a suite and a reward source: above both, found by entry point
    ("config.settings",),
    ("loop",),
    ("stack", "cli"),
    ("assets", "resources", "ops", "sensors", "definitions"),
    ("lab",),
]


def _floor(module: str) -> int | None:
    rel = module.removeprefix("prodrl_pipelines.")
    best = None
    for i, names in enumerate(FLOORS):
        for name in names:
            if (rel == name or rel.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    return best[0] if best else None


def test_each_harness_is_one_module_registered_as_a_suite_and_a_reward_source():
    from importlib.metadata import entry_points

    def shipped(group):
        return {ep.name: ep.value.split(":")[0] for ep in entry_points(group=group)
                if ep.value.startswith("prodrl_pipelines.harnesses.")}

    suites, sources = shipped("prodrl_pipelines.eval_suites"), shipped("prodrl_pipelines.reward_sources")
    assert suites == sources and set(suites) == {"command", "inspect", "verifiers"}, (suites, sources)
    modules = {f"prodrl_pipelines.harnesses.{p.stem}" for p in (PKG / "harnesses").glob("*.py")
               if p.stem not in ("__init__", "verifiers_bridge")}  # the bridge runs in verifiers' own Python
    assert set(suites.values()) == modules


def test_lower_floors_never_import_upper_ones():
    bad = {}
    for m, deps in _import_graph().items():
        fm = _floor(m)
        if fm is None:
            continue
        up = sorted(d for d in deps if (_floor(d) or 0) > fm)
        if up:
            bad[m] = up
    assert not bad, f"modules importing a floor above their own: {bad}"


def test_no_private_names_cross_modules():
    bad = {}
    for rel, imps in _modules():
        private = sorted(i for i in imps if i.startswith("prodrl_pipelines.")
                         and i.rpartition(".")[2].startswith("_") and not i.rpartition(".")[2].startswith("__"))
        if private:
            bad[str(rel)] = private
    assert not bad, f"private names imported across modules: {bad}"


def test_ray_is_imported_only_where_a_step_runs_on_ray():
    """``cluster: local`` (the default) never loads Ray: outside ``ops/`` (the Dagster glue and the jobs
    that run on the cluster) Ray is imported inside functions only, never at module level."""
    bad = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "ops":
            continue
        top = ast.parse(path.read_text(), str(path)).body
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
        hits = [m for m in names if m.split(".")[0] in ("ray", "dagster_ray")]
        if hits:
            bad[str(rel)] = hits
    assert not bad, f"modules importing Ray at module level: {bad}"


def test_the_control_plane_loads_without_the_trainers_libraries():
    """What every Dagster code server and run worker loads (the definitions, settings validated with a
    recipe's correction, baseline and deploy target by name) and the CLI's entry point import neither
    torch nor transformers nor matplotlib: those come with the step that trains, serves or plots."""
    import subprocess
    import sys

    code = ("import sys, prodrl_pipelines.definitions, prodrl_pipelines.cli.main\n"
            "from prodrl_pipelines.config.settings import Settings\n"
            "Settings(recipe={'correction': 'cispo', 'baseline': 'task_group'}, deploy={'target': 'prodrl-serve'})\n"
            "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PKG.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
