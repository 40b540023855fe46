"""The version of a scorer written in Python: a hash of the source its module was loaded from."""

from __future__ import annotations

import inspect
import weakref
from typing import Callable

from prodrl_pipelines.rewards.outcome import short_hash

# grader -> the hash of its module's source when this process first built a source on it: right after
# the import in practice (``GraderSource`` imports it); a new function object (a re-import) is hashed anew
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _source_hash(fn: Callable) -> str:
    module = inspect.getmodule(fn)
    try:
        code = inspect.getsource(module) if module is not None else inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(getattr(fn, "__code__", None), "co_code", b"").hex()
    return short_hash(code)


def loaded_code_hash(fn: Callable) -> str:
    """A hash of the source ``fn`` was loaded from, not of the file on disk now: the file may have been
    edited since the import, and this process still runs the imported code."""
    try:
        return _LOADED[fn]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: hashed each time
        return _source_hash(fn)
    _LOADED[fn] = h = _source_hash(fn)
    return h
