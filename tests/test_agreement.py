"""Issue 46: one agreement seam names any divergence between the replicas or ranks within a few steps.

A permutation of two rows, a one-bit flip and a ``.data`` write on one rank are each named (tensor, rank,
step) within ``AGREEMENT_SLICES`` steps (a write whose version moves: at once), also when two optimizers
alternate; every rank raises the same error from the same ``optimizer.step()``, before its update (nothing of
that step applied); a model and optimizer made
outside the scope (issue case 5) and ``nn.Embedding(max_norm=...)`` (case 4) under MultiWorkerMirrored are
named; in-process, replica 1's ``param.data = ...`` inside ``run`` is named (case 6); a checkpoint save of
diverged ranks raises ``ReplicaDivergenceError``; InstanceNorm's running statistics follow the MEAN rule.
"""

from __future__ import annotations

import pytest
import torch

import torchstrategies as ts
from tests import _conformance as C
from tests.harness import run_ranks
from torchstrategies.distribute.agreement_step import AGREEMENT_SLICES

CORRUPT_AT = 2          # the step (1-based, as the error counts) before whose update one rank writes
STEPS = CORRUPT_AT + AGREEMENT_SLICES + 2


def _corrupt(model: torch.nn.Module, how: str) -> None:
    w = model[0].weight
    if how == "permute":       # two rows swapped, through .data: torch counts no write
        w.data[[0, 1]] = w.data[[1, 0]]
    elif how == "bitflip":     # the lowest mantissa bit of one element, through .data
        w.data.view(torch.int64)[1, 2] ^= 1
    elif how == "data_assign":  # a new tensor: its storage changes, no version moves
        w.data = w.data.clone() * 1.5
    elif how == "inplace":     # a counted in-place write: named at once
        with torch.no_grad():
            w.add_(0.01)


def _mwms_corrupt(rank: int, world: int, how: str) -> dict[str, object]:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1)).double()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        for step in range(1, STEPS + 1):
            if step == CORRUPT_AT and rank == world - 1:
                _corrupt(model, how)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            try:
                opt.step()
            except ts.errors.ReplicaDivergenceError as e:
                return {"step": step, "message": str(e), "tensor": e.tensor, "ranks": e.replicas}
        return {"step": None}
    finally:
        strategy.shutdown()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("how,bound", [("permute", AGREEMENT_SLICES), ("bitflip", AGREEMENT_SLICES),
                                       ("data_assign", 1), ("inplace", 1)])
def test_a_write_on_one_rank_is_named_with_tensor_rank_and_step_within_the_bound(how, bound, world):
    assert AGREEMENT_SLICES <= 10  # the promise: any divergence named within 10 steps (the step it is made in
    # and the 9 after: each check hashes the next piece before its update, every piece once in 10 checks)
    for out in run_ranks(_mwms_corrupt, world, args=(how,), timeout=120):
        assert out["step"] is not None, f"{how}: never named"
        assert CORRUPT_AT <= out["step"] < CORRUPT_AT + bound, out
        assert out["tensor"] == "Sequential.0.weight" and out["ranks"] == [world - 1], out
        msg = str(out["message"])
        assert f"parameter Sequential.0.weight differs between the ranks at optimizer step {out['step']}" in msg
        assert f"rank {world - 1} holds a value that differs from rank 0's" in msg, msg
        assert "Likely cause" in msg, msg


def _mwms_raised_before_the_update(rank: int, world: int) -> dict[str, object]:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1)).double()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        w = model[0].weight
        for step in range(1, 4):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            if step == CORRUPT_AT and rank == world - 1:
                _corrupt(model, "inplace")
            before = w.detach().clone()
            try:
                opt.step()
            except ts.errors.ReplicaDivergenceError as e:
                return {"step": step, "message": str(e), "untouched": torch.equal(w.detach(), before)}
        return {"step": None}
    finally:
        strategy.shutdown()


@pytest.mark.timeout(120)
def test_every_rank_raises_the_same_error_from_the_step_before_its_update():
    """The check runs in the step pre-hook: the error comes out of the same ``optimizer.step()`` on every rank,
    with nothing of that step applied."""
    outs = run_ranks(_mwms_raised_before_the_update, 2, timeout=100)
    assert [o["step"] for o in outs] == [CORRUPT_AT, CORRUPT_AT], outs
    assert outs[0]["message"] == outs[1]["message"], outs
    assert all(o["untouched"] for o in outs), outs


def _mwms_two_optimizers(rank: int, world: int) -> dict[str, object]:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            torch.manual_seed(0)
            a = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1)).double()
            b = torch.nn.Linear(6, 1).double()
            opt_a = torch.optim.SGD(a.parameters(), lr=0.01)
            opt_b = torch.optim.SGD(b.parameters(), lr=0.01)
        x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        for step in range(1, 2 * AGREEMENT_SLICES + 5):   # a, b, a, b, ...: a's own steps take every piece
            if step == 3 and rank == world - 1:   # an uncounted write into a's second piece (bytes [1/8, 2/8))
                a[0].weight.data.view(torch.int64).view(-1)[60] ^= 1
            model, opt = (a, opt_a) if step % 2 else (b, opt_b)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            try:
                opt.step()
            except ts.errors.ReplicaDivergenceError as e:
                return {"step": step, "tensor": e.tensor}
        return {"step": None}
    finally:
        strategy.shutdown()


@pytest.mark.timeout(120)
def test_the_rotating_slice_covers_each_optimizers_tensors_when_two_optimizers_alternate():
    for out in run_ranks(_mwms_two_optimizers, 2, timeout=100):
        assert out["step"] is not None, "never named"
        assert out["step"] < 3 + 2 * AGREEMENT_SLICES, out   # within a's own AGREEMENT_SLICES steps
        assert out["tensor"] == "Sequential.0.weight", out


def _mwms_outside_scope(rank: int, world: int) -> str:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        torch.manual_seed(rank)   # a different seed per rank: separate models
        model = torch.nn.Linear(4, 2).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(3, 4, dtype=torch.float64)).sum().backward()
        try:
            opt.step()
        except ts.errors.ReplicaDivergenceError as e:
            return str(e)
        return "no error"
    finally:
        strategy.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_a_model_and_optimizer_made_outside_the_scope_with_per_rank_seeds_are_named(world):
    for msg in run_ranks(_mwms_outside_scope, world, timeout=100):
        assert "parameter SGD.param_groups[0]['params'][0] (shape (2, 4), made outside the scope) differs between " \
               "the ranks at optimizer step 1" in msg, msg
        assert "made outside strategy.scope()" in msg, msg


def _mwms_embedding(rank: int, world: int) -> str:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            torch.manual_seed(0)
            emb = torch.nn.Embedding(10, 3, max_norm=0.5).double()
            opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        ids = torch.tensor([rank, rank + 3])   # each rank looks up rows of its own
        for _ in range(3):
            opt.zero_grad()
            emb(ids).sum().backward()
            try:
                opt.step()
            except ts.errors.ReplicaDivergenceError as e:
                return str(e)
        return "no error"
    finally:
        strategy.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_an_embedding_with_max_norm_under_multi_worker_is_named_at_the_first_step(world):
    for msg in run_ranks(_mwms_embedding, world, timeout=100):
        assert "parameter Embedding.weight differs between the ranks at optimizer step 1" in msg, msg
        assert "max_norm" in msg, msg


def _mwms_save_diverged(rank: int, world: int, path: str) -> str:
    import torchstrategies as ts
    from torchstrategies.checkpoint import Checkpoint

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = torch.nn.Linear(3, 2).double()
        if rank == 1:
            model.weight.data[0, 0] += 1.0    # through .data: the step check (off here) would take a few steps
        try:
            Checkpoint(model=model).save(path)
        except ts.errors.ReplicaDivergenceError as e:
            return str(e)
        return "no error"
    finally:
        strategy.shutdown()


@pytest.mark.timeout(120)
def test_a_checkpoint_save_of_diverged_ranks_raises_the_seams_error(tmp_path):
    env = {"TORCHSTRATEGIES_AGREEMENT": "0"}   # the benchmarking knob: the save still checks
    for msg in run_ranks(_mwms_save_diverged, 2, args=(str(tmp_path / "c.pt"),), env=env, timeout=100):
        assert "parameter Linear.weight differs between the ranks at the checkpoint save" in msg, msg
        assert "rank 1 holds a value that differs" in msg, msg


def _mwms_debug(rank: int, world: int) -> object:
    out = _mwms_corrupt(rank, world, "bitflip")
    return out["step"]


@pytest.mark.timeout(120)
def test_debug_mode_checks_everything_at_every_step():
    """Debug mode hashes every byte at every check: a write torch does not count, made before step
    CORRUPT_AT's forward, is named by that step's check, before its update."""
    for step in run_ranks(_mwms_debug, 2, env={"TORCHSTRATEGIES_DEBUG": "1"}, timeout=100):
        assert step == CORRUPT_AT, step


class _Reset(torch.optim.Optimizer):
    """An update that writes every parameter from nothing the ranks hold apart: zeros."""

    def __init__(self, params) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p.zero_()


def _mwms_slice_before_the_update(rank: int, world: int) -> dict[str, object]:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 3).double()
            opt = _Reset(model.parameters())
        for step in range(1, 4):
            if step == CORRUPT_AT and rank == world - 1:
                model.weight.data[0, 0] += 1.0   # uncounted: the rotating slice's, here (debug) all of it
            model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
            try:
                opt.step()
            except ts.errors.ReplicaDivergenceError as e:
                return {"step": step, "message": str(e)}
        return {"step": None, "weight": model.weight.tolist()}
    finally:
        strategy.shutdown()


@pytest.mark.timeout(120)
def test_the_rotating_slice_compares_what_the_ranks_hold_before_the_update():
    """The slice is hashed in the step pre-hook, before the update: a difference the update would overwrite on
    every rank alike (an update that writes zeros) is still named, at the step it precedes (the ranks held
    different models until then)."""
    outs = run_ranks(_mwms_slice_before_the_update, 2, env={"TORCHSTRATEGIES_DEBUG": "1"}, timeout=100)
    assert [o["step"] for o in outs] == [CORRUPT_AT, CORRUPT_AT], outs
    assert all("parameter Linear.weight differs between the ranks" in str(o["message"]) for o in outs), outs


# --- in-process (Mirrored, CentralStorage): issue case 6 ----------------------------------------------------
IN_PROCESS = {
    "mirrored2": lambda: ts.MirroredStrategy(num_replicas=2),
    "mirrored3": lambda: ts.MirroredStrategy(num_replicas=3),
    "central_storage": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu"),
}


def _in_process_steps(strategy, how: str) -> tuple[int | None, ts.errors.ReplicaDivergenceError | None]:
    runner = C.Runner(strategy)
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1)).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def step(x):
        if ts.get_replica_context().replica_id_in_sync_group == 1:
            w = model[0].weight
            if how == "data_assign":
                w.data = w.data * 1.5            # issue case 6
            else:
                w.data.view(torch.int64)[1, 2] ^= 1   # uncounted: the rotating slice's
        opt.zero_grad()
        runner.loss(model(x).pow(2).sum(1)).backward()
        opt.step()

    for s in range(1, AGREEMENT_SLICES + 2):
        try:
            runner.run(step, *runner.split(x))
        except ts.errors.ReplicaDivergenceError as e:
            return s, e
    return None, None


@pytest.mark.parametrize("strategy_name", list(IN_PROCESS))
def test_replica_one_assigning_param_data_inside_run_is_named_at_once(strategy_name):
    step, err = _in_process_steps(IN_PROCESS[strategy_name](), "data_assign")
    assert step == 1 and err is not None, step
    assert err.tensor == "Sequential.0.weight" and err.replicas == [1], (err.tensor, err.replicas)
    assert "parameter Sequential.0.weight differs between the replicas" in str(err), str(err)
    assert "replica 1 holds a value that differs from replica 0's" in str(err), str(err)


@pytest.mark.parametrize("strategy_name", list(IN_PROCESS))
def test_an_uncounted_write_in_one_replica_is_named_within_the_slices(strategy_name):
    step, err = _in_process_steps(IN_PROCESS[strategy_name](), "bitflip")
    assert step is not None and step <= AGREEMENT_SLICES and err is not None, step
    assert err.tensor == "Sequential.0.weight" and err.replicas == [1], (err.tensor, err.replicas)


def _moved_flags(lists) -> list[int]:
    from torchstrategies import ops

    ops.agreement_hash_(lists.tensors, lists.state, lists.payload, lists.forced_from, 0, 1)
    return lists.payload[:len(lists.tensors)].tolist()


def test_a_tensor_counts_as_moved_until_recorded_and_a_new_list_counts_as_moved_whole():
    from torchstrategies import ops
    from torchstrategies.distribute.agreement_step import StepTensors

    t, u = torch.zeros(3), torch.zeros(2, 2)
    lists = StepTensors()
    lists.use([t, u], [])
    assert _moved_flags(lists) == [1, 1]     # a new list: every tensor compared whole
    assert _moved_flags(lists) == [0, 0]     # recorded when seen moved
    t.add_(1)                                # a counted write
    assert _moved_flags(lists) == [1, 0]
    t.data = torch.ones(3)                   # new storage, no version move
    assert _moved_flags(lists) == [1, 0]
    with torch.no_grad():
        u.add_(1)                            # the optimizer's own write, recorded after its step: no news
    ops.agreement_record_(lists.tensors, lists.state)
    assert _moved_flags(lists) == [0, 0]
    state = lists.state
    lists.use([t, u], [])                    # the same list of the same tensors: kept
    assert lists.state is state
    lists.use([t, torch.zeros(2, 2)], [])    # another tensor at a position: a new list, all moved
    assert lists.state is not state and _moved_flags(lists) == [1, 1]
    lists.use([t], [lists.tensors[1]])       # the same tensors, one now forced: a new list
    assert lists.forced_from == 1 and _moved_flags(lists) == [1, 0]


def test_the_step_payload_is_flags_and_fingerprints_and_their_negations_and_its_piece_names_one_changed_bit():
    from torchstrategies import ops
    from torchstrategies.distribute.agreement_step import StepTensors

    def payload(tensors, piece):   # a second step (nothing moved): the forced tensor whole, and the piece
        lists = StepTensors()
        lists.use(tensors[:-1], tensors[-1:])
        ops.agreement_hash_(lists.tensors, lists.state, lists.payload, lists.forced_from, piece, 3)
        ops.agreement_record_(lists.tensors, lists.state)
        ops.agreement_hash_(lists.tensors, lists.state, lists.payload, lists.forced_from, piece, 3)
        return lists.payload.tolist()

    # the tracked bytes: 48 + 40, cut into pieces [0, 29), [29, 58), [58, 88)
    base = [torch.arange(12.).reshape(3, 4), torch.arange(5, dtype=torch.float64), torch.ones(2)]
    n = len(base)
    for piece in range(3):
        p = payload(base, piece)
        assert p[3 * n:6 * n] == [-v for v in p[:3 * n]] and all(0 <= v < 2 ** 63 for v in p[:3 * n])
        assert p[6 * n:] == p[:3 * n]                                   # this rank's own, kept past the wire
        assert p[:n] == [0, 0, 0]                                       # nothing moved
        assert p[n:2 * n] == [0, 0, p[2 * n - 1]] and p[2 * n - 1] != 0   # the forced one hashed whole
        assert p[3 * n - 1] == 0                                        # no piece of a forced tensor
        assert payload([t.clone() for t in base], piece) == p           # the same bytes: the same payload
    assert [bool(v) for v in payload(base, 1)[2 * n:3 * n - 1]] == [True, True]   # piece 1 spans both tensors
    swapped = [base[0][[1, 0, 2]], base[1], base[2]]                  # rows 0 and 1 swapped: bytes [0, 32)
    assert [payload(swapped, k) != payload(base, k) for k in range(3)] == [True, True, False]
    flipped = [base[0], base[1].clone(), base[2]]
    flipped[1].view(torch.int64)[4] ^= 1                              # one bit of byte 80
    assert [payload(flipped, k) != payload(base, k) for k in range(3)] == [False, False, True]


def test_the_rotating_slices_cover_every_byte_once():
    tensors = [torch.zeros(5, 3), torch.zeros(0), torch.zeros(7, dtype=torch.float64), torch.zeros(4, 4).t(),
               torch.zeros(1, dtype=torch.int8), torch.zeros(4097)]
    for slices in (1, 3, AGREEMENT_SLICES, 50):
        covered = [torch.zeros(t.numel(), dtype=torch.int64) for t in tensors]
        for piece in range(slices):
            for i, (a, b) in enumerate(ts.ops.agreement_piece(tensors, piece, slices).tolist()):
                if b <= a:
                    continue   # no part in this piece
                assert tensors[i].is_contiguous() or (a, b) == (0, tensors[i].numel())   # not contiguous: whole
                covered[i][a:b] += 1
        assert all(bool((c == 1).all()) for c in covered), slices


# --- InstanceNorm's running statistics: the MEAN rule -----------------------------------------------------------
def _instance_norm_train(strategy) -> dict[str, torch.Tensor]:
    runner = C.Runner(strategy)
    with runner.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 3), torch.nn.InstanceNorm1d(3, affine=True,
                                                                                     track_running_stats=True))
        model = model.double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(12, 2, 10, dtype=torch.float64, generator=g)   # (every replica the same share)

        def step(x):
            opt.zero_grad()
            runner.loss(model(x).pow(2).sum((1, 2))).backward()
            opt.step()

        runner.run(step, *runner.split(x))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy_name", list(IN_PROCESS))
def test_instance_norm_running_statistics_are_averaged_and_match_one_device(strategy_name):
    got = _instance_norm_train(IN_PROCESS[strategy_name]())
    want = _instance_norm_train(None)
    assert not torch.equal(want["1.running_mean"], torch.zeros(3))
    C.assert_same(got, want, "instance_norm")


def test_the_per_step_walk_visits_the_modules_in_the_order_of_module_modules():
    """``modules_of`` (the per-step walks' traversal, without names) is ``Module.modules()``: each module once
    (a shared one at its first place), depth first, in registration order, None children skipped; over
    several roots, each root's in turn with a module they share yielded once (the in-process replicas' walk
    over every model made in the scope)."""
    from torchstrategies.distribute.buffers import modules_of

    shared = torch.nn.Linear(2, 2)
    root = torch.nn.Module()
    root.a = torch.nn.Sequential(shared, torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Tanh(), shared))
    root.b = shared
    root.c = None
    root.d = torch.nn.ModuleList([torch.nn.LSTM(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 1))])
    assert [id(m) for m in modules_of(root)] == [id(m) for m in root.modules()]
    assert len(list(modules_of(root))) == 10   # root, a, shared, ReLU, a.2, Tanh, d, LSTM, d.1, d.1.0
    other = torch.nn.Sequential(torch.nn.GELU(), root.d)   # a second root sharing root.d
    walked = [id(m) for m in modules_of(root, other)]
    assert walked == [id(m) for m in root.modules()] + [id(other), id(other[0])]
    assert [id(m) for m in modules_of(other, root)][:6] == [id(m) for m in other.modules()]
