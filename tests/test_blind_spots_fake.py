"""The fake (meta) kernels that torch.compile traces with check what the real kernels check.

Under FakeTensorMode a wrong-shape or wrong-dtype ``out`` / ``dst`` (or input) must raise the error eager
raises: same type, same message. And every op of the ``torchstrategies`` namespace passes
``torch.library.opcheck`` (a new op without a case here fails the coverage check).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torchstrategies as ts

OPS = torch.ops.torchstrategies
SHAPE = (4, 5)


def _call(op: str, xs: list[torch.Tensor], target: torch.Tensor | None) -> None:
    if op == "accumulate_":
        ts.ops.accumulate_(target, xs)
    elif op == "accumulate_n":
        ts.ops.accumulate_n(xs, out=target, scale=0.5)
    else:
        ts.ops.tree_reduce(xs, out=target)


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and message are what is compared
        return type(e).__name__, str(e)
    return None


def _case(defect: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(SHAPE, generator=g) for _ in range(3)]
    target = torch.zeros(SHAPE)
    if defect == "out_shape":
        target = torch.zeros(SHAPE[0], SHAPE[1] + 1)
    elif defect == "out_numel_same_shape_differs":
        target = torch.zeros(SHAPE[1], SHAPE[0])
    elif defect == "out_dtype":
        target = torch.zeros(SHAPE, dtype=torch.float64)
    elif defect == "input_shape":
        xs[1] = torch.randn(SHAPE[0] + 1, SHAPE[1], generator=g)
    elif defect == "input_dtype":
        xs[2] = xs[2].double()
    return xs, target


@pytest.mark.parametrize("op", ["accumulate_n", "tree_reduce", "accumulate_"])
@pytest.mark.parametrize(
    "defect", ["out_shape", "out_numel_same_shape_differs", "out_dtype", "input_shape", "input_dtype"])
def test_fake_kernel_raises_the_eager_error_for_a_bad_out_or_dst(op, defect):
    xs, target = _case(defect)
    eager = _error(lambda: _call(op, xs, target))
    assert eager is not None, f"eager {op} accepted {defect}"
    assert eager[0] in ("ValueError", "TypeError") and (op in eager[1]), eager
    mode = FakeTensorMode()
    fxs, ftarget = [mode.from_tensor(x) for x in xs], mode.from_tensor(target)
    with mode:
        fake = _error(lambda: _call(op, fxs, ftarget))
    assert fake == eager, f"{op} with {defect}: fake raised {fake}, eager raised {eager}"


@pytest.mark.parametrize("op", ["accumulate_n", "tree_reduce", "accumulate_"])
def test_fake_kernel_accepts_what_eager_accepts(op):
    xs, target = _case("none")
    _call(op, xs, target)
    mode = FakeTensorMode()
    with mode:
        _call(op, [mode.from_tensor(x) for x in xs], mode.from_tensor(target))


def _opcheck_cases() -> dict[str, list[tuple]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for dtype, n in ((torch.float32, 7), (torch.float64, 4097), (torch.bfloat16, 1), (torch.int64, 33)):
        xs = [(torch.randn(n, generator=g) * 10).to(dtype) for _ in range(3)]
        out.append((xs, dtype.is_floating_point))
    cases: dict[str, list[tuple]] = {name: [] for name in
                                     ("accumulate_n", "tree_reduce", "accumulate_n_out", "tree_reduce_out",
                                      "accumulate_", "accumulate_grouped_", "hash_tensors")}
    for xs, floating in out:
        scales = (None, 0.5) if floating else (None,)
        for scale in scales:
            cases["accumulate_n"].append((xs, scale))
            cases["tree_reduce"].append((xs, scale))
            cases["accumulate_n_out"].append((xs, scale, torch.empty_like(xs[0])))
            cases["tree_reduce_out"].append((xs, scale, torch.empty_like(xs[0])))
        cases["accumulate_"].append((xs[0].clone(), xs[1:]))
        # two destinations (the second of another shape), two tensors each: [t0 of each, t1 of each]
        other = [x[: max(1, x.numel() // 2)].clone() for x in xs]
        cases["accumulate_grouped_"].append(([xs[0].clone(), other[0]], [xs[1], other[1], xs[2], other[2]]))
        cases["hash_tensors"].append(([xs[0], other[1], xs[2].reshape(-1, 1)[::2]],))
    # the agreement check's two ops (agreement_step.py): before the update (a new list: everything moved;
    # pieces 0 and 1 of 2), and after it
    state = torch.zeros(2, 3, dtype=torch.int64)
    state[:, 0] = -1   # a new list: every tensor counts as moved
    tensors = [torch.randn(5, 3, generator=g), torch.arange(7.)]
    cases["agreement_hash_"] = [(tensors, state.clone(), torch.zeros(18, dtype=torch.int64), 1, piece, 2)
                                for piece in (0, 1)]
    cases["agreement_record_"] = [(tensors, state.clone())]
    # which bytes a piece of the rotating slice holds, and their fingerprints: mixed dtypes, an empty and a
    # non-contiguous tensor
    mixed = [torch.randn(5, 3, generator=g), torch.zeros(0), torch.arange(7, dtype=torch.int8),
             torch.randn(4, 4, generator=g).t(), torch.randn(3, generator=g).double()]
    cases["agreement_piece"] = [(mixed, piece, slices) for slices in (1, 4) for piece in range(slices)]
    cases["agreement_piece"].append(([], 0, 1))
    cases["agreement_piece_fingerprints"] = list(cases["agreement_piece"])   # the same pieces, their fingerprints
    return cases


def test_every_op_in_the_namespace_passes_opcheck():
    names = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith("torchstrategies::"))
    cases = _opcheck_cases()
    assert names == sorted(cases), f"ops without an opcheck case: {sorted(set(names) - set(cases))}"
    for name in names:
        for args in cases[name]:
            torch.library.opcheck(getattr(OPS, name).default, args)
