"""The SOLIDLOOP_* settings: their names, defaults and validation rules.

One table (:data:`SETTINGS`) is the single source of truth; docs/configuration.md
documents every entry and a test checks the two agree. Values are read once, at
``init_app``, into an immutable :class:`Config`; an invalid value raises
:class:`~flask_solidloop.errors.ConfigurationError` naming the key and the rule.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from .errors import ConfigurationError

QUEUE_LLM = "solidloop_llm"
QUEUE_TOOL = "solidloop_tool"
QUEUE_MAINTENANCE = "solidloop_maintenance"
QUEUES = (QUEUE_LLM, QUEUE_TOOL, QUEUE_MAINTENANCE)
#: The host's queue that every app's broker declares, so every worker consumes it
#: and ``drain()`` runs it even when nothing declared it at import: RQ's and
#: dramatiq's default name (docs/decisions/0020-host-queues-by-default.md).
QUEUE_DEFAULT = "default"
#: Queue names starting with this belong to flask-solidloop; a host's may not.
RESERVED_QUEUE_PREFIX = "solidloop_"


def _integer(key: str, value: Any, *, minimum: int) -> int:
    rule = ("must be a positive integer (> 0)" if minimum == 1
            else f"must be an integer >= {minimum}")
    if isinstance(value, bool):
        raise ConfigurationError(key, value, f"{rule}, not a bool")
    try:
        number = int(value)
        exact = number == float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(key, value, rule) from None
    if not exact or number < minimum:
        raise ConfigurationError(key, value, rule)
    return number


#: SOLIDLOOP_LLM_IO's values.
LLM_IO_MODES = ("threads", "async")


def _llm_io(key: str, value: Any) -> str:
    text = str(value).strip().lower() if value is not None else ""
    if text not in LLM_IO_MODES:
        raise ConfigurationError(key, value, "must be 'threads' (the default) or 'async'")
    return text


def _positive_int(key: str, value: Any) -> int:
    return _integer(key, value, minimum=1)


def _non_negative_int(key: str, value: Any) -> int:
    return _integer(key, value, minimum=0)


def _optional_positive_int(key: str, value: Any) -> int | None:
    if value is None or value == "":
        return None
    return _positive_int(key, value)


#: The prices of a SOLIDLOOP_PRICES entry, per million tokens (llm/pricing.py bills them).
PRICE_KEYS = ("input", "cached_input", "output")


def parse_prices(key: str, value: Any) -> dict[str, dict[str, Decimal]]:
    if value is None or value == "":
        return {}
    if not isinstance(value, dict):
        raise ConfigurationError(key, value, "must be a dict of model -> {input, output, ...}")
    table: dict[str, dict[str, Decimal]] = {}
    for model, prices in value.items():
        if not isinstance(prices, dict):
            raise ConfigurationError(key, value, f"prices for {model!r} must be a dict")
        unknown = set(prices) - set(PRICE_KEYS)
        if unknown or "input" not in prices or "output" not in prices:
            raise ConfigurationError(
                key, value,
                f"prices for {model!r} need input and output (per million tokens), optionally "
                f"cached_input; got keys {sorted(prices)}",
            )
        try:
            parsed = {k: Decimal(str(v)) for k, v in prices.items()}
        except ArithmeticError:
            raise ConfigurationError(key, value, f"prices for {model!r} must be numbers") from None
        if any(v < 0 for v in parsed.values()):
            raise ConfigurationError(key, value, f"prices for {model!r} must be >= 0")
        parsed.setdefault("cached_input", parsed["input"])
        table[str(model)] = parsed
    return table



def _prices(key: str, value: Any) -> dict[str, Any]:
    return parse_prices(key, value)


def _subject_budget(key: str, value: Any) -> Any:
    from .limit_spec import subject_budget_setting

    return subject_budget_setting(key, value)


def _rate_limits(key: str, value: Any) -> Any:
    from .limit_spec import rate_limits_setting

    return rate_limits_setting(key, value)


def _port(key: str, value: Any) -> int:
    port = _integer(key, value, minimum=1)
    if port > 65535:
        raise ConfigurationError(key, value, "must be a TCP port (1-65535)")
    return port


def _host(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(key, value, "must be a non-empty address (e.g. 127.0.0.1)")
    return value.strip()


def _optional_path(key: str, value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str | os.PathLike):
        raise ConfigurationError(key, value, "must be a directory path, or unset")
    return os.fspath(value)


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(key, value, "must be a bool (true/false, 1/0, yes/no, on/off)")


def _oauth_keys(key: str, value: Any) -> tuple[str, ...]:
    """Fernet keys, newest first (a list or comma-separated): the first encrypts,
    any decrypts, so a key is rotated by putting a new one in front."""
    if value is None or value == "":
        return ()
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not items:
        raise ConfigurationError(key, "<redacted>", "must be a Fernet key (or a list, newest "
                                 "first); make one with `python -c 'from cryptography.fernet "
                                 "import Fernet; print(Fernet.generate_key().decode())'`")
    from cryptography.fernet import Fernet

    keys = []
    for item in items:
        text = item.decode() if isinstance(item, bytes) else str(item).strip()
        try:
            Fernet(text)
        except (ValueError, TypeError):
            # Never echo the value: it is a secret.
            raise ConfigurationError(
                key, "<redacted>", "is not a Fernet key (32 url-safe base64 bytes); make one "
                "with `python -c 'from cryptography.fernet import Fernet; "
                "print(Fernet.generate_key().decode())'`") from None
        keys.append(text)
    return tuple(keys)


def _sign_in_url(key: str, value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or "{server}" not in value:
        raise ConfigurationError(key, value, "must be a URL template containing {server} (and "
                                 "optionally {subject}), e.g. 'https://app.example/solidloop/"
                                 "oauth/{server}/sign-in?subject={subject}', or None")
    return value


def _trace_url(key: str, value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or "{trace_id}" not in value:
        raise ConfigurationError(key, value, "must be a URL template containing {trace_id}, "
                                 "e.g. 'https://tempo.example/trace/{trace_id}', or None")
    return value


def _non_negative_float(key: str, value: Any) -> float:
    if value in (0, "0", 0.0):
        return 0.0
    return _positive_float(key, value)


def _positive_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigurationError(key, value, "must be a positive number, not a bool")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(key, value, "must be a positive number") from None
    if number <= 0:
        raise ConfigurationError(key, value, "must be a positive number, > 0")
    return number


def _optional_positive_float(key: str, value: Any) -> float | None:
    if value is None or value == "":
        return None
    return _positive_float(key, value)


#: Seconds in a day, the unit of the retention defaults.
DAY = 24 * 3600

#: How a retention or TTL setting is told to keep rows forever from a string
#: (an environment variable): Python's None is accepted as is.
FOREVER_WORDS = ("none", "forever")


def _keeps_forever(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in FOREVER_WORDS)


def _retention(key: str, value: Any) -> int | None:
    """Seconds to keep rows, or None to keep them forever."""
    if _keeps_forever(value):
        return None
    rule = ('must be seconds > 0, or None to keep forever (from an environment '
            'variable: "none", or null through app.config.from_prefixed_env)')
    if isinstance(value, bool) or value == "":
        raise ConfigurationError(key, value, rule)
    try:
        return _positive_int(key, value)
    except ConfigurationError:
        raise ConfigurationError(key, value, rule) from None


def _ttl_seconds(key: str, value: Any) -> int:
    """Seconds, or -1 to keep forever (RQ's spelling; None means the same)."""
    if _keeps_forever(value):
        return -1
    rule = ('must be seconds >= 0, or -1 or None to keep forever (from an environment '
            'variable: "none", or null through app.config.from_prefixed_env)')
    if isinstance(value, bool) or value == "":
        raise ConfigurationError(key, value, rule)
    try:
        return _integer(key, value, minimum=-1)
    except ConfigurationError:
        raise ConfigurationError(key, value, rule) from None


def _status_list(key: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        value = [part for part in value.replace(",", " ").split() if part]
    try:
        statuses = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigurationError(key, value, "must be a list of HTTP status codes") from None
    bad = [s for s in statuses if not 100 <= s <= 599]
    if bad:
        raise ConfigurationError(key, value, f"HTTP status codes lie in 100..599; got {bad}")
    return statuses



def _admin_stream_seconds(key: str, value: Any) -> float:
    number = _positive_float(key, value)
    if number > 60:
        raise ConfigurationError(key, value, "must be at most 60 seconds, so a stream never "
                                             "pins a WSGI thread")
    return number


#: SOLIDLOOP_WIRE_LOG's values: bodies kept (up to SOLIDLOOP_EVENT_BODY_LIMIT), or not.
WIRE_LOG_DETAILS = ("full", "summary")


def _wire_log(key: str, value: Any) -> str:
    text = str(value).strip().lower() if isinstance(value, str) else value
    if text not in WIRE_LOG_DETAILS:
        raise ConfigurationError(key, value, "must be 'full' (bodies kept) or 'summary' "
                                             "(metadata, sizes and SHA-256 only)")
    return str(text)


def _origins(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [part for part in value.replace(",", " ").split() if part]
    try:
        origins = tuple(str(v).rstrip("/") for v in value)
    except TypeError:
        raise ConfigurationError(key, value, "must be a list of origins "
                                             "(scheme://host[:port])") from None
    bad = [o for o in origins if not o.startswith(("http://", "https://")) or "/" in o[8:]]
    if bad:
        raise ConfigurationError(key, value, f"origins look like https://host[:port], no path; "
                                             f"got {bad[0]!r}")
    return origins


@dataclass(frozen=True)
class Setting:
    key: str
    default: Any
    parse: Callable[[str, Any], Any]
    doc: str


SETTINGS: tuple[Setting, ...] = (
    Setting("SOLIDLOOP_LIVENESS_TTL", 20.0, _positive_float,
            "Seconds a running LLM turn, tool call or claimed job stays leased without a "
            "heartbeat. Each worker process's renewer re-stamps its leases every TTL/4, so a "
            "worker that is alive (however slow) keeps its work and a dead or frozen one loses "
            "it after one TTL."),
    Setting("SOLIDLOOP_REAPER_INTERVAL", 2.0, _non_negative_float,
            "Seconds between reaper passes run inside worker processes (one pass at a time "
            "across the fleet: one leading process runs them); 0 turns the in-worker reaper off."),
    Setting("SOLIDLOOP_LEASE_MARGIN", 10, _positive_int,
            "Seconds a tool call or tool phase that no worker holds may wait for its job before "
            "the reaper enqueues it again."),
    Setting("SOLIDLOOP_QUEUED_REAP_THRESHOLD", 300, _positive_int,
            "A loop queued longer than this with no live job is re-enqueued by the reaper."),
    Setting("SOLIDLOOP_DEFAULT_READ_TIMEOUT", 600, _positive_int,
            "Read timeout (silence allowed between reads) for agents whose llm config sets none."),
    Setting("SOLIDLOOP_DEFAULT_TOOL_TIMEOUT", 600, _positive_int,
            "Longest a call to an in-process tool may run when neither the tool (timeout=) "
            "nor its mcps entry sets one: past it the model gets a timeout error and the "
            "tool is abandoned in a quarantined thread. It also bounds the lease renewer: "
            "past it (or a remote server's longer timeout) plus SOLIDLOOP_LEASE_LEAK_GRACE "
            "a call's lease is no longer renewed."),
    Setting("SOLIDLOOP_MAX_HISTORY_BYTES", 32 * 1024 * 1024, _optional_positive_int,
            "Size of a loop's history (its text, in characters: a byte each for ASCII) past "
            "which its next LLM turn is not sent and the loop fails, naming both sizes; "
            "unset (None) for no cap."),
    Setting("SOLIDLOOP_TOOL_QUARANTINE_LIMIT", 8, _positive_int,
            "Abandoned tool threads (tools that never returned after their timeout) one "
            "worker process keeps before it asks dramatiq to restart its worker processes, "
            "the only way to reclaim what they hold."),
    Setting("SOLIDLOOP_TOOL_MAX_ATTEMPTS", 3, _positive_int,
            "Runs of one tool call whose lease lapsed before it finished (its worker died, "
            "froze or hung) after which it is not run again: the model gets an error naming "
            "the attempts."),
    Setting("SOLIDLOOP_LEASE_LEAK_GRACE", 300, _positive_int,
            "Grace added to an agent's max_duration to form the lease renewer's leak ceiling."),
    Setting("SOLIDLOOP_DEFAULT_MAX_DURATION", 7200, _positive_int,
            "max_duration (seconds) for agents that declare none."),
    Setting("SOLIDLOOP_LLM_RETRIES", 2, _non_negative_int,
            "Re-sends of a transient LLM failure on top of the first attempt; 0 disables."),
    Setting("SOLIDLOOP_LLM_RETRY_BASE_DELAY", 1.0, _positive_float,
            "Backoff base in seconds: attempt N waits base * 2**(N-1)."),
    Setting("SOLIDLOOP_LLM_RETRY_MAX_DELAY", 60.0, _positive_float,
            "Ceiling on any single retry wait, a server's Retry-After included."),
    Setting("SOLIDLOOP_LLM_RETRY_STATUSES", (408, 409, 429, 500, 502, 503, 504, 529), _status_list,
            "HTTP statuses that count as transient and are retried."),
    Setting("SOLIDLOOP_LLM_MAX_CONNECTIONS", None, _optional_positive_int,
            "Connections a worker process opens to one LLM provider origin at most; requests "
            "beyond wait for a free one (SOLIDLOOP_LLM_POOL_TIMEOUT). Unset: the process's "
            "concurrency (its worker threads, or SOLIDLOOP_LLM_IO_MAX_INFLIGHT in async mode), "
            "at least 100."),
    Setting("SOLIDLOOP_LLM_POOL_TIMEOUT", 30.0, _positive_float,
            "Seconds an LLM request waits for a free connection of its origin's pool; past it "
            "the attempt is retried like a connection that never opened (nothing was sent)."),
    Setting("SOLIDLOOP_LLM_IO", "threads", _llm_io,
            "How a worker process waits on its LLM calls: 'threads' (each call holds its worker "
            "thread) or 'async' (the turn thread hands the HTTP exchange to the process's "
            "asyncio loop and takes other jobs; a few commit threads end the turns)."),
    Setting("SOLIDLOOP_LLM_IO_MAX_INFLIGHT", 1000, _positive_int,
            "Async mode: LLM calls one worker process keeps in flight at most; a turn thread "
            "that finds them all taken waits for one to end before it hands its request over."),
    Setting("SOLIDLOOP_LLM_IO_COMMIT_THREADS", 4, _positive_int,
            "Async mode: threads per worker process that end the turns whose responses arrived "
            "(and write their streamed partial text); each holds a database connection while "
            "it writes."),
    Setting("SOLIDLOOP_JOB_LEASE", None, _optional_positive_int,
            "Seconds a claimed job may stay unacknowledged before the broker redelivers it; "
            "renewed while the worker holds it. Unset (the default): the liveness TTL."),
    Setting("SOLIDLOOP_JOB_MAX_RETRIES", 3, _non_negative_int,
            "dramatiq retries of a job whose actor raised, before it is dead-lettered."),
    Setting("SOLIDLOOP_JOB_MAX_DELIVERIES", 10, _positive_int,
            "Deliveries whose holder died (lease expired unacknowledged) before a job is "
            "presumed poisonous and dead-lettered."),
    Setting("SOLIDLOOP_CONTINUATION_FIRST", True, _bool,
            "Workers claim the next steps of started loops (their tool calls, their next LLM "
            "turn) before the first turns of new loops, so started loops finish first when "
            "workers are saturated; False claims every job in the order it became due."),
    Setting("SOLIDLOOP_FIRST_TURN_MAX_WAIT", 30, _positive_int,
            "Continuation-first's starvation bound: a new loop's first turn (or a host job) "
            "waiting longer than this many seconds is claimed by age with the continuations."),
    Setting("SOLIDLOOP_FAIR_SHARE_QUANTUM", 0.5, _non_negative_float,
            "Fair shares: seconds a job's place in the claim order moves back per loop its "
            "subject had in flight or queued when its loop was created (the loop's fair "
            "rank), so the loops of a subject with fewer loops go first when workers are "
            "saturated; a job ranked r waits at most r times this behind jobs enqueued after "
            "it. 0 turns fairness off (claims by due time alone)."),
    Setting("SOLIDLOOP_MAX_CONCURRENT_PER_SUBJECT", None, _optional_positive_int,
            "Loops of one subject in flight at once (started, not ended: running, waiting, or "
            "queued after their first turn); a loop whose first turn would pass it is held, "
            "holding no thread, lease or connection, until one of the subject's loops leaves "
            "flight. Unset (the default): no cap."),
    Setting("SOLIDLOOP_HELD_LOOP_RECHECK", 15.0, _positive_float,
            "Seconds after which a loop held by a concurrency cap tries again even if no "
            "wake-up came (the safety net under the wake-up a leaving loop sends)."),
    Setting("SOLIDLOOP_INLINE_CONTINUATION", True, _bool,
            "The worker thread that commits a loop's turn runs the loop's next step itself "
            "(a tool call, the next LLM turn) instead of waking another consumer: the turn's "
            "commit writes that step's claim (the call's lease, the next turn's LLM lease) in "
            "place of a job, and recovery follows that lease as for any claimed step. False: "
            "every step is a job that goes through a consumer."),
    Setting("SOLIDLOOP_INLINE_MAX_HOPS", 32, _positive_int,
            "Jobs one worker thread runs inline after a delivered job before it hands the "
            "loop's next job back to the queue (so a long loop yields its thread now and then)."),
    Setting("SOLIDLOOP_POLL_INTERVAL", 1.0, _positive_float,
            "Seconds between a consumer's looks at the job table while its process's "
            "LISTEN connection is down (or not LISTENing on its queue yet)."),
    Setting("SOLIDLOOP_IDLE_POLL_INTERVAL", 30.0, _positive_float,
            "Seconds between a consumer's looks at the job table while its process's LISTEN "
            "connection hears its queue: every enqueue notifies (delayed jobs too), so this "
            "is only a safety net; never below SOLIDLOOP_POLL_INTERVAL."),
    Setting("SOLIDLOOP_DATABASE_URL", None, lambda _k, v: v,
            "The URL of the connections the extension opens itself, which keep a session "
            "(the broker's pool and consumers, LISTEN, lease renewer, worker registry): the same "
            "database as SQLALCHEMY_DATABASE_URI, reached directly or through a session-mode "
            "pooler. Defaults to SQLALCHEMY_DATABASE_URI."),
    Setting("SOLIDLOOP_POOLER_CHECK", True, _bool,
            "Worker processes check at start that SOLIDLOOP_DATABASE_URL does not go through "
            "a transaction-mode pooler, and that an engine behind one does not prepare "
            "statements, and refuse to start otherwise; False skips the check."),
    Setting("SOLIDLOOP_EVENT_RETENTION", 30 * DAY, _retention,
            "Seconds to keep wire-log events (30 days); events of a loop that has not "
            "ended are kept whatever their age. None keeps every event forever."),
    Setting("SOLIDLOOP_FINISHED_JOB_RETENTION", 7 * DAY, _retention,
            "Seconds to keep done jobs in the job table (7 days); None keeps them forever. "
            "Queued, running and dead-lettered jobs, and the jobs of a loop that has not "
            "ended, are never pruned."),
    Setting("SOLIDLOOP_LOOP_RETENTION", None, _retention,
            "Seconds to keep a loop after it ended (completed or failed, by finished_at), "
            "with its messages, tool calls, wire-log and stream events; None (the default) "
            "keeps every loop forever. A loop that has not ended, or that a live job or tool "
            "lease still needs, is never deleted."),
    Setting("SOLIDLOOP_LOOP_PURGE_BATCH_SIZE", 100, _positive_int,
            "Ended loops the janitor deletes per transaction, each with all its rows."),
    Setting("SOLIDLOOP_JANITOR_BATCH_SIZE", 1000, _positive_int,
            "Rows the janitor deletes per statement, so no sweep holds a long lock."),
    Setting("SOLIDLOOP_JANITOR_INTERVAL", 300.0, _non_negative_float,
            "Seconds between janitor sweeps run inside worker processes (one sweep per "
            "interval across all workers); 0 turns the in-worker janitor off."),
    Setting("SOLIDLOOP_ROLLUP_INTERVAL", 60.0, _non_negative_float,
            "Seconds between passes of the admin charts' rollup (per-minute turn figures) "
            "inside worker processes, run by one leader; 0 turns it off in workers."),
    Setting("SOLIDLOOP_ROLLUP_RETENTION", 8 * DAY, _retention,
            "Seconds to keep the charts' per-minute and per-hour figures (8 days: the "
            "7-day charts and a day more); None keeps them forever."),
    Setting("SOLIDLOOP_STREAM_UPDATE_INTERVAL", 10.0, _positive_float,
            "Seconds between flushes of a streaming turn's text (its deltas, or its partial "
            "text on the hidden shell) while nobody watches its loop (a watcher's arrival "
            "flushes at once)."),
    Setting("SOLIDLOOP_OBSERVED_STREAM_UPDATE_INTERVAL", 0.25, _positive_float,
            "Seconds between partial-text writes onto the hidden shell while the loop is "
            "watched, when text deltas are off (SOLIDLOOP_STREAM_MAX_HZ = 0)."),
    Setting("SOLIDLOOP_STREAM_MAX_HZ", 20.0, _non_negative_float,
            "Most events per second a streaming turn writes while someone watches its loop "
            "(deltas are coalesced to this rate); 0 turns text deltas off (partial text "
            "then goes onto the hidden shell every SOLIDLOOP_STREAM_UPDATE_INTERVAL)."),
    Setting("SOLIDLOOP_STREAM_SECONDS", 30.0, _admin_stream_seconds,
            "Longest a stream of sse_response() stays open before it ends and the browser "
            "reconnects with Last-Event-ID; at most 60, so a stream never pins a WSGI thread."),
    Setting("SOLIDLOOP_STREAM_HEARTBEAT", 5.0, _positive_float,
            "Seconds between heartbeats of a stream (events() and sse_response()); each "
            "heartbeat also reads the loop's events, so a lost notification costs at most one."),
    Setting("SOLIDLOOP_ADMIN_STREAM_SECONDS", 30.0, _admin_stream_seconds,
            "Longest an admin live stream (SSE) stays open before it ends and the browser "
            "reconnects with Last-Event-ID; at most 60, so a stream never pins a WSGI thread."),
    Setting("SOLIDLOOP_ADMIN_HEARTBEAT", 5.0, _positive_float,
            "Seconds between heartbeats (and state polls) of an admin live stream."),
    Setting("SOLIDLOOP_ADMIN_TRUSTED_ORIGINS", (), _origins,
            "Extra origins (scheme://host[:port]) the admin accepts unsafe requests from, "
            "e.g. the public origin a reverse proxy serves it under."),
    Setting("SOLIDLOOP_ADMIN_BULK_BATCH", 100, _positive_int,
            "Loops a bulk admin action changes per batch (each loop in its own transaction)."),
    Setting("SOLIDLOOP_ADMIN_BULK_LIMIT", 10000, _positive_int,
            "Most loops one bulk admin action may act on; a larger set must be narrowed."),
    Setting("SOLIDLOOP_ADMIN_COUNT_BUDGET", 0.1, _positive_float,
            "Seconds the admin's loop list may spend counting the filtered loops exactly; "
            "past it the list shows the planner's estimate, as \"about N\"."),
    Setting("SOLIDLOOP_PRICES", None, _prices,
            "Price table: model -> {input, cached_input, output} per million tokens."),
    Setting("SOLIDLOOP_SUBJECT_BUDGET", None, _subject_budget,
            "Every subject's budget over a rolling window: {\"cost_usd\": 5.0, \"window\": "
            "86400} (any of cost_usd, tokens, llm_turns, tool_calls; window in seconds, "
            "default a day); a subject_budget hook replaces it. None: no subject budget."),
    Setting("SOLIDLOOP_SPEND_RETENTION", 31 * DAY, _positive_int,
            "Seconds a subject's budget ledger rows are kept by the janitor (at least the "
            "subject budget's window; longer keeps spend history for reports)."),
    Setting("SOLIDLOOP_RATE_LIMITS", None, _rate_limits,
            "Rate limits shared by every worker: {\"<origin> [<model>]\": {\"rpm\": ..., "
            "\"tpm\": ..., \"rps\": ...}, \"tool:<name>\": {\"per_second\": ..., "
            "\"per_minute\": ...}}; a key with {} only shares the provider's Retry-After."),
    Setting("SOLIDLOOP_RATE_LIMIT_INLINE_WAIT", 0.5, _non_negative_float,
            "Longest wait for rate-limit capacity a turn sleeps through on its thread; a "
            "longer one defers the turn (its job due at its slot, holding nothing)."),
    Setting("SOLIDLOOP_RATE_LIMIT_HORIZON", 10.0, _positive_float,
            "How far ahead a deferred LLM turn may reserve its slot, in seconds; a turn "
            "whose slot would be later reserves nothing and comes back when it is nearer, "
            "so capacity that settlements give back goes to it."),
    Setting("SOLIDLOOP_DEFAULT_OUTPUT_ESTIMATE", 1024, _positive_int,
            "Output tokens a budget or rate limit reserves for a request that names no "
            "max_tokens (the estimate is settled to the real usage after the answer)."),
    Setting("SOLIDLOOP_TOOL_OUTPUT_LIMIT", 20000, _positive_int,
            "Characters of a tool result shown to the model; the full result is kept."),
    Setting("SOLIDLOOP_EVENT_BODY_LIMIT", 65536, _positive_int,
            "Characters of a request, response or tool result kept in a wire-log event; a "
            "larger body is kept as an excerpt with its size and SHA-256 (a tool's full "
            "result stays on its tool call)."),
    Setting("SOLIDLOOP_WIRE_LOG", "full", _wire_log,
            "How much of each exchange the wire log keeps: 'full' keeps the request and "
            "response bodies (each up to SOLIDLOOP_EVENT_BODY_LIMIT); 'summary' keeps their "
            "metadata (URL, headers, model, status, attempts, timings, token usage) and each "
            "body part's size and SHA-256, no text. The conversation stays whole on the "
            "loop's messages and tool calls either way."),
    Setting("SOLIDLOOP_EVENT_REPEAT_HISTORY", False, _bool,
            "Keep each LLM request's whole conversation in its wire-log event. By default an "
            "event keeps the conversation from the model's last answer on, and the count "
            "and SHA-256 of the earlier part (which earlier events and the loop's messages "
            "hold)."),
    Setting("SOLIDLOOP_MCP_INBOUND_SESSION_RETENTION", DAY, _retention,
            "Seconds to keep the sessions outside MCP clients opened with an MCP server "
            "blueprint (a day), counted from their creation, with their wire-log events; "
            "None keeps them forever."),
    Setting("SOLIDLOOP_MCP_MAX_REQUEST_BODY", 4 * 1024 * 1024, _positive_int,
            "Largest request body (bytes) an MCP server blueprint accepts; a larger one is "
            "answered 413 before it is read."),
    Setting("SOLIDLOOP_JOB_RESULT_TTL", 500, _ttl_seconds,
            "Seconds an RQ-style job and its return value are kept after it finished, when "
            "enqueue() passes no result_ttl (RQ's default, 500); -1 keeps them forever."),
    Setting("SOLIDLOOP_JOB_FAILURE_TTL", 365 * 24 * 3600, _ttl_seconds,
            "Seconds a failed RQ-style job and its traceback are kept, when enqueue() passes "
            "no failure_ttl (RQ's default, a year); -1 keeps them forever."),
    Setting("SOLIDLOOP_WORKER_HEARTBEAT", 10.0, _positive_float,
            "Seconds between a worker process's heartbeats in the worker registry "
            "(solidloop_workers); a worker silent for three heartbeats is reported lost."),
    Setting("SOLIDLOOP_WORKER_RETENTION", 86400, _positive_int,
            "Seconds a stopped or lost worker stays in the registry (`flask solidloop "
            "workers` shows it as recently dead) before its row is deleted."),
    Setting("SOLIDLOOP_APPROVAL_TIMEOUT", None, _optional_positive_float,
            "Seconds a tool call waits for an approval before its timeout decides (deny, or "
            "the tool's on_timeout), for tools that set no approval_timeout= of their own; "
            "unset (the default): an approval waits for ever."),
    Setting("SOLIDLOOP_MAX_AGENT_DEPTH", 5, _positive_int,
            "How many ancestors a child agent's loop may have: a child agent started "
            "deeper is refused, and the parent's tool call gets that refusal as its error "
            "result (docs/guides/conversations.md)."),
    Setting("SOLIDLOOP_PROVIDER_OUTAGE_MAX_WAIT", 900.0, _positive_float,
            "Seconds a loop waits out its provider's outage (it cannot be reached, or "
            "answers 429/502/503/504/529 past the request's retries): the turn is deferred, "
            "5 s doubling to 60 s, holding nothing, and fails only once the outage has "
            "lasted this long."),
    Setting("SOLIDLOOP_DATABASE_RETRY_SECONDS", 30.0, _positive_float,
            "Seconds a turn's end or a tool's outcome is retried in place when the database "
            "fails under it (while the step still holds its lease), before the step is left "
            "to its lease and the reaper."),
    Setting("SOLIDLOOP_METRICS", False, _bool,
            "Worker processes record Prometheus metrics (multiprocess mode) and one "
            "process per host serves them on SOLIDLOOP_METRICS_HOST:SOLIDLOOP_METRICS_PORT; "
            "needs the metrics extra (prometheus-client)."),
    Setting("SOLIDLOOP_METRICS_PORT", 9191, _port,
            "The port of the workers' metrics endpoint (one per host)."),
    Setting("SOLIDLOOP_METRICS_HOST", "127.0.0.1", _host,
            "The address the workers' metrics endpoint binds; 0.0.0.0 to be scraped from "
            "other hosts."),
    Setting("SOLIDLOOP_METRICS_DIR", None, _optional_path,
            "The multiprocess directory the worker processes write their metrics to; unset: "
            "$PROMETHEUS_MULTIPROC_DIR if set, else <tmp>/solidloop-metrics-<port>."),
    Setting("SOLIDLOOP_OTEL_CAPTURE_CONTENT", False, _bool,
            "Record message content (prompts, completions, tool arguments and results) on "
            "the OpenTelemetry spans, redacted as the wire log is; off by default."),
    Setting("SOLIDLOOP_TRACE_URL", None, _trace_url,
            "A URL template with {trace_id}: the admin links each loop's trace id to it "
            "(your tracing backend's trace page); None shows the id alone."),
    Setting("SOLIDLOOP_OAUTH_KEY", None, _oauth_keys,
            "The Fernet key (or a list, newest first) OAuth tokens for remote MCP servers "
            "are encrypted under in the database; needed by mcps entries with "
            "auth={'type': 'oauth', ...}."),
    Setting("SOLIDLOOP_OAUTH_REFRESH_MARGIN", 60, _non_negative_int,
            "Seconds before an MCP server's OAuth access token expires that a worker "
            "refreshes it."),
    Setting("SOLIDLOOP_OAUTH_SIGN_IN_URL", None, _sign_in_url,
            "Where a user signs in to an OAuth-protected MCP server, as a URL template with "
            "{server} and {subject}, named in the failure of a loop that has no usable "
            "token; None names the sign-in blueprint's path under its default prefix."),
)

_BY_KEY = {s.key: s for s in SETTINGS}


@dataclass(frozen=True)
class Config:
    """Validated settings of one app. Field names are the keys without the prefix."""

    liveness_ttl: float
    reaper_interval: float
    lease_margin: int
    queued_reap_threshold: int
    default_read_timeout: int
    default_tool_timeout: int
    lease_leak_grace: int
    default_max_duration: int
    llm_retries: int
    llm_retry_base_delay: float
    llm_retry_max_delay: float
    llm_retry_statuses: tuple[int, ...]
    llm_max_connections: int | None
    llm_pool_timeout: float
    llm_io: str
    llm_io_max_inflight: int
    llm_io_commit_threads: int
    job_lease: int | None
    job_max_retries: int
    job_max_deliveries: int
    continuation_first: bool
    first_turn_max_wait: int
    fair_share_quantum: float
    max_concurrent_per_subject: int | None
    held_loop_recheck: float
    inline_continuation: bool
    inline_max_hops: int
    poll_interval: float
    idle_poll_interval: float
    database_url: str | None
    pooler_check: bool
    event_retention: int | None
    finished_job_retention: int | None
    loop_retention: int | None
    loop_purge_batch_size: int
    janitor_batch_size: int
    janitor_interval: float
    rollup_interval: float
    rollup_retention: int | None
    stream_update_interval: float
    observed_stream_update_interval: float
    stream_max_hz: float
    stream_seconds: float
    stream_heartbeat: float
    admin_stream_seconds: float
    admin_heartbeat: float
    admin_trusted_origins: tuple[str, ...]
    admin_bulk_batch: int
    admin_bulk_limit: int
    admin_count_budget: float
    prices: dict[str, Any]
    subject_budget: Any
    spend_retention: int
    rate_limits: dict[str, Any]
    rate_limit_inline_wait: float
    rate_limit_horizon: float
    default_output_estimate: int
    tool_output_limit: int
    event_body_limit: int
    wire_log: str
    event_repeat_history: bool
    mcp_inbound_session_retention: int | None
    mcp_max_request_body: int
    job_result_ttl: int
    job_failure_ttl: int
    worker_heartbeat: float
    worker_retention: int
    approval_timeout: float | None
    max_agent_depth: int
    database_retry_seconds: float
    otel_capture_content: bool
    trace_url: str | None
    oauth_key: tuple[str, ...]
    oauth_refresh_margin: int
    oauth_sign_in_url: str | None
    provider_outage_max_wait: float
    tool_quarantine_limit: int
    max_history_bytes: int | None
    tool_max_attempts: int
    metrics: bool
    metrics_port: int
    metrics_host: str
    metrics_dir: str | None

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> Config:
        values = {}
        for setting in SETTINGS:
            raw = mapping.get(setting.key, setting.default)
            values[setting.key.removeprefix("SOLIDLOOP_").lower()] = setting.parse(setting.key, raw)
        unknown = sorted(k for k in mapping if k.startswith("SOLIDLOOP_") and k not in _BY_KEY)
        if unknown:
            import difflib

            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, list(_BY_KEY), n=1)
                hints.append(f"{key} (did you mean {close[0]}?)" if close else key)
            raise ConfigurationError(
                unknown[0], mapping[unknown[0]],
                "unknown setting: " + ", ".join(hints) + f"; known settings: {', '.join(_BY_KEY)}",
            )
        return cls(**values)

    @property
    def wire_body_limit(self) -> int:
        """The body limit every wire-log writer passes: SOLIDLOOP_EVENT_BODY_LIMIT,
        or 0 with SOLIDLOOP_WIRE_LOG = "summary" (loops/store/wirelog.SUMMARY:
        no body, a summary)."""
        return 0 if self.wire_log == "summary" else self.event_body_limit

    @property
    def metrics_directory(self) -> str:
        """The metrics multiprocess directory: SOLIDLOOP_METRICS_DIR, else
        $PROMETHEUS_MULTIPROC_DIR, else one per port under the temp directory."""
        return (self.metrics_dir or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
                or os.path.join(tempfile.gettempdir(), f"solidloop-metrics-{self.metrics_port}"))

    # Lease arithmetic lives here so every lease has one source.

    @property
    def job_lease_seconds(self) -> float:
        """The broker's job lease: SOLIDLOOP_JOB_LEASE, or the liveness TTL."""
        return float(self.job_lease) if self.job_lease else self.liveness_ttl
