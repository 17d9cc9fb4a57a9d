"""Database URL helpers shared by every layer: the libpq form, and a redacted
form safe for error messages and logs.

At the bottom of the layer order (next to config and errors), so the broker,
the renewer, the CLI and the database helpers all use the same two functions.
"""

from __future__ import annotations


def libpq_url(url: str) -> str:
    """Turn a SQLAlchemy URL (``postgresql+psycopg://``) into one libpq accepts."""
    if "+" in url.split("://", 1)[0]:
        scheme, rest = url.split("://", 1)
        return scheme.split("+", 1)[0] + "://" + rest
    return url


def redact_url(url: str) -> str:
    """The URL with any password replaced, for error messages and logs."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]
