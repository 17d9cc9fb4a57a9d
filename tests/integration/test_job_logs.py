"""Job start and end lines: one each per job at INFO, with the ids as ``extra=``
fields a JSON formatter picks up, and no HTTP-client flood under --verbose (issue 13)."""

from __future__ import annotations

import json
import logging

from flask_solidloop.runtime.worker import quiet_noisy_loggers

from ..support.support_app import Assistant


def test_each_job_logs_one_start_and_one_end_line_with_ids(llm, drain, session, caplog):
    llm.script("logs", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    llm.script("3", {"content": "three"})
    loop = Assistant.start(message="logs please")
    with caplog.at_level(logging.INFO, logger="flask_solidloop.jobs"):
        drain()
    records = [r for r in caplog.records if r.name == "flask_solidloop.jobs"]
    starts = [r for r in records if r.getMessage().startswith("job start")]
    ends = [r for r in records if r.getMessage().startswith("job done")]
    assert [r.solidloop_job for r in starts] == ["llm_turn", "tool_call", "llm_turn"]
    assert len(ends) == 3
    for record in starts + ends:
        assert record.solidloop_loop_id == loop.id
        assert record.solidloop_agent == "assistant"
        assert isinstance(record.solidloop_job_id, int)
        assert f"loop={loop.id} agent=assistant" in record.getMessage()
    assert all(r.solidloop_duration_ms >= 0 and r.solidloop_outcome == "done" for r in ends)
    assert ends[1].solidloop_tool_call_id is not None
    assert " in " in ends[0].getMessage() and ends[0].getMessage().endswith("s")
    # The JSON recipe of docs/guides/workers.md serialises those fields as they are.
    from logging import Formatter

    class JsonFormatter(Formatter):
        def format(self, record):
            return json.dumps({"message": record.getMessage(), **{
                k: v for k, v in record.__dict__.items() if k.startswith("solidloop_")}})

    line = json.loads(JsonFormatter().format(ends[0]))
    assert line["solidloop_loop_id"] == loop.id and line["solidloop_job"] == "llm_turn"


def test_verbose_workers_do_not_log_the_http_clients_debug(monkeypatch):
    root = logging.getLogger()
    saved = {name: logging.getLogger(name).level for name in ("httpcore", "httpx", "alembic")}
    monkeypatch.setattr(root, "level", logging.DEBUG)
    try:
        for name in saved:
            logging.getLogger(name).setLevel(logging.NOTSET)
        quiet_noisy_loggers()
        assert not logging.getLogger("httpcore").isEnabledFor(logging.DEBUG)
        # The HTTP client's line per request is the job log's and the wire log's.
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        assert logging.getLogger("httpx").isEnabledFor(logging.WARNING)
        assert not logging.getLogger("alembic").isEnabledFor(logging.INFO)
        assert logging.getLogger("flask_solidloop.jobs").isEnabledFor(logging.DEBUG)
        # SOLIDLOOP_HTTP_DEBUG=1 lets them all through.
        for name in saved:
            logging.getLogger(name).setLevel(logging.NOTSET)
        monkeypatch.setenv("SOLIDLOOP_HTTP_DEBUG", "1")
        quiet_noisy_loggers()
        assert logging.getLogger("httpx").isEnabledFor(logging.DEBUG)
        # A level the host set is its own.
        monkeypatch.delenv("SOLIDLOOP_HTTP_DEBUG")
        logging.getLogger("httpx").setLevel(logging.INFO)
        quiet_noisy_loggers()
        assert logging.getLogger("httpx").isEnabledFor(logging.INFO)
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
