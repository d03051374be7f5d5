"""The fault-tolerant mode's pieces in one process: the state header (typed, nothing unpickled), the global
batches (the order MultiWorkerMirrored reads, any split), the options, the joiners the heartbeat counts, a
group torn down by a member that leaves mid-step (its peer fails at once), and a one-worker job's training
equal to plain torch."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import torchstrategies as ts
from torchstrategies.collectives import CommunicationImplementation
from torchstrategies.errors import MembershipBelowMinimumError
from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies._mw_input import WorkerBatchSampler
from torchstrategies.strategies.fault_tolerance.group import CollectiveFailed, Group
from torchstrategies.strategies.fault_tolerance.membership import Generation, Membership
from torchstrategies.strategies.fault_tolerance.snapshot import StepSnapshot
from torchstrategies.strategies.fault_tolerance.state_transfer import decode, encode


def test_the_state_header_round_trips_optimizer_and_scheduler_state_with_types_kept():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": torch.get_rng_state(),
             "flags": torch.tensor([True, False]), "t": (1, 2.5, None, "x")}
    header, tensors = encode(state)
    back = decode(header, [t.clone() for t in tensors])
    assert back["t"] == (1, 2.5, None, "x")
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9)
    assert set(back["optimizer"]["state"]) == {0, 1}  # int keys stay int
    assert back["flags"].dtype == torch.bool and torch.equal(back["rng"], state["rng"])
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    fresh.load_state_dict(back["optimizer"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_the_state_header_refuses_what_it_cannot_type_and_malformed_headers():
    with pytest.raises(TypeError, match=r"state\.f: function"):
        encode({"f": lambda: 0})
    with pytest.raises(TypeError, match="neither str nor int"):
        encode({(1, 2): 3})
    with pytest.raises(ValueError, match="malformed"):
        decode(b'{"p": "os.system"}', [])


def test_global_batches_are_the_multi_worker_order_and_any_split_covers_each_global_batch_once():
    data = ts.GlobalBatches(torch.utils.data.TensorDataset(torch.arange(50)), global_batch_size=8, seed=3)
    sampler = WorkerBatchSampler(50, 8, 1, 0, True, 3, True)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for b, indices in enumerate(sampler):
            assert data.indices(epoch * len(data) + b) == indices
    for members in (1, 2, 3, 5):
        parts = [data.local_indices(9, i, members) for i in range(members)]
        assert sum(parts, []) == data.indices(9)
    (empty,) = data.local_batch(0, 8, 9)   # 8 rows, 9 members: the last gets no row, same structure
    assert empty.shape == (0,)


def test_fault_tolerance_options_name_the_bad_value():
    with pytest.raises(ValueError, match="min_workers must be an int >= 1, got 0"):
        ts.FaultTolerance(min_workers=0)
    with pytest.raises(ValueError, match="dead_after_seconds"):
        ts.FaultTolerance(heartbeat_seconds=1.0, dead_after_seconds=1.5)
    with pytest.raises(ValueError, match="TORCHSTRATEGIES_FT_STORE"):
        ts.FaultTolerance(store="nohost").resolved_store()


@pytest.fixture
def store_address():
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield f"127.0.0.1:{host.port}"
    del host


def _formed(members: list[Membership]) -> list:
    """Generation 1 of ``members``, formed together (each member's view, in ``members``' order)."""
    gens: dict[str, object] = {}
    threads = [threading.Thread(target=lambda m=m: gens.__setitem__(m.me, m.form(1, None, -1))) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m in members:
        m.begin(gens[m.me])
    return [gens[m.me] for m in members]


@pytest.mark.timeout(60)
def test_the_heartbeat_counts_the_registrations_for_the_next_generation_as_joiners(store_address):
    opts = ts.FaultTolerance(store=store_address, world_size=2, timeout_seconds=5.0, heartbeat_seconds=0.05,
                             dead_after_seconds=0.5)
    members = [Membership(opts) for _ in range(2)]
    try:
        gens = _formed(members)
        assert gens[0].members == gens[1].members and {g.index for g in gens} == {0, 1}
        threading.Event().wait(0.3)
        assert [m.joiners(g) for m, g in zip(members, gens)] == [0, 0]
        members[0].store.add("g2/n", 1)  # a worker registered for generation 2
        while [m.joiners(g) for m, g in zip(members, gens)] != [1, 1]:
            threading.Event().wait(0.05)  # each member's heartbeat thread sees it
        members[0].end()
        later = Generation(2, gens[0].members, gens[0].steps, 0)
        assert members[1].joiners(later) == 0  # a count belongs to the generation it was taken in
    finally:
        for m in members:
            m.end()
            m.close()


@pytest.mark.timeout(60)  # the groups' timeout is 600 s: a peer that waited for it would fail here
@pytest.mark.parametrize("implementation", ["GLOO", "AUTO"])
def test_a_member_that_closes_its_group_with_abort_fails_its_peer_s_collective_at_once(store_address,
                                                                                       implementation):
    # Member 1 discards its step and leaves while member 0 waits in the next all-reduce: member 0 fails at
    # once (gloo: the connections close with the group; our backend: Backend::abort marks the segment).
    host, port = store_address.split(":")
    stores = [dist.TCPStore(host, int(port), is_master=False) for _ in range(2)]  # one connection per member
    impl = CommunicationImplementation[implementation]
    groups: list = [None, None]
    sums = [torch.ones(3), torch.ones(3)]

    def make_and_reduce(i: int) -> None:  # made together, then a collective that completes on both
        groups[i] = Group(stores[i], Generation(1, ("a", "b"), (0, 0), i), 600.0, impl)
        groups[i].all_reduce(ReduceOp.SUM, [sums[i]])

    threads = [threading.Thread(target=make_and_reduce, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(x, torch.full((3,), 2.0)) for x in sums)
    errors: list = []

    def waiting() -> None:
        try:
            groups[0].all_reduce(ReduceOp.SUM, [torch.ones(3)])
        except CollectiveFailed as exc:
            errors.append(str(exc))

    t = threading.Thread(target=waiting)
    t.start()
    threading.Event().wait(0.3)  # member 0 is waiting for member 1
    groups[1].close(abort=True)
    t.join()
    assert len(errors) == 1, errors
    with pytest.raises(CollectiveFailed, match="generation 1 was closed"):
        groups[1].all_reduce(ReduceOp.SUM, [torch.ones(3)])
    groups[0].close(abort=True)


@pytest.mark.timeout(60)
def test_a_one_worker_job_trains_as_plain_torch_and_a_second_loop_is_refused(store_address):
    torch.manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 4, dtype=torch.float64),
                                             torch.randn(40, 1, dtype=torch.float64))
    reference = torch.nn.Linear(4, 1).double()
    model = torch.nn.Linear(4, 1).double()
    model.load_state_dict(reference.state_dict())
    strategy = ts.FaultTolerantMultiWorkerMirroredStrategy(
        ts.FaultTolerance(store=store_address, world_size=1, timeout_seconds=5.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = ts.GlobalBatches(dataset, global_batch_size=8, seed=1)
    loop = strategy.training_loop(model, opt, data)
    with pytest.raises(RuntimeError, match="already has a training loop"):
        strategy.training_loop(model, opt, data)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    def step_fn(b):
        opt.zero_grad()  # at the start this time: backward then makes .grad tensors of its own
        loss = ((model(b[0]) - b[1]) ** 2).sum() / 8
        loss.backward()
        opt.step()
        return loss.detach()

    for k in range(7):
        loss = loop.step(step_fn)
        x, y = data.local_batch(k, 0, 1)
        ref_opt.zero_grad()
        ref_loss = ((reference(x) - y) ** 2).sum() / 8
        ref_loss.backward()
        ref_opt.step()
        assert float(loss) == pytest.approx(float(ref_loss.detach()), rel=1e-14)
    assert loop.steps == 7 and loop.aborted == 0 and strategy.num_replicas_in_sync == 1
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-15)
    strategy.shutdown()


@pytest.mark.timeout(60)
def test_a_job_below_min_workers_stops_with_the_named_error(store_address):
    strategy = ts.FaultTolerantMultiWorkerMirroredStrategy(
        ts.FaultTolerance(store=store_address, world_size=1, min_workers=2, timeout_seconds=5.0))
    model = torch.nn.Linear(2, 1)
    loop = strategy.training_loop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  ts.GlobalBatches(torch.utils.data.TensorDataset(torch.randn(8, 2)), 4))
    with pytest.raises(MembershipBelowMinimumError, match=r"generation 1 has 1 live worker.*min_workers=2"):
        loop.step(lambda b: model(b[0]).sum().backward())
    strategy.shutdown()


def test_the_recovery_benchmark_measures_from_the_kill_to_the_step_in_flight_applied_and_counts_redone_steps():
    from torchstrategies.bench import fault_tolerance, train
    from torchstrategies_cli.bench import bench

    # Steps every 0.1 s; killed at t=2.05 in step 20; a resume from step 15's checkpoint redoes 15..19.
    before = [(s, 0.1 * s) for s in range(20)]
    after = [(s, 5.0 + 0.1 * (s - 15)) for s in range(15, 25)]
    row = fault_tolerance._measure([before + after], kill_at=20, t_kill=2.05)
    assert row["time lost (s)"] == pytest.approx(5.5 - 2.05)
    assert row["steps redone"] == 5 and row["step (ms)"] == pytest.approx(100.0)
    train._runner_names(["ft-GLOO", "ft-AUTO"], None)  # the bench train rows exist
    bench.commands["ft-recovery"].make_context("ft-recovery", ["--nproc", "3", "--kill-at", "30"])


@pytest.mark.timeout(60)
def test_a_worker_that_comes_back_after_the_job_finished_is_told_so(store_address):
    from torchstrategies.errors import CancelledError

    def job() -> tuple[ts.FaultTolerantMultiWorkerMirroredStrategy, object, torch.nn.Module]:
        strategy = ts.FaultTolerantMultiWorkerMirroredStrategy(ts.FaultTolerance(
            store=store_address, world_size=1, timeout_seconds=5.0, heartbeat_seconds=0.05, dead_after_seconds=0.3))
        model = torch.nn.Linear(2, 1)
        data = ts.GlobalBatches(torch.utils.data.TensorDataset(torch.randn(8, 2)), 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return strategy, strategy.training_loop(model, opt, data), (model, opt)

    def step_fn(m, opt):
        def fn(b):
            m(b[0]).sum().backward()
            opt.step()
            opt.zero_grad()
        return fn

    first, loop, (model, opt) = job()
    for _ in range(3):
        loop.step(step_fn(model, opt))
    first.shutdown()  # the job's only member ends its training
    late, late_loop, (late_model, late_opt) = job()
    with pytest.raises(CancelledError, match="finished at step 3 before this worker could rejoin"):
        late_loop.step(step_fn(late_model, late_opt))
    late.shutdown()


@pytest.mark.timeout(60)
def test_a_one_worker_job_with_batchnorm_keeps_the_running_statistics_of_plain_torch(store_address):
    torch.manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(32, 3, dtype=torch.float64))
    reference = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    model.load_state_dict(reference.state_dict())
    strategy = ts.FaultTolerantMultiWorkerMirroredStrategy(
        ts.FaultTolerance(store=store_address, world_size=1, timeout_seconds=5.0))
    data = ts.GlobalBatches(dataset, global_batch_size=8, seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = strategy.training_loop(model, opt, data)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def step_fn(b):
        (model(b[0]).pow(2).sum() / 8).backward()
        opt.step()
        opt.zero_grad()

    for k in range(4):
        loop.step(step_fn)
        ref_opt.zero_grad()
        (reference(data.local_batch(k, 0, 1)[0]).pow(2).sum() / 8).backward()
        ref_opt.step()
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14, msg=name)
    strategy.shutdown()


def _one_worker_job(store_address, model):
    strategy = ts.FaultTolerantMultiWorkerMirroredStrategy(
        ts.FaultTolerance(store=store_address, world_size=1, timeout_seconds=5.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = strategy.training_loop(model, opt, ts.GlobalBatches(torch.utils.data.TensorDataset(torch.randn(16, 2)), 4))
    return strategy, opt, loop


@pytest.mark.timeout(60)
def test_step_fn_misuse_is_named_and_a_collective_after_the_commit_point_is_refused(store_address):
    from torchstrategies.errors import CollectiveAfterCommitError

    model = torch.nn.Linear(2, 1)
    strategy, opt, loop = _one_worker_job(store_address, model)

    def reduce_after_backward(b):
        loss = model(b[0]).sum()
        before = strategy.reduce("SUM", loss.detach())  # before the commit point: part of the step
        loss.backward()
        opt.step()
        opt.zero_grad()
        return before, strategy.reduce("SUM", loss.detach())

    with pytest.raises(CollectiveAfterCommitError, match="strategy.reduce in step_fn after loss.backward"):
        loop.step(reduce_after_backward)
    assert loop.steps == 1  # committed and applied before the error: it counts once
    with pytest.raises(RuntimeError, match="returned at step 1 without calling backward"):
        loop.step(lambda b: model(b[0]).sum())
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) before the commit point"):
        loop.step(lambda b: opt.step())

    def twice(b):
        model(b[0]).sum().backward()
        model(b[0]).sum().backward()

    with pytest.raises(RuntimeError, match="a second backward"):
        loop.step(twice)
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) outside a step"):
        opt.step()
    assert loop.steps == 2 and loop.aborted == 0
    strategy.shutdown()


def test_the_random_states_round_trip_through_the_typed_header():
    import random

    import numpy as np

    from torchstrategies.strategies.fault_tolerance import random_states

    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.gauss(0, 1)
    np.random.randn()  # a cached Gaussian in both
    header, tensors = encode(random_states.capture(torch.device("cpu")))
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), float(torch.rand(())))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    random_states.restore(decode(header, [t.clone() for t in tensors]), torch.device("cpu"))
    assert (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), float(torch.rand(()))) == expected
    with pytest.raises(ValueError, match="python.mt"):
        random_states.restore({"torch": torch.get_rng_state(), "python": {"version": 3, "mt": [1], "gauss": None}},
                              torch.device("cpu"))


def test_the_step_snapshot_restores_buffers_and_random_states_into_tensors_kept_between_steps():
    bn = torch.nn.BatchNorm1d(3)
    snapshot = StepSnapshot(bn, torch.device("cpu"))
    snapshot.take()
    kept = [c.data_ptr() for c in snapshot._copies]
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    for _ in range(2):  # two discarded attempts of one step: each gives back its buffers and its draws
        draw = torch.rand(3)
        bn(torch.randn(8, 3))
        snapshot.restore()
        assert all(torch.equal(v, before[k]) for k, v in bn.state_dict().items())
        assert torch.equal(torch.rand(3), draw)
        snapshot.restore()
    bn(torch.randn(8, 3))  # committed: the next step's snapshot copies into the same tensors
    snapshot.take()
    assert [c.data_ptr() for c in snapshot._copies] == kept
    bn.running_mean = torch.zeros(3, dtype=torch.float64)  # a buffer replaced: copies made anew
    snapshot.take()
    bn.running_mean.add_(1.0)
    snapshot.restore()
    assert bn.running_mean.dtype == torch.float64 and torch.equal(bn.running_mean, torch.zeros(3, dtype=torch.float64))
