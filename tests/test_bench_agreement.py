"""``torchstrategies bench agreement``: the agreement check's cost, paired (issue 46): the job alternates blocks
with the check on and off and reports both, their paired difference and the check's own time per rank."""

from __future__ import annotations

import pytest

from torchstrategies.bench import agreement_cost
from torchstrategies_cli.bench import bench


@pytest.mark.timeout(180)
def test_the_job_alternates_the_check_and_reports_its_own_time_on_every_rank():
    result = agreement_cost.run(nproc=2, blocks=2, steps=2, warmup=2, progress=False)
    values = {r["measure"]: r["value"] for r in result.rows}
    assert set(result.meta["times"]) == {"on", "off"}
    assert [len(v) for v in result.meta["times"].values()] == [2, 2]
    assert values["ms a step, check on"] > 0 and values["ms a step, check off"] > 0
    own = [v for k, v in values.items() if k.startswith("rank ")]
    assert len(own) == 2 and all(v > 0 for v in own), values   # the check ran in the "on" blocks, on each rank
    assert "slices) and off" in result.notes[0], result.notes


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="nproc=1"):
        agreement_cost.run(nproc=1)


def test_the_cli_parses_the_command():
    ctx = bench.commands["agreement"].make_context("agreement", ["--blocks", "3", "--steps", "5"])
    assert ctx.params["blocks"] == 3 and ctx.params["steps"] == 5 and ctx.params["nproc"] == 2
