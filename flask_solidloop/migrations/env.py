"""Alembic environment for the standalone ``flask solidloop db`` commands."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from flask_solidloop.migrations import VERSION_TABLE
from flask_solidloop.models import metadata

config = context.config
url: str = config.attributes.get("solidloop_url") or config.get_main_option("sqlalchemy.url") or ""


def run_offline() -> None:
    context.configure(url=url, target_metadata=metadata, literal_binds=True,
                      version_table=VERSION_TABLE)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        context.configure(connection=connectable, target_metadata=metadata,
                          version_table=VERSION_TABLE)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=metadata,
                          version_table=VERSION_TABLE)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
