"""A dramatiq ``Results`` backend on PostgreSQL, so ``store_results=True``
actors need no Redis or Memcached.

Results live in ``solidloop_results`` (key, JSONB value, expiry); reads ignore
expired rows and the janitor deletes them. Values go through the backend's
encoder (dramatiq's global one by default) and must come out as JSON, like
messages do. ``init_app`` installs ``Results(backend=PostgresResultBackend(broker))``
on every app's broker, so this is available without configuration::

    @solidloop.actor(store_results=True)
    def add(a, b):
        return a + b

    message = add.send(1, 2)
    message.get_result(backend=solidloop.results_backend(), block=True)
"""

from __future__ import annotations

import json
from typing import Any

import dramatiq
from dramatiq.encoder import Encoder, JSONEncoder
from dramatiq.results import ResultBackend
from dramatiq.results.backend import Missing

from . import sql as jobs_sql
from .broker import PostgresBroker


class PostgresResultBackend(ResultBackend):
    """Stores results through the broker's connection pool (autocommit)."""

    def __init__(self, broker: PostgresBroker, *, namespace: str = "dramatiq-results",
                 encoder: Encoder | None = None) -> None:
        super().__init__(namespace=namespace, encoder=encoder)
        # Without an explicit encoder, follow dramatiq.set_encoder() even when the host
        # calls it after init_app (the base class would freeze the one current now).
        self._encoder = encoder
        self.broker = broker

    @property  # type: ignore[override]
    def encoder(self) -> Encoder:
        return self._encoder if self._encoder is not None else dramatiq.get_encoder()

    @encoder.setter
    def encoder(self, value: Encoder | None) -> None:
        self._encoder = value

    def _get(self, message_key: str) -> Any:
        rows = self.broker._run(jobs_sql.RESULT_GET, (message_key,))
        if not rows:
            return Missing
        value = rows[0][0]
        if type(self.encoder) is JSONEncoder:
            return value
        return self.encoder.decode(json.dumps(value).encode("utf-8"))

    def _store(self, message_key: str, result: Any, ttl: int) -> None:
        data = self.encoder.encode(result)
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else str(data)
        self.broker._run(jobs_sql.RESULT_STORE, (message_key, text, ttl / 1000.0))
