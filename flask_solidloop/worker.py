"""Entry module for dramatiq worker processes: ``dramatiq flask_solidloop.worker``.

Importing it loads the app named by ``FLASK_APP`` and makes its Postgres broker
dramatiq's global broker (see flask_solidloop/runtime/worker.py).
"""

from __future__ import annotations

from .runtime.worker import load_worker_app

app, broker = load_worker_app()
