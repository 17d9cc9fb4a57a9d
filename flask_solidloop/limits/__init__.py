"""Budgets, shared rate limits and fair shares (docs/guides/limits.md): what a
loop and a subject may spend, and what a provider key or a tool may take per
period across every worker. ``spec`` parses the settings, ``budgets`` and
``rates`` own their tables, ``admission`` is what a turn asks before and
after its request."""
