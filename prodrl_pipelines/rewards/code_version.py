"""The version of a scorer: a hash of what it runs, so that editing a rubric makes earlier grades stale.

* A grader written in Python (``loaded_code_hash``): the source of its module and of every module of
  its code base it imports, transitively (found by reading the imports; each is the module this
  process loaded, so a Ray worker computes the driver's hash; the standard library and installed
  packages are left to their versions).
* A command (``files_hash``): the files its command line names (a script, a rubric, a config), and
  for a Python script the modules it imports from beside it, read the same way.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import sys
import sysconfig
import weakref
from pathlib import Path
from typing import Callable, Iterable

from prodrl_pipelines.rewards.outcome import short_hash

# grader -> the hash of its code when this process first built a source on it: right after the import
# in practice (``GraderSource`` imports it); a new function object (a re-import) is hashed anew
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MAX_MODULES = 500  # a scorer importing more of its code base than this is hashed on the first ones
MAX_FILE_BYTES = 64 << 20  # a larger file named on a command line is known by its size and mtime


def _installed_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return [Path(r).resolve() for r in roots]


def _is_installed(path: Path, installed: list[Path]) -> bool:
    return any(path.is_relative_to(r) for r in installed)


def _resolve(name: str, roots: Iterable[Path]) -> Path | None:
    parts = name.split(".")
    for root in roots:
        for cand in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
            if cand.is_file():
                return cand
    return None


def _imports(path: Path, text: str, package: str) -> list[str]:
    """Module names ``path`` imports (with each ``from a import b`` also as ``a.b``: b may be a module)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".") if package else []
                up = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                base = ".".join(p for p in [*up, base] if p)
            if base:
                out.append(base)
            out += [f"{base}.{a.name}" if base else a.name for a in node.names if a.name != "*"]
    return out


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _loaded_file(name: str) -> Path | None:
    mod = sys.modules.get(name)
    file = getattr(mod, "__file__", None) if mod is not None else None
    return Path(file) if file and file.endswith(".py") else None


def code_files(start: Path, root: Path, first_text: str | None = None,
               loaded: bool = True) -> list[tuple[str, str]]:
    """(module name, source) of ``start`` (under ``root``) and of the modules it imports from its code
    base, transitively, sorted by name. ``first_text``: ``start``'s source as loaded, if known.
    ``loaded``: ``start`` was imported by this process, so each import is the module this process
    loaded (the same on any machine that runs the same code, whatever its ``sys.path``); else (a
    script another interpreter runs) an import is looked for under ``root`` only."""
    installed = _installed_roots()
    root = root.resolve()
    seen: dict[Path, tuple[str, str]] = {}
    start = start.resolve()
    todo = [(start, _module_name(start, root) if start.is_relative_to(root) else start.stem, first_text)]
    while todo and len(seen) < MAX_MODULES:
        path, name, text = todo.pop()
        if path in seen or _is_installed(path, installed):
            continue
        if text is None:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
        seen[path] = (name, text)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]  # their __init__ runs
        for imported in parents + _imports(path, text, package):
            found = (_loaded_file(imported) if loaded else None) or _resolve(imported, [root])
            if found is not None and found.resolve() not in seen:
                todo.append((found.resolve(), imported, None))
    return sorted(seen.values())


def _module_root(module) -> Path | None:
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = Path(file).resolve()
    depth = module.__name__.count(".") + (1 if path.name == "__init__.py" else 0)
    return path.parents[depth] if depth < len(path.parents) else path.parent


def _source_hash(fn: Callable) -> str:
    module = inspect.getmodule(fn)
    root = _module_root(module) if module is not None else None
    try:
        code = inspect.getsource(module) if module is not None else inspect.getsource(fn)
    except (OSError, TypeError):
        return short_hash(getattr(getattr(fn, "__code__", None), "co_code", b"").hex())
    if root is None:
        return short_hash(code)
    files = code_files(Path(module.__file__), root, first_text=code)
    return short_hash(*[f"{name}\n{text}" for name, text in files])


def loaded_code_hash(fn: Callable) -> str:
    """A hash of the code ``fn`` runs as this process loaded it (its module and the modules of its code
    base that it imports): the files may have been edited since the import, and this process still
    runs the imported code."""
    try:
        return _LOADED[fn]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: hashed each time
        return _source_hash(fn)
    _LOADED[fn] = h = _source_hash(fn)
    return h


def files_hash(argv: list[str]) -> str:
    """A hash of the files a command line names (``--rubric=r.md`` included) and, for a Python script,
    of the modules it imports from beside it: what the command runs, beyond its words."""
    h = hashlib.sha256()
    for arg in argv:
        for piece in dict.fromkeys([arg, arg.partition("=")[2]]):
            p = Path(piece) if piece else None
            if p is None or not p.is_file():
                continue
            st = p.stat()
            h.update(f"\0{piece}\0".encode())
            if st.st_size > MAX_FILE_BYTES:
                h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
                continue
            if p.suffix == ".py":
                for name, text in code_files(p, p.resolve().parent, loaded=False):
                    h.update(f"\0{name}\0{text}".encode())
            else:
                h.update(p.read_bytes())
    return h.hexdigest()[:12]
