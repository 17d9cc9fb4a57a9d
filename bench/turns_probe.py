"""The import probe of bench/turns.py's ``--against`` workers.

dramatiq imports it in each worker process after ``flask_solidloop.worker``
(an extra module on the command line), from a directory last on PYTHONPATH, so
it shadows nothing. It appends one JSON line to $SOLIDLOOP_BENCH_IMPORTS: the
process id and the file each ``flask_solidloop`` module and ``turns_app`` were
imported from, for the harness to check they come from the REV worktree.
"""

from __future__ import annotations

import json
import os
import sys


def origin(module: object) -> str | None:
    """The file (or, for a package without one, the first directory) of ``module``."""
    return getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), None)


modules = {name: origin(module) for name, module in list(sys.modules.items())
           if name == "turns_app" or name.split(".")[0] == "flask_solidloop"}
with open(os.environ["SOLIDLOOP_BENCH_IMPORTS"], "a") as out:
    out.write(json.dumps({"pid": os.getpid(), "modules": modules}) + "\n")
