"""Whether a ``merge_call`` is the last thing a replica function does (``mirrored_run``'s shortcut).

``ends_replica_fn(fn, frame)`` (made by ``replica_fn_check``) looks at the Python frames between a
merge_call and the replica function ``fn`` that the scheduler called in its own thread
(``mirrored_run.call_for_each_replica``), at the bytecode each will execute next:

* every frame in between returns the merge_call's value as it is (``return ctx.merge_call(...)``, as
  ``optimizer.step()`` under a strategy, ``ReplicaContext.merge_call`` and the strategy's ``_merge_call``
  do), and
* ``fn`` itself drops that value, then returns a constant or a local variable (``optimizer.step()`` as
  its last statement, or followed by ``return loss``: reading a local runs no code), or returns
  ``<local>.detach()`` / ``.item()`` / ``.clone()`` / ``.cpu()`` of a local that is a ``torch.Tensor``
  computed by autograd (it has a ``grad_fn``) and not a view when the merge_call is made (``return
  loss.detach()``: those read the tensor the replica computed before the merge_call, which the merge
  does not write, so running them before the merge, as the shortcut does, returns what running them
  after it would; a parameter, gradient or optimizer state, or a view of one, which the step updates in
  place, takes the general schedule),
* with no ``try``/``with`` block around any of those calls (an exception the merge raises would then
  reach code of the replica), on Python 3.11+ (where the exception table says so).

Then nothing of the replica runs after the merge_call, so the scheduler may let ``fn`` end at once and run
the merge when the last replica arrives, without a thread of its own for this replica. Anything else
(a bound ``functools.partial``, a compiled or traced function, code after the call, another Python
version's bytecode this does not know) answers False: the general, threaded schedule. The walk runs in C
(``_C.FrameCheck``); answers are cached per code object and instruction offset.
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, cast

from torchstrategies._ext import _C

__all__ = ["replica_fn_check"]

_MAX_DEPTH = 12  # frames between merge_call and fn that are looked at
_SUPPORTED = sys.version_info >= (3, 11)
# Tensor methods ``fn`` may return the result of, called without arguments on a local tensor (pure reads)
_RESULT_METHODS = frozenset({"detach", "item", "clone", "cpu"})


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
    tensor). ``_C.FrameCheck`` caches the answers per code object and offset."""
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
    return ok


def replica_fn_check(caller: CodeType) -> Callable[[Any, FrameType | None], bool]:
    """``ends_replica_fn(fn, frame)`` for replica functions called by the code ``caller``
    (``call_for_each_replica``): whether the merge_call made in ``frame`` (the frame that called the
    scheduler's merge_call entry point) is ``fn``'s last act. The frame walk and its cache are in C
    (``_C.FrameCheck``, csrc/cpu/frame_check.cpp); a local named by ``return <local>.detach()`` must hold
    exactly a ``torch.Tensor`` (a subclass may override those methods) with a ``grad_fn``, not a view."""
    if not _SUPPORTED or not _C.FRAME_CHECK_SUPPORTED:
        return lambda fn, frame: False
    return cast(Callable[[Any, Any], bool], _C.FrameCheck(caller, _passes_through, _MAX_DEPTH))
