"""The harness: what loads kernels, runs them on drawn cases and keeps the failures.

``kernels`` reads a kernel module and calls its kernels; ``judge`` judges one
case; ``suite`` is the built-in property suite; ``cases`` reads and writes
regression case files; ``config`` reads ``[tool.exactref]``; ``plugin`` is
the pytest plugin's internals; ``standalone`` exports a case as a test; and
``audit_report`` prints and writes the audit's table.  The harness imports
the judge's core, never the other way round.

Its public names are what the tests ``exactref to-pytest`` writes call, so
that those tests keep running when the modules inside move.
"""

from .standalone import check_kernel, run_test_once

__all__ = ["check_kernel", "run_test_once"]
