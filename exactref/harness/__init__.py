"""The harness: what loads kernels, runs them on drawn cases and keeps the failures.

``kernels`` reads a kernel module and calls its kernels; ``judge`` judges one
case; ``suite`` is the built-in property suite; ``cases`` reads and writes
regression case files; ``config`` reads ``[tool.exactref]``; ``plugin`` is
the pytest plugin's internals; ``standalone`` exports a case as a test; and
``audit_report`` prints and writes the audit's table.  The harness imports
the judge's core, never the other way round.
"""

__all__: list[str] = []
