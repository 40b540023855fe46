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
