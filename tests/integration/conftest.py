"""Fixtures the integration tests share: the app's solidloop state and broker, and
an independent autocommit connection that sees only what was committed."""

from __future__ import annotations

import psycopg
import pytest

from flask_solidloop.queue.broker import libpq_url


@pytest.fixture
def state(app):
    return app.extensions["solidloop"]


@pytest.fixture
def broker(state):
    return state.broker


@pytest.fixture
def pg(database_url):
    """An independent autocommit connection: sees only what was committed."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        yield conn
