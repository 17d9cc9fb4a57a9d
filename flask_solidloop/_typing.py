"""Type aliases shared across modules, and the one helper that unwraps one."""

from __future__ import annotations

from typing import TypeAlias

from sqlalchemy.orm import Session, scoped_session

#: A plain session or Flask-SQLAlchemy's scoped one: both proxy the same API.
SessionLike: TypeAlias = Session | scoped_session


def real_session(session: SessionLike) -> Session:
    """The Session behind a scoped session (Flask-SQLAlchemy's ``db.session``)."""
    return session() if isinstance(session, scoped_session) else session
