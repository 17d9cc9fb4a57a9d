"""Entry module for dramatiq worker processes: ``dramatiq flask_solidloop.worker``.

Loads the Flask app named by ``FLASK_APP`` (the same value ``flask --app``
takes, factories included) so init_app runs and declares the actors, then makes
the app's Postgres broker dramatiq's global broker, which the dramatiq CLI uses.
init_app itself never touches the global broker, so a host's own dramatiq
setup is left alone everywhere but in these worker processes.
"""

from __future__ import annotations

import os

import dramatiq
from flask.cli import ScriptInfo

if not os.environ.get("FLASK_APP"):
    raise RuntimeError(
        "set FLASK_APP to your app (e.g. FLASK_APP=myapp or FLASK_APP='myapp:create_app()') "
        "before running `dramatiq flask_solidloop.worker`"
    )

app = ScriptInfo(app_import_path=os.environ["FLASK_APP"]).load_app()
if "solidloop" not in app.extensions:
    raise RuntimeError(f"the app loaded from FLASK_APP={os.environ['FLASK_APP']!r} does not "
                       "initialise flask-solidloop (SolidLoop(app, db) or init_app)")
broker = app.extensions["solidloop"].broker
dramatiq.set_broker(broker)
