"""The admin: a Jinja blueprint to watch every loop live, find any loop, and act
on one or on a filtered set (docs/guides/admin.md).

Mount it with ``app.register_blueprint(solidloop.admin_blueprint(authorize=...),
url_prefix="/admin")``. It reads through ``loops.queries`` and acts through
``loops.control`` and ``jobs.control``; it writes nothing itself.

Modules: ``blueprint`` (views), ``security`` (authorize, CSRF, CSP),
``filters`` (the list's URL filters), ``live`` (SSE and the per-process
LISTEN hub), ``format`` (money, durations, safe URLs), ``passes`` (the last
reaper and janitor passes, judged for the dashboard).
"""

from __future__ import annotations

from .blueprint import NAV, SubjectLink, SubjectResolver, create_blueprint
from .format import money, safe_url
from .security import Authorize

__all__ = ["NAV", "Authorize", "SubjectLink", "SubjectResolver", "create_blueprint", "money",
           "safe_url"]
