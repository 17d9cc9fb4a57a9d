"""Alembic migrations for the solidloop_* tables, usable two ways.

* Hosts without Alembic: ``flask solidloop db upgrade`` runs these scripts with
  their own version table, ``solidloop_alembic_version``.
* Hosts with Flask-Migrate may instead opt in with
  :func:`configure_flask_migrate`, which adds this directory to Alembic's
  ``version_locations`` as the ``solidloop`` branch, so ``flask db upgrade heads``
  applies it alongside the host's own history. It is opt-in because a second
  head changes how the host's ``flask db upgrade`` / ``migrate`` must be called
  (docs/guides/database.md). Either way, add :func:`include_object` to the
  host's env.py so autogenerate leaves our tables alone.
"""

from __future__ import annotations

import os
from typing import Any

from alembic import command
from alembic.config import Config as AlembicConfig

DIRECTORY = os.path.dirname(os.path.abspath(__file__))
VERSIONS = os.path.join(DIRECTORY, "versions")
VERSION_TABLE = "solidloop_alembic_version"
BRANCH = "solidloop"

__all__ = ["BRANCH", "VERSION_TABLE", "alembic_config", "configure_flask_migrate",
           "current_revision", "downgrade", "head_revision", "include_object", "upgrade"]


def alembic_config(url: str) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", DIRECTORY)
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("version_locations", VERSIONS)
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["solidloop_url"] = url
    return cfg


def upgrade(url: str, revision: str = "heads") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"version_table": VERSION_TABLE}
            )
            return context.get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("postgresql://")).get_current_head()


def configure_flask_migrate(migrate: Any) -> None:
    """Make a Flask-Migrate ``Migrate`` object see our scripts as the ``solidloop`` branch.

    Opt-in: once registered, the host's history has two heads, so the host runs
    ``flask db upgrade heads`` and passes ``--head`` to ``flask db migrate``.
    """
    if getattr(migrate, "_solidloop_configured", False):
        return

    @migrate.configure
    def _add_solidloop_versions(config: AlembicConfig) -> AlembicConfig:
        script_location = config.get_main_option("script_location") or "migrations"
        existing = config.get_main_option("version_locations")
        locations = [existing] if existing else [os.path.join(script_location, "versions")]
        if VERSIONS not in locations:
            locations.append(VERSIONS)
        config.set_main_option("path_separator", "os")
        config.set_main_option("version_locations", os.pathsep.join(locations))
        return config

    migrate._solidloop_configured = True


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic filter for a host's env.py: skip the tables flask-solidloop owns."""
    table_name = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)
    return not (table_name or "").startswith("solidloop_")
