"""Type aliases shared across modules."""

from __future__ import annotations

from typing import TypeAlias

from sqlalchemy.orm import Session, scoped_session

#: A plain session or Flask-SQLAlchemy's scoped one: both proxy the same API.
SessionLike: TypeAlias = Session | scoped_session
