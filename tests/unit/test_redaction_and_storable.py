"""URL redaction (urls.py), secret redaction (llm/redact.py) and storable text/JSON
(loops/storable.py): pure functions."""

from __future__ import annotations

import datetime
import logging

from flask_solidloop.loops import storable
from flask_solidloop.urls import RedactingFilter, redact_url, redact_urls_in


def test_userinfo_and_secret_parameters_are_removed():
    assert redact_url("http://user:s3cret@host:8/p?token=abc&page=2#access_token=x") == \
        "http://user:***@host:8/p?token=***&page=2#access_token=***"
    assert redact_url("https://ghp_0123456789abcdefghij@github.com/x") == \
        "https://***@github.com/x"
    assert redact_url("postgresql+psycopg://postgres@127.0.0.1/db") == \
        "postgresql+psycopg://postgres@127.0.0.1/db"
    assert redact_url("http://h/p?api_key=1&sig=2&Signature=3&x=4&password=") == \
        "http://h/p?api_key=***&sig=***&Signature=***&x=4&password="
    assert redact_url("http://h/plain") == "http://h/plain"


def test_every_url_in_a_text_is_redacted():
    text = ("cannot connect to http://u:pw@127.0.0.1:9/v1 (refused); "
            "see 'https://x.io/m?token=zz' and http://ok/")
    assert redact_urls_in(text) == ("cannot connect to http://u:***@127.0.0.1:9/v1 (refused); "
                                    "see 'https://x.io/m?token=***' and http://ok/")


def test_the_log_filter_covers_arguments_and_tracebacks():
    try:
        raise ValueError("failed at http://u:pw@host/x?key=k")
    except ValueError:
        import sys

        record = logging.LogRecord("httpx", logging.INFO, __file__, 1,
                                   "HTTP Request: %s", ("POST http://u:pw@host/?token=t",),
                                   sys.exc_info())
    assert RedactingFilter().filter(record)
    assert record.getMessage() == "HTTP Request: POST http://u:***@host/?token=***"
    assert "pw" not in record.exc_text and "http://u:***@host/x?key=***" in record.exc_text


def test_text_is_made_storable_and_says_so():
    assert storable.text("a\x00b\ud800c") == ("a\ufffdb\ufffdc", True)
    assert storable.text("fine") == ("fine", False)
    assert storable.text(None) == (None, False)


def test_json_is_made_storable():
    value, altered, unserializable = storable.json_value(
        {"t\x00": ["x\ud800", float("nan"), 1, True, None], 3: {"deep": "ok"}})
    assert value == {"t\ufffd": ["x\ufffd", "nan", 1, True, None], "3": {"deep": "ok"}}
    assert (altered, unserializable) == (True, False)
    value, _, unserializable = storable.json_value({"at": datetime.date(2026, 1, 2)})
    assert value == {"at": "2026-01-02"} and unserializable


def test_structures_deeper_than_python_walks_become_text():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    value, altered, unserializable = storable.json_value(deep)
    assert isinstance(value, str) and altered and unserializable


def test_a_large_body_is_kept_as_an_excerpt_with_size_and_hash():
    small, cut = storable.excerpt({"a": 1}, 100)
    assert small == {"a": 1} and not cut
    big, cut = storable.excerpt("x" * 1000, 100)
    assert cut and big["truncated"] and len(big["excerpt"]) == 100
    assert big["size"] == 1002 and len(big["sha256"]) == 64


def test_secrets_are_redacted_wherever_they_hide_in_a_body():
    from flask_solidloop.llm.redact import REDACTED, redact_secrets

    key = "sk-live-0123456789"
    body = {"messages": [{"role": "user", "content": f"my key is {key}, keep it"}],
            "nested": [[{"deep": key}]], "count": 3, "flag": None}
    redacted = redact_secrets(body, [key])
    assert redacted["messages"][0]["content"] == f"my key is {REDACTED}, keep it"
    assert redacted["nested"][0][0]["deep"] == REDACTED
    assert body["nested"][0][0]["deep"] == key  # the caller's body is left alone
    clean = {"messages": [{"role": "user", "content": "nothing here"}]}
    assert redact_secrets(clean, [key]) == clean
    # A secret JSON would escape (a quote, a backslash, a newline) is still found.
    for odd in ('pa"ss-word-1', "back\\slash-9x", "new\nline-secret"):
        assert redact_secrets({"a": [f"x{odd}y"]}, [odd]) == {"a": [f"x{REDACTED}y"]}
    # Non-ASCII text, and a value JSON cannot encode, on its own.
    assert redact_secrets({"t": f"\u00e9{key}\u00e9"}, [key]) == {"t": f"\u00e9{REDACTED}\u00e9"}
    assert redact_secrets(f"plain {key}", [key]) == f"plain {REDACTED}"


def test_a_summary_keeps_names_numbers_and_usage_and_digests_everything_else():
    import hashlib
    import json

    from flask_solidloop.loops.store.wirelog import SUMMARY, digest, event_payload, summary

    body = {"model": "claude-x", "max_tokens": 100, "stream": True, "temperature": None,
            "system": "You are a secret agent", "messages": [{"role": "user", "content": "hi"}],
            "id": "x" * 201, "usage": {"input_tokens": 3}, "stop_reason": "end_turn"}
    kept = summary(body)
    assert {k: kept[k] for k in ("model", "max_tokens", "stream", "temperature", "usage",
                                 "stop_reason")} == \
        {k: body[k] for k in ("model", "max_tokens", "stream", "temperature", "usage",
                              "stop_reason")}
    encoded = json.dumps(body["messages"], ensure_ascii=False, sort_keys=True,
                         separators=(",", ":"))
    assert kept["messages"] == {"size": 6, "count": 1,
                                "sha256": hashlib.sha256(encoded.encode()).hexdigest()}
    # content-like text, and a name too long to be one, only as size and hash
    assert kept["system"] == {"size": 22, "sha256": hashlib.sha256(
        b'"You are a secret agent"').hexdigest()}
    assert set(kept["id"]) == {"size", "sha256"}
    assert summary("an SSE text") == digest("an SSE text") and summary(None) is None
    payload = event_payload({"url": "u", "request": {"headers": {}, "body": body},
                             "response": {"status": 200, "body": ["chunk"]},
                             "arguments": {"q": "secret"}, "result": {"content": [],
                                                                        "isError": True}},
                            SUMMARY)
    assert payload["detail"] == "summary" and "secret" not in json.dumps(payload)
    assert payload["response"]["body"]["count"] == 1
    assert payload["result"]["isError"] is True and set(payload["arguments"]) == \
        {"size", "sha256"}
