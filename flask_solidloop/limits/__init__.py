"""Budgets, shared rate limits and fair shares (docs/guides/limits.md): what a
loop and a subject may spend, and what a provider key or a tool may take per
period across every worker. ``budgets`` and ``rates`` own their tables,
``admission`` is what a turn asks before and after its request; the settings
are parsed by flask_solidloop/limit_spec.py, fair shares live in the store and
the queue (docs/decisions/0023-fair-shares.md)."""
