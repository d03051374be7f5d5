"""What the ``torchstrategies`` commands run: ``bench_cmds`` (``bench <name>``), ``compare``, ``env_cmd`` and
``demo``, with ``_common.emit_result`` the one report path and ``recommend`` compare's advice.

The parser (options, help, ``--help``) is the top-level package ``torchstrategies_cli``, which imports no
torch; each of its commands imports its function here only when it runs.
"""

__all__: list[str] = []
