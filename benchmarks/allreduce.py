"""All-reduce benchmark: every implementation side by side (see torchstrategies/bench/allreduce.py).

    python benchmarks/allreduce.py --nproc 2 --plot allreduce.png --json allreduce.json
    python benchmarks/allreduce.py --nproc 4 --simulate-hosts 2 --sizes 4096,1048576,67108864 --markdown
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchstrategies.bench import allreduce


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes", default=",".join(str(s) for s in allreduce.DEFAULT_SIZES))
    p.add_argument("--implementations", default=None,
                   help=f"comma-separated, from {allreduce.IMPLEMENTATIONS}; default: "
                        f"{allreduce.DEFAULT_IMPLEMENTATIONS} (with --simulate-hosts: "
                        f"{allreduce.SIMULATED_HOSTS_IMPLEMENTATIONS})")
    p.add_argument("--simulate-hosts", type=int, default=1,
                   help="split the ranks into this many simulated hosts (TORCHSTRATEGIES_HOST_ID per rank)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args()
    r = allreduce.run(nproc=a.nproc, sizes=[int(s) for s in a.sizes.split(",")],
                      implementations=a.implementations.split(",") if a.implementations else None,
                      rounds=a.rounds, simulate_hosts=a.simulate_hosts)
    r.print()
    if a.markdown:
        print(r.title + "\n")
        print(r.markdown())
        for n in r.notes:
            print("\n" + n)
    if a.json:
        r.write_json(a.json)
    if a.plot:
        allreduce.plot(r, a.plot)


if __name__ == "__main__":
    main()
