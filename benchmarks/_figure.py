"""What every entry point here shares: run ``torchstrategies bench <name> ...`` (the one implementation of
every benchmark), then stamp its JSON and plot with the command, the date, the machine and the load.

Not a benchmark itself: nothing here times anything.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def record(name: str, args: list[str], stem: str | None = None) -> Path:
    """Runs ``torchstrategies bench <name> <args> --json results/<file>.json`` and redraws its plot
    ``results/<file>.png`` with the record (command, UTC date, machine, 1-minute load) in the title;
    ``<file>`` is ``stem``, else the bench's name."""
    from torchstrategies.bench.report import BenchResult, stamp
    from torchstrategies.cli._common import load_module
    from torchstrategies.cli.bench_cmds import BENCH_MODULES

    RESULTS.mkdir(exist_ok=True)
    stem = stem or name.replace("-", "_")
    json_path, png_path = RESULTS / f"{stem}.json", RESULTS / f"{stem}.png"
    command = ["torchstrategies", "bench", name, *args]
    load_before = os.getloadavg()[0]
    started = datetime.datetime.now(datetime.timezone.utc)
    subprocess.run([sys.executable, "-m", *command, "--json", str(json_path)], check=True)
    result = BenchResult.from_dict(json.loads(json_path.read_text()))
    stamp(result, shlex.join(command), started, load_before)
    result.write_json(str(json_path))
    load_module(BENCH_MODULES[name]).plot(result, str(png_path))
    print(f"{json_path}\n{png_path}")
    return json_path
