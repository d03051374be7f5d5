"""The chief's cache of pickled scheduled functions: ``schedule(fn)`` pickles ``fn`` once, not every call.

cloudpickle pickles a function defined in a script or inside another function by value: its code, the
globals its code names, its closure cells, defaults and attributes. Finding which submodules those globals
need (a scan of ``sys.modules``) makes that the chief's largest cost per ``schedule()`` when the same step
function is scheduled thousands of times. The result is a function of a few things only, so
:class:`FunctionCache` keeps the bytes of a function and reuses them while all of these are the very same
objects as when it pickled them (compared by identity, checked on every ``schedule``):

* the function's code, globals dict, name, qualname, module, doc, defaults, keyword defaults, annotations
  and ``__dict__`` items;
* each global its code (and nested code) names, looked up in its globals (or its absence), and each closure
  cell's content (or its emptiness);
* recursively, the same for each plain Python function found there (a few levels deep), whether cloudpickle
  pickles it by reference, and the number of entries in ``sys.modules``.

And a function is cached only if every value found there is one whose pickle cannot change while the object
stays the same: an immutable value (None, bool, int, float, complex, str, bytes, a torch dtype or device,
tuples and frozensets of these), a module or class that cloudpickle pickles by reference, a builtin function
of a module, a plain function checked the same way, or an object pickled by reference to the strategy's
book (a placed parameter, a module or optimizer of the strategy, a variable, a per-worker iterator or
value, the strategy). Anything else (a list, a dict, a plain tensor, a module of no strategy, an object of a
user class, a class defined in ``__main__``) and the function is pickled afresh on every call, as it always
was. So a rebound global, a rebound closure variable or an object mutated in place is seen by the next
closure exactly as without the cache.
"""

from __future__ import annotations

import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FunctionCache"]

try:  # cloudpickle's own rules for what it pickles (the cache is off if a version lacks them)
    from cloudpickle.cloudpickle import _extract_code_globals, _should_pickle_by_reference
except ImportError:  # pragma: no cover - depends on the installed cloudpickle
    _extract_code_globals = None
    _should_pickle_by_reference = None

_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, type(Ellipsis), torch.dtype,
                    torch.device, types.CodeType})
_BASE_GLOBALS = ("__package__", "__name__", "__path__", "__file__")   # what cloudpickle copies of a module
_MISSING = object()      # a global the code names that is not defined (looked up on the worker's builtins)
_EMPTY_CELL = object()
_DICT = object()
_TOP = object()          # the cached function itself (cached by code: a new lambda each step still hits)
MAX_DEPTH = 4            # functions reached through functions, deeper than this: not cached
MAX_ENTRIES = 64


class _Uncacheable(Exception):
    """The walk met a value whose pickle may change while the object stays the same."""


class _Entry:
    __slots__ = ("fingerprint", "num_modules", "blob", "refs", "pwv")

    def __init__(self, fingerprint: list[Any], num_modules: int, blob: bytes, refs: set, pwv: list):
        self.fingerprint = fingerprint
        self.num_modules = num_modules
        self.blob = blob
        self.refs = refs
        self.pwv = pwv


class _Walk:
    """Collects, in a fixed order, every object the pickle of a function depends on."""

    def __init__(self, is_reference: Callable[[object], bool], top: types.FunctionType):
        self.is_reference = is_reference
        self.top = top
        self.out: list[Any] = []
        self.walked: set[int] = set()
        self.cells: dict[int, int] = {}   # closure cells met so far -> the order they were first met in
        self.cell_pattern: list[int] = []  # for each cell met: that number (which cells are shared)

    def function(self, f: types.FunctionType, depth: int) -> None:
        self.out.append(_TOP if f is self.top else f)
        if id(f) in self.walked:          # recursion, or a helper reached twice: its position is recorded
            return
        self.walked.add(id(f))
        if f.__module__ is None:          # cloudpickle would search every module for it
            raise _Uncacheable
        by_ref = bool(_should_pickle_by_reference(f))
        self.out.append(by_ref)
        if by_ref:                        # pickled as (module, qualname)
            return
        if depth > MAX_DEPTH:
            raise _Uncacheable
        g = f.__globals__
        self.out += (f.__code__, g)
        for v in (f.__name__, f.__qualname__, f.__module__, f.__doc__, f.__defaults__):
            self.value(v, depth)
        for d in (f.__kwdefaults__, f.__annotations__, f.__dict__):
            self.items(d, depth)
        for k in _BASE_GLOBALS:
            v = g.get(k, _MISSING)
            if v is _MISSING:
                self.out.append(v)
            else:
                self.value(v, depth)
        for name in _extract_code_globals(f.__code__):
            v = g.get(name, _MISSING)
            if v is _MISSING:
                self.out.append(v)
            else:
                self.value(v, depth)
        for cell in f.__closure__ or ():
            self.cell_pattern.append(self.cells.setdefault(id(cell), len(self.cells)))
            try:
                v = cell.cell_contents
            except ValueError:
                self.out.append(_EMPTY_CELL)
                continue
            self.value(v, depth)

    def items(self, d: dict | None, depth: int) -> None:
        self.out.append(None if d is None else _DICT)     # a dict of the function: its contents count
        if d:
            self.out.append(len(d))       # small int: identity is equality
            for k, v in d.items():
                self.value(k, depth)
                self.value(v, depth)

    def value(self, v: object, depth: int) -> None:
        t = type(v)
        if t in _ATOMS:
            self.out.append(v)
            return
        if isinstance(v, (tuple, frozenset)) and (t is tuple or t is frozenset):   # not a namedtuple
            self.out.append(v)
            for x in v:
                self.value(x, depth)
            return
        if isinstance(v, types.FunctionType):     # (not subclassable)
            self.function(v, depth + 1)
            return
        self.out.append(v)
        if isinstance(v, types.ModuleType) or issubclass(t, type):
            if getattr(v, "__module__", "") is None or not _should_pickle_by_reference(v):
                raise _Uncacheable        # a dynamic module or class is pickled by value: mutable
            return
        if isinstance(v, types.BuiltinFunctionType):
            if v.__self__ is None or isinstance(v.__self__, types.ModuleType):
                return
            raise _Uncacheable
        if not self.is_reference(v):
            raise _Uncacheable


class FunctionCache:
    """Pickled scheduled functions, reused while what their pickle depends on is unchanged.

    Args:
        is_reference: whether the closure pickler replaces an object by a reference to the chief's book
            (``Registry.is_reference``); such an object may stay in a cached function.

    ``Registry.dumps_closure`` (what ``ClusterCoordinator.schedule`` calls) is its one user.

    Example:
        >>> fingerprint = cache.fingerprint(train_step)       # None: not cacheable    # doctest: +SKIP
        >>> entry = cache.lookup(train_step, fingerprint)     # None: pickle it, store  # doctest: +SKIP
    """

    def __init__(self, is_reference: Callable[[object], bool]):
        self._is_reference = is_reference
        self._lock = threading.Lock()
        self._entries: OrderedDict[types.CodeType, _Entry] = OrderedDict()
        self.pickled = 0        # functions pickled by value for the cache (tests and profiling)
        self.hits = 0

    @staticmethod
    def by_reference(fn: types.FunctionType) -> bool:
        """Whether cloudpickle pickles the function ``fn`` by reference (module and qualname)."""
        return fn.__module__ is not None and bool(_should_pickle_by_reference(fn))

    @staticmethod
    def enabled() -> bool:
        """Whether the installed cloudpickle exposes the rules the fingerprint follows."""
        return _extract_code_globals is not None and _should_pickle_by_reference is not None

    def fingerprint(self, fn: object) -> list[Any] | None:
        """What the pickle of ``fn`` depends on, or None if ``fn`` is not cacheable."""
        if type(fn) is not types.FunctionType or not self.enabled():
            return None                  # partials, bound methods, callable objects: pickled every time
        walk = _Walk(self._is_reference, fn)
        try:
            walk.function(fn, 0)
        except Exception:  # noqa: BLE001 - _Uncacheable, or an attribute that fails: pickle as without cache
            return None
        if walk.out[1]:                   # pickled by reference: cheap already
            return None
        walk.out.append(tuple(walk.cell_pattern))         # compared by value, the rest by identity
        return walk.out

    def lookup(self, fn: types.FunctionType, fingerprint: list[Any]) -> _Entry | None:
        """The entry for ``fn`` if its fingerprint is the very same objects, else None."""
        with self._lock:
            entry = self._entries.get(fn.__code__)
            if entry is None or entry.num_modules != len(sys.modules):
                return None
            old = entry.fingerprint
            if len(old) != len(fingerprint) or old[-1] != fingerprint[-1] or \
                    any(a is not b for a, b in zip(old[:-1], fingerprint)):
                return None
            self._entries.move_to_end(fn.__code__)
            self.hits += 1
            return entry

    def store(self, fn: types.FunctionType, fingerprint: list[Any], num_modules: int, blob: bytes, refs: set,
              pwv: list) -> _Entry:
        """Keeps the pickle of ``fn`` (``blob``, with the references and per-worker values it recorded)."""
        entry = _Entry(fingerprint, num_modules, blob, refs, pwv)
        with self._lock:
            self.pickled += 1
            self._entries[fn.__code__] = entry
            self._entries.move_to_end(fn.__code__)
            while len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)
        return entry
