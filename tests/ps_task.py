"""A ps or worker task as its own process, for tests that kill and restart tasks (as a launcher would).

Reads the torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
``PS_TASK_LEASE`` (the server's lease on the chief, seconds); serves until the chief shuts the cluster down,
then exits 0. Any error exits 1 with its traceback on stderr.
"""

from __future__ import annotations

import os
import sys

import torchstrategies as ts


def main() -> int:
    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=1)
    lease = float(os.environ.get("PS_TASK_LEASE", "30"))
    ts.distribute.Server(resolver, timeout=60, lease_timeout=lease).join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
