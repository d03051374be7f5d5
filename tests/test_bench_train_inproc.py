"""The in-process rows of ``torchstrategies bench train`` (overhead per replica, compiled Mirrored) run and
produce the columns the table shows; speed itself is measured by the bench, never asserted here."""

from __future__ import annotations

import os

import pytest

from torchstrategies.bench import train_inproc


@pytest.mark.timeout(120)
def test_overhead_rows_cover_every_in_process_strategy_with_a_per_replica_overhead_column():
    rows = train_inproc.run(steps=2, warmup=1, rounds=1, groups=("overhead",)).rows
    names = [r["runner"] for r in rows]
    assert names == [
        "in-process overhead: torch",
        "in-process overhead: torch, 2 slices",
        "in-process overhead: torch, 3 slices",
        "in-process overhead: OneDevice",
        "in-process overhead: Mirrored(1)",
        "in-process overhead: Mirrored(2)",
        "in-process overhead: Mirrored(2), no agreement",
        "in-process overhead: Mirrored(3)",
    ]
    assert all(r["overhead us/replica"] == "" for r in rows[:3])  # the references have no overhead
    by = {r["runner"]: r for r in rows}
    for r in rows[3:]:
        assert isinstance(r["overhead us/replica"], float)
        assert isinstance(r["above 1-pass torch us/replica"], float)
    # the columns are what they say: (step - reference) / replicas, from the rows' own step times
    ms = {k: by[f"in-process overhead: {k}"]["ms/step"] for k in ("Mirrored(2)", "torch, 2 slices", "torch")}
    m2 = by["in-process overhead: Mirrored(2)"]
    assert m2["overhead us/replica"] == pytest.approx(1e3 * (ms["Mirrored(2)"] - ms["torch, 2 slices"]) / 2)
    assert m2["above 1-pass torch us/replica"] == pytest.approx(1e3 * (ms["Mirrored(2)"] - ms["torch"]) / 2)
    assert all(r["samples/s"] > 0 and r["ms/step"] > 0 for r in rows)


@pytest.mark.timeout(120)
def test_bench_inproc_command_prints_the_rows_as_one_table(tmp_path):
    import json

    from click.testing import CliRunner

    from torchstrategies_cli import main

    out = tmp_path / "inproc.json"
    args = ["bench", "inproc", "--group", "overhead", "--steps", "2", "--repeats", "1", "--threads", "1",
            "--no-progress", "--json", str(out)]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["columns"] == train_inproc.COLUMNS
    assert [row["runner"] for row in data["rows"]][3:] == [
        "in-process overhead: OneDevice",
        "in-process overhead: Mirrored(1)",
        "in-process overhead: Mirrored(2)",
        "in-process overhead: Mirrored(2), no agreement",
        "in-process overhead: Mirrored(3)",
    ]
    assert all(isinstance(row["overhead us/replica"], float) for row in data["rows"][3:])
    assert data["meta"]["groups"] == ["overhead"] and "1 torch thread(s)" in data["title"]


def test_the_own_copies_baseline_trains_like_one_full_batch_step(monkeypatch):
    """The compile group's '2 own copies' row is plain torch doing what replicas owning their copies must
    do; it must compute the same training as one device (else its time is no floor of anything)."""
    import torch

    made = []
    real = train_inproc._mlp

    def capture(sizes):
        m = real(sizes).double()
        made.append(m)
        return m

    monkeypatch.setattr(train_inproc, "_mlp", capture)
    sizes, batch = (5, 4, 3), 8
    torch.manual_seed(0)
    x, y = torch.randn(batch, 5, dtype=torch.float64), torch.randint(0, 3, (batch,))
    step = train_inproc._own_copies(sizes, 2, x, y, batch, False)
    (first,) = made  # copy 1 is its deep copy: a stale copy-back would change copy 0's next gradient
    ref = real(sizes).double()
    ref.load_state_dict(first.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=train_inproc.LR)
    for _ in range(3):
        step()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y, reduction="none").sum().div(batch).backward()
        opt.step()
    for a, b in zip(first.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("saved", [None, "1"])
def test_the_no_agreement_row_turns_the_rotating_slice_off_for_its_strategy_only(monkeypatch, saved):
    from torchstrategies.distribute import agreement
    from torchstrategies.distribute.agreement_step import AGREEMENT_SLICES

    if saved is None:
        monkeypatch.delenv(agreement.ENV, raising=False)
    else:
        monkeypatch.setenv(agreement.ENV, saved)
    off = train_inproc._strategy("mirrored-no-agreement", 2)
    assert off.extended._replicated.slices == 0
    assert os.environ.get(agreement.ENV) == saved   # the knob is put back as it was
    assert train_inproc._strategy("mirrored", 2).extended._replicated.slices == AGREEMENT_SLICES
