"""SOLIDLOOP_* settings: defaults, validation errors that name key and rule, docs coverage."""

from __future__ import annotations

from pathlib import Path

import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_solidloop import ConfigurationError, SolidLoop
from flask_solidloop.config import SETTINGS, Config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_defaults_match_the_seed():
    config = Config.from_mapping({})
    # Liveness replaced the seed's timeout-derived leases (issue 9): a dead
    # worker's lease lapses after one TTL, not after its read or tool timeout.
    assert config.liveness_ttl == 20.0
    assert config.reaper_interval == 2.0
    assert config.lease_margin == 10
    assert config.queued_reap_threshold == 300
    assert config.default_read_timeout == 600
    assert config.default_tool_timeout == 600
    assert config.lease_leak_grace == 300
    assert config.default_max_duration == 7200
    assert config.llm_retries == 2
    assert config.llm_retry_base_delay == 1.0
    assert config.llm_retry_max_delay == 60.0
    assert 429 in config.llm_retry_statuses and 400 not in config.llm_retry_statuses


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("SOLIDLOOP_LEASE_MARGIN", 0, "> 0"),
    ("SOLIDLOOP_LEASE_MARGIN", -5, "> 0"),
    ("SOLIDLOOP_LEASE_MARGIN", "soon", "positive integer"),
    ("SOLIDLOOP_LEASE_MARGIN", True, "not a bool"),
    ("SOLIDLOOP_QUEUED_REAP_THRESHOLD", 1.5, "positive integer"),
    ("SOLIDLOOP_DEFAULT_READ_TIMEOUT", 0, "> 0"),
    ("SOLIDLOOP_DEFAULT_TOOL_TIMEOUT", None, "positive integer"),
    ("SOLIDLOOP_LEASE_LEAK_GRACE", 0, "> 0"),
    ("SOLIDLOOP_DEFAULT_MAX_DURATION", -1, "> 0"),
    ("SOLIDLOOP_LLM_RETRIES", -1, ">= 0"),
    ("SOLIDLOOP_LLM_RETRY_BASE_DELAY", 0, "> 0"),
    ("SOLIDLOOP_LLM_RETRY_MAX_DELAY", "x", "positive number"),
    ("SOLIDLOOP_LLM_RETRY_STATUSES", [429, 999], "100..599"),
    ("SOLIDLOOP_LLM_RETRY_STATUSES", ["abc"], "status codes"),
    ("SOLIDLOOP_LLM_IO", "asyncio", "'threads' (the default) or 'async'"),
    ("SOLIDLOOP_LLM_MAX_CONNECTIONS", 0, "positive integer"),
    ("SOLIDLOOP_LLM_IO_MAX_INFLIGHT", 0, "positive integer"),
])
def test_invalid_values_name_key_and_rule(key, value, fragment):
    with pytest.raises(ConfigurationError) as info:
        Config.from_mapping({key: value})
    assert info.value.key == key
    assert key in str(info.value) and fragment in str(info.value)


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigurationError, match="did you mean SOLIDLOOP_LEASE_MARGIN"):
        Config.from_mapping({"SOLIDLOOP_LEASE_MARGN": 5})


def test_strings_from_the_environment_are_accepted():
    config = Config.from_mapping({"SOLIDLOOP_LEASE_MARGIN": "30",
                                  "SOLIDLOOP_LLM_RETRY_STATUSES": "429, 503"})
    assert config.lease_margin == 30 and config.llm_retry_statuses == (429, 503)


RETENTIONS = ("SOLIDLOOP_EVENT_RETENTION", "SOLIDLOOP_FINISHED_JOB_RETENTION",
              "SOLIDLOOP_MCP_INBOUND_SESSION_RETENTION", "SOLIDLOOP_LOOP_RETENTION")


def test_retention_is_on_by_default_and_none_keeps_forever():
    """Issue 27: events 30 days, done jobs 7 days, inbound MCP sessions a day, the
    janitor in workers every 5 min; RQ-style TTLs stay RQ's."""
    config = Config.from_mapping({})
    assert config.event_retention == 30 * 86400
    assert config.finished_job_retention == 7 * 86400
    assert config.mcp_inbound_session_retention == 86400
    assert config.janitor_interval == 300.0
    assert (config.job_result_ttl, config.job_failure_ttl) == (500, 365 * 86400)
    # None keeps forever: Python's None in app.config, "none" from an environment
    # variable (what from_prefixed_env reads as a string), null through from_prefixed_env.
    for spelling in (None, "none", " None ", "forever"):
        kept = Config.from_mapping({key: spelling for key in RETENTIONS}
                                   | {"SOLIDLOOP_JOB_RESULT_TTL": spelling,
                                      "SOLIDLOOP_JOB_FAILURE_TTL": spelling})
        assert (kept.event_retention, kept.finished_job_retention,
                kept.mcp_inbound_session_retention) == (None, None, None)
        assert (kept.job_result_ttl, kept.job_failure_ttl) == (-1, -1)
    set_ = Config.from_mapping({key: "3600" for key in RETENTIONS})
    assert set_.event_retention == set_.finished_job_retention == 3600
    assert Config.from_mapping({"SOLIDLOOP_JANITOR_INTERVAL": 0}).janitor_interval == 0.0


def test_loops_are_kept_forever_unless_a_loop_retention_is_set():
    """Decision 0030: SOLIDLOOP_LOOP_RETENTION is off by default, and takes the
    other retentions' forms."""
    config = Config.from_mapping({})
    assert (config.loop_retention, config.loop_purge_batch_size) == (None, 100)
    for spelling in (None, "none", "forever"):
        assert Config.from_mapping({"SOLIDLOOP_LOOP_RETENTION": spelling}).loop_retention is None
    assert Config.from_mapping({"SOLIDLOOP_LOOP_RETENTION": "7776000"}).loop_retention == 7776000
    with pytest.raises(ConfigurationError, match="SOLIDLOOP_LOOP_PURGE_BATCH_SIZE"):
        Config.from_mapping({"SOLIDLOOP_LOOP_PURGE_BATCH_SIZE": 0})


def test_null_from_the_environment_keeps_forever(monkeypatch):
    app = Flask("retention_env")
    monkeypatch.setenv("FLASK_SOLIDLOOP_EVENT_RETENTION", "null")
    monkeypatch.setenv("FLASK_SOLIDLOOP_FINISHED_JOB_RETENTION", "86400")
    app.config.from_prefixed_env()
    config = Config.from_mapping(app.config)
    assert config.event_retention is None and config.finished_job_retention == 86400


@pytest.mark.parametrize("key", RETENTIONS)
@pytest.mark.parametrize("value", [0, -1, "", "a week", 1.5, True])
def test_a_bad_retention_names_the_key_and_how_to_keep_forever(key, value):
    with pytest.raises(ConfigurationError) as info:
        Config.from_mapping({key: value})
    message = str(info.value)
    assert info.value.key == key and "\n" not in message
    assert message.startswith(f"{key}={value!r} is invalid: must be seconds > 0, or None to "
                              f"keep forever"), message
    assert '"none"' in message


@pytest.mark.parametrize("value", [-2, "", "soon", True])
def test_a_bad_ttl_names_minus_one_and_none(value):
    with pytest.raises(ConfigurationError, match=r"-1 or None to keep forever"):
        Config.from_mapping({"SOLIDLOOP_JOB_RESULT_TTL": value})


def test_the_job_lease_follows_the_liveness_ttl_unless_set():
    assert Config.from_mapping({}).job_lease_seconds == 20.0
    assert Config.from_mapping({"SOLIDLOOP_LIVENESS_TTL": 4}).job_lease_seconds == 4.0
    assert Config.from_mapping({"SOLIDLOOP_LIVENESS_TTL": 4,
                                "SOLIDLOOP_JOB_LEASE": 9}).job_lease_seconds == 9.0
    assert Config.from_mapping({"SOLIDLOOP_REAPER_INTERVAL": 0}).reaper_interval == 0.0
    with pytest.raises(ConfigurationError, match="SOLIDLOOP_LIVENESS_TTL"):
        Config.from_mapping({"SOLIDLOOP_LIVENESS_TTL": 0})


@pytest.mark.parametrize("url", ["postgresql+psycopg2://u:hunter2@127.0.0.1/x",
                                 "postgresql+asyncpg://u:hunter2@127.0.0.1/x"])
def test_init_app_needs_the_psycopg3_driver(url):
    app = Flask("bad_driver")
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    # Not bound to the app: the URL is refused before any engine is made (an
    # engine would import the driver, which is not installed here).
    db = SQLAlchemy()
    with pytest.raises(ConfigurationError, match=r"postgresql\+psycopg://") as info:
        SolidLoop(app, db)
    assert "hunter2" not in str(info.value)


def test_a_bare_postgresql_url_is_taken_where_sqlalchemy_reads_it_as_psycopg3():
    """SQLAlchemy 2.1 made psycopg 3 the driver of a bare ``postgresql://`` URL;
    2.0 reads it as psycopg2, and the URL is refused there."""
    import sqlalchemy

    app = Flask("bare_url")
    app.config["SQLALCHEMY_DATABASE_URI"] = "postgresql://u:hunter2@127.0.0.1/x"
    version = tuple(int(p) for p in sqlalchemy.__version__.split(".")[:2])
    if version >= (2, 1):
        SolidLoop(app, SQLAlchemy())
    else:
        with pytest.raises(ConfigurationError, match=r"postgresql\+psycopg://"):
            SolidLoop(app, SQLAlchemy())


def test_every_setting_is_documented():
    text = DOCS.read_text()
    missing = [s.key for s in SETTINGS if f"`{s.key}`" not in text]
    assert not missing, f"undocumented settings: {missing}"


def test_the_trace_url_must_place_the_trace_id():
    assert Config.from_mapping({}).trace_url is None
    assert Config.from_mapping({"SOLIDLOOP_OTEL_CAPTURE_CONTENT": "on"}).otel_capture_content
    url = "https://tempo.example/trace/{trace_id}"
    assert Config.from_mapping({"SOLIDLOOP_TRACE_URL": url}).trace_url == url
    with pytest.raises(ConfigurationError, match=r"\{trace_id\}"):
        Config.from_mapping({"SOLIDLOOP_TRACE_URL": "https://tempo.example/trace/"})
