"""Kernel benchmark CLI: ``python benchmarks/kernels.py [--small] [--threads 1,2] [--json F] [--plot F.png]
[--markdown]``.

A thin wrapper around ``torchstrategies.bench.kernels.run`` (also ``torchstrategies bench kernels``). Every
row is measured at 1 thread and at torch's default thread count unless ``--threads`` names others.
"""

from __future__ import annotations

import argparse

from torchstrategies.bench import kernels


def _int(x: str) -> int:
    """'65536', '64K', '16M' or '1<<20'."""
    x = x.strip().upper()
    if "<<" in x:
        a, b = x.split("<<")
        return int(a) << int(b)
    mult = {"K": 1 << 10, "M": 1 << 20}.get(x[-1:], 1)
    return int(x[:-1]) * mult if mult > 1 else int(x)


def _ints(text: str) -> list[int]:
    return [_int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ns", type=_ints, default=[2, 4, 8, 16], help="comma-separated N (default 2,4,8,16)")
    p.add_argument("--sizes", type=_ints, default=[1 << 16, 1 << 20, 1 << 24],
                   help="comma-separated element counts (default 64K,1M,16M; 1<<20 works too)")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds per case (median reported)")
    p.add_argument("--threads", type=_ints, default=None,
                   help="comma-separated torch thread counts, every method at each (default: 1 and torch's)")
    p.add_argument("--small", action="store_true", help="quick run: N 2,4 and 4K/64K elements, 5 repeats")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="also draw GB/s vs N (needs matplotlib)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown too")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.small:
        a.ns, a.sizes, a.repeats = [2, 4], [1 << 12, 1 << 16], 5
    result = kernels.run(ns=a.ns, sizes=a.sizes, repeats=a.repeats, progress=not a.no_progress,
                         threads=a.threads)
    result.print()
    if a.markdown:
        print(result.markdown())
    if a.json:
        result.write_json(a.json)
    if a.plot:
        kernels.plot(result, a.plot)


if __name__ == "__main__":
    main()
