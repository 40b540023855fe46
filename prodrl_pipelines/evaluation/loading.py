"""Resolve the ``eval.suite`` setting into a suite, failing at load time with the file and line.

``eval.suite`` is one of:

- ``NAME`` or ``NAME:ARG`` where NAME is a suite source, an entry point of group
  ``prodrl_pipelines.eval_suites``: the harnesses this project ships (``prodrl_pipelines.harnesses``:
  ``inspect:pkg.module:task`` an inspect-ai task, ``verifiers:<taskset>`` a verifiers taskset,
  ``command:<command line>`` any harness that prints per-task rewards), and plug-ins (the lab
  registers ``lab``: ``lab`` = the lab task of the settings, ``lab:arithmetic``, ``lab:chess``); the
  source is called as ``factory(ARG, settings)``;
- a JSONL file, local or ``s3://bucket/key.jsonl`` (see ``jsonl_suite``), with ``eval.reward_fn``
  naming the reward function ``package.module:function``;
- ``package.module:Suite``: a class (instantiated without arguments) or an object implementing
  ``suite.EvalSuite``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from pathlib import Path

from prodrl_pipelines.evaluation.suite import SuiteError, missing_members

SUITE_GROUP = "prodrl_pipelines.eval_suites"

def registered_sources(group: str = SUITE_GROUP) -> dict:
    """Suite sources by name (entry points, loaded when used)."""
    return {ep.name: ep for ep in entry_points(group=group)}


def import_object(path: str, setting: str):
    """``package.module:attr`` -> the object; a clear error naming ``setting`` otherwise."""
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise SuiteError(f"{setting}={path!r}: expected 'package.module:name'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise SuiteError(f"{setting}={path!r}: cannot import module {mod_name!r} ({e})") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SuiteError(f"{setting}={path!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def read_text(uri: str, s3_endpoint_url: str | None = None) -> str:
    """A local file or an ``s3://bucket/key`` object as text."""
    if uri.startswith("s3://"):
        from prodrl_pipelines.storage.s3 import S3BlobStore

        bucket, _, key = uri[len("s3://"):].partition("/")
        if not bucket or not key:
            raise SuiteError(f"eval.suite={uri!r}: expected s3://bucket/key.jsonl")
        store = S3BlobStore(bucket, "", endpoint_url=s3_endpoint_url or None)
        if not store.exists(key):
            raise SuiteError(f"eval.suite={uri!r}: no such object")
        return store.get_bytes(key).decode("utf-8")
    p = Path(uri).expanduser()
    if not p.is_file():
        raise SuiteError(f"eval.suite={uri!r}: no such file ({p.resolve()})")
    return p.read_text(encoding="utf-8")


def load_suite(spec: str, reward_fn: str = "", settings=None, s3_endpoint_url: str | None = None):
    """The suite named by ``spec`` (see the module doc), checked against ``settings`` if given."""
    spec = (spec or "").strip()
    if not spec:
        raise SuiteError("eval.suite is empty: name a suite (e.g. 'lab', 'heldout.jsonl', 'mypkg.evals:Suite')")
    head, _, arg = spec.partition(":")
    sources = registered_sources()
    if head in sources:
        suite = sources[head].load()(arg, settings)
    elif spec.endswith(".jsonl"):
        if not reward_fn:
            raise SuiteError(f"eval.suite={spec!r} is a JSONL file: set eval.reward_fn to 'package.module:function'")
        fn = import_object(reward_fn, "eval.reward_fn")
        if not callable(fn):
            raise SuiteError(f"eval.reward_fn={reward_fn!r} is not callable")
        from prodrl_pipelines.evaluation.jsonl_suite import JsonlSuite

        suite = JsonlSuite(read_text(spec, s3_endpoint_url), spec, fn, reward_fn)
    elif ":" in spec:
        obj = import_object(spec, "eval.suite")
        try:
            suite = obj() if isinstance(obj, type) else obj
        except Exception as e:  # noqa: BLE001 - the user's constructor: say whose and why
            raise SuiteError(f"eval.suite={spec!r}: {obj.__name__}() failed ({type(e).__name__}: {e}); a suite "
                             f"class must be constructible without arguments") from None
    else:
        known = ", ".join(sorted(sources)) or "none installed"
        raise SuiteError(f"eval.suite={spec!r}: not a registered suite source ({known}), a .jsonl file or "
                         f"'package.module:Suite'")
    missing = missing_members(suite)
    if missing:
        raise SuiteError(f"eval.suite={spec!r}: {type(suite).__name__} lacks {', '.join(missing)} "
                         f"(see prodrl_pipelines.evaluation.suite.EvalSuite)")
    if settings is not None:
        need = int(getattr(suite, "min_max_tokens", 1) or 1)
        if settings.deploy.max_tokens < need:
            raise SuiteError(f"suite {suite.name!r} needs deploy.max_tokens >= {need} (a correct answer is that "
                             f"long); got max_tokens={settings.deploy.max_tokens}")
    return suite
