"""Whether a ``merge_call`` is the last thing a replica function does (``mirrored_run``'s shortcut).

``ends_replica_fn(fn, frame)`` looks at the Python frames between a merge_call and the replica function
``fn`` that ``_Replica.call`` called, at the bytecode each will execute next:

* every frame in between returns the merge_call's value as it is (``return ctx.merge_call(...)``, as
  ``optimizer.step()`` under a strategy, ``ReplicaContext.merge_call`` and the strategy's ``_merge_call``
  do), and
* ``fn`` itself drops that value, then returns a constant or a local variable (``optimizer.step()`` as
  its last statement, or followed by ``return loss``: reading a local runs no code), or returns
  ``<local>.detach()`` / ``.item()`` / ``.clone()`` / ``.cpu()`` of a local that is a ``torch.Tensor``
  when the merge_call is made (``return loss.detach()``: those read the tensor the replica computed
  before the merge_call and nothing the merge changes, so running them before the merge, as the
  shortcut does, returns what running them after it would),
* with no ``try``/``with`` block around any of those calls (an exception the merge raises would then
  reach code of the replica), on Python 3.11+ (where the exception table says so).

Then nothing of the replica runs after the merge_call, so the scheduler may let ``fn`` end at once and run
the merge when the last replica arrives, without a thread of its own for this replica. Anything else
(a bound ``functools.partial``, a compiled or traced function, code after the call, another Python
version's bytecode this does not know) answers False: the general, threaded schedule. Answers are cached
per code object and instruction offset.
"""

from __future__ import annotations

import dis
import sys
from types import CodeType, FrameType
from typing import Any

import torch

__all__ = ["ends_replica_fn"]

_MAX_DEPTH = 12  # frames between merge_call and fn that are looked at
_CACHE_LIMIT = 4096
# (id(code), offset, drops) -> (code, answer); keyed by id because hashing a code object is not cached
_cache: dict[tuple[int, int, bool], tuple[CodeType, bool | str]] = {}
_SUPPORTED = sys.version_info >= (3, 11)
# Tensor methods ``fn`` may return the result of, called without arguments on a local tensor (pure reads)
_RESULT_METHODS = frozenset({"detach", "item", "clone", "cpu"})
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)  # (exactly: a subclass may override those methods)


_caller: list[CodeType] = []


def _caller_code() -> CodeType:
    """The code of ``_Replica.call``, the frame that calls a replica function."""
    if not _caller:
        from torchstrategies.distribute.mirrored_run import _Replica

        _caller.append(_Replica.call.__code__)
    return _caller[0]


def _next_ops(code: CodeType, lasti: int) -> tuple[list[dis.Instruction], bool]:
    """The instructions after the one at ``lasti`` (a call), and whether a call precedes them there."""
    instructions = list(dis.get_instructions(code))
    before = [i for i in instructions if i.offset <= lasti]
    after = [i for i in instructions if i.offset > lasti]
    is_call = bool(before) and before[-1].opname.startswith("CALL")
    return after, is_call


def _covered_by_handler(code: CodeType, lasti: int) -> bool:
    entries = getattr(dis.Bytecode(code), "exception_entries", None)
    if entries is None:
        return True  # unknown: assume a handler
    return any(e.start <= lasti < e.end for e in entries)


def _passes_through(code: CodeType, lasti: int, drops: bool) -> bool | str:
    """Whether the frame at ``lasti`` returns the call's value (``drops``: drops it and returns a constant
    or a local: True; or returns ``<local>.detach()`` and the like: that local's name, which must hold a
    tensor)."""
    key = (id(code), lasti, drops)
    hit = _cache.get(key)
    if hit is not None and hit[0] is code:
        return hit[1]
    after, is_call = _next_ops(code, lasti)
    ok: bool | str = is_call and not _covered_by_handler(code, lasti)
    if ok:
        ops = [(i.opname, i.argval, i.arg) for i in after[:8] if i.opname not in ("NOP", "CACHE", "PRECALL")]
        if drops:  # POP_TOP, then return a constant or a local variable (reading it runs no code)
            names = [name for name, _, _ in ops]
            ok = names[:1] == ["POP_TOP"] and (
                names[1:2] == ["RETURN_CONST"]
                or (len(names) >= 3 and names[1] in ("LOAD_CONST", "LOAD_FAST") and names[2] == "RETURN_VALUE")
            )
            if (  # or return <local>.detach() and the like (LOAD_METHOD in 3.11, LOAD_ATTR from 3.12)
                not ok
                and names[:2] == ["POP_TOP", "LOAD_FAST"]
                and names[2:3] in (["LOAD_METHOD"], ["LOAD_ATTR"])
                and ops[2][1] in _RESULT_METHODS
                and names[3:5] == ["CALL", "RETURN_VALUE"]
                and ops[3][2] == 0
            ):
                ok = str(ops[1][1])
        else:
            ok = bool(ops) and ops[0][0] == "RETURN_VALUE"
    if len(_cache) >= _CACHE_LIMIT:
        _cache.clear()
    _cache[key] = (code, ok)
    return ok


def ends_replica_fn(fn: Any, frame: FrameType | None) -> bool:
    """Whether the merge_call made in ``frame`` (the caller of the scheduler) is ``fn``'s last act.

    Args:
        fn: the replica function ``_Replica.call`` called.
        frame: the frame that called the scheduler's merge_call entry point.
    """
    if not _SUPPORTED:
        return False
    code = getattr(fn, "__code__", None)
    if not isinstance(code, CodeType):
        return False
    caller = _caller_code()
    f = frame
    for _ in range(_MAX_DEPTH):
        if f is None:
            return False
        back = f.f_back
        if f.f_code is code and back is not None and back.f_code is caller:
            answer = _passes_through(code, f.f_lasti, drops=True)
            if isinstance(answer, str):  # return <local>.detach() etc.: only of a plain tensor
                return type(f.f_locals.get(answer)) in _TENSOR_TYPES
            return answer
        if not _passes_through(f.f_code, f.f_lasti, drops=False):
            return False
        f = back
    return False
