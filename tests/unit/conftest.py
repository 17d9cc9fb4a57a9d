"""Unit tests: no database and no network at all, not even a 127.0.0.1 socket.

They must pass with PostgreSQL stopped. An autouse guard enforces it: for the
duration of each unit test (its fixtures included) every socket connect
(``socket.socket.connect`` / ``connect_ex``, whatever the address family) and
every psycopg connection (``psycopg.connect``, ``Connection.connect``,
``AsyncConnection.connect``; libpq opens its own sockets, out of Python's sight)
raises :class:`NetworkInUnitTest`. Each attempt is also recorded, and a test
that made one but did not fail from it fails at teardown, so code that swallows
the exception (a retry loop, a background thread, ``except Exception``) cannot
hide it.

The database and LLM emulator fixtures of tests/conftest.py are overridden here
so that a unit test asking for ``database_url``, ``llm``, ``app``, ``session`` or
``drain`` fails with the same message instead of creating the session database
(or calling ``pytest.exit`` when PostgreSQL is down). A test that needs any of
them belongs in tests/integration.
"""

from __future__ import annotations

import socket

import psycopg
import pytest

HINT = ("unit tests must not touch the network or the database; "
        "move this test to tests/integration")


class NetworkInUnitTest(RuntimeError):
    """A unit test tried to open a socket or a database connection."""


#: Set when a unit test's setup or call already failed, so the teardown check
#: does not report the same attempt twice.
ALREADY_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and report.when in ("setup", "call"):
        item.stash[ALREADY_FAILED] = True
    return report


@pytest.fixture(autouse=True)
def no_network_or_database(request, monkeypatch):
    attempts: list[str] = []

    def refuse(what: str):
        attempts.append(what)
        raise NetworkInUnitTest(f"{HINT} (tried {what})")

    def connect(self, address):
        refuse(f"socket connect to {address!r}")

    def connect_ex(self, address):
        refuse(f"socket connect_ex to {address!r}")

    def pg_connect(*args, **kwargs):
        refuse("psycopg.connect")

    async def pg_connect_async(*args, **kwargs):
        refuse("psycopg.AsyncConnection.connect")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(psycopg, "connect", pg_connect)
    monkeypatch.setattr(psycopg.Connection, "connect", pg_connect)
    monkeypatch.setattr(psycopg.AsyncConnection, "connect", pg_connect_async)
    yield
    if attempts and not request.node.stash.get(ALREADY_FAILED, False):
        pytest.fail(f"{HINT}; attempted: " + "; ".join(attempts), pytrace=False)


def _refuse_fixture(name: str):
    @pytest.fixture(name=name)
    def refused():
        pytest.fail(f"{HINT} (asked for the {name!r} fixture)", pytrace=False)

    return refused


database_url = _refuse_fixture("database_url")
llm = _refuse_fixture("llm")
