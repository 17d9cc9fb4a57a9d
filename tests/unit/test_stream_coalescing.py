"""Coalescing a streaming turn's flushes, and the hub's feeds (no database)."""

from __future__ import annotations

import itertools
import json

from flask_solidloop.pipeline.llm_stack import Coalescer
from flask_solidloop.streaming.events import StreamEvent
from flask_solidloop.streaming.hub import FEED_EVENTS, LiveHub


def flushes(pace: Coalescer, arrivals: list[float], events_per_flush: int = 1) -> list[float]:
    """When a turn whose tokens arrive at ``arrivals`` flushes (the writer asks
    at each token)."""
    out = []
    for now in arrivals:
        if pace.due(now):
            pace.flushed(now, events=events_per_flush)
            out.append(now)
    return out


def tokens(per_second: float, seconds: float) -> list[float]:
    return [n / per_second for n in range(1, int(per_second * seconds) + 1)]


def test_a_fast_model_watched_is_coalesced_to_max_hz():
    pace = Coalescer(max_hz=20, idle_interval=2.0, watched_interval=0.25, now=0.0)
    pace.watched = True
    done = flushes(pace, tokens(400, 5.0))  # 2,000 tokens in five seconds
    assert 95 <= len(done) <= 100  # at most 20 a second
    assert all(b - a >= 0.05 - 1e-9 for a, b in itertools.pairwise(done))


def test_two_events_per_flush_halve_the_flushes():
    pace = Coalescer(max_hz=20, idle_interval=2.0, watched_interval=0.25, now=0.0)
    pace.watched = True
    done = flushes(pace, tokens(400, 5.0), events_per_flush=2)
    assert 48 <= len(done) <= 50  # a text and a reasoning delta each time: 20 events/s
    assert all(b - a >= 0.1 - 1e-9 for a, b in itertools.pairwise(done))


def test_nobody_watching_flushes_at_the_idle_interval():
    pace = Coalescer(max_hz=20, idle_interval=2.0, watched_interval=0.25, now=0.0)
    done = flushes(pace, tokens(100, 10.0))
    assert done == [2.0, 4.0, 6.0, 8.0, 10.0]


def test_watching_starts_mid_turn_and_speeds_up_the_next_flush():
    pace = Coalescer(max_hz=10, idle_interval=2.0, watched_interval=0.25, now=0.0)
    arrivals = tokens(100, 4.0)
    first = flushes(pace, [t for t in arrivals if t <= 2.0])
    assert first == [2.0]
    pace.watched = True  # the flush at 2.0 learned that a stream opened
    rest = flushes(pace, [t for t in arrivals if t > 2.0])
    assert rest[0] <= 2.1 + 1e-9 and len(rest) >= 19


def test_deltas_off_a_watched_loop_flushes_at_the_watched_interval():
    pace = Coalescer(max_hz=0, idle_interval=2.0, watched_interval=0.25, now=0.0)
    pace.watched = True
    done = flushes(pace, tokens(100, 2.0))
    assert len(done) == 8 and done[0] == 0.25


def event(seq: int, text: str = "x") -> StreamEvent:
    return StreamEvent(id=str(seq), kind="text_delta", loop_id=7, message_id=3,
                       data={"text": text, "offset": 0})


def note(loop: int, seq: int, prev: int, text: str | None = "x") -> str:
    head = f"{loop}:{seq}:{prev}"
    if text is None:
        return head
    return head + "\n" + json.dumps({"k": "text_delta", "m": 3, "d": {"offset": 0},
                                     "t": text, "a": 1700000000.0})


def quiet_hub() -> LiveHub:
    """A hub whose LISTEN thread never connects: the tests call dispatch()."""
    hub = LiveHub("postgresql://unused")
    hub.stop()
    return hub


def test_a_feed_takes_chained_events_and_goes_stale_on_a_broken_chain():
    hub = quiet_hub()
    hub.watch(7)
    assert hub.cached(7, 0) is None  # stale until a read
    hub.end_read(7, hub.version(7), [event(10), event(12)], after=0, tail=12)
    assert [e.seq for e in hub.cached(7, 0) or []] == [10, 12]
    assert [e.seq for e in hub.cached(7, 10) or []] == [12]
    hub.dispatch(note(7, 15, 12, "hello"))  # chained: taken with its text
    assert [(e.seq, e.text) for e in hub.cached(7, 12) or []] == [(15, "hello")]
    hub.dispatch(note(7, 15, 12))  # heard again (read before it was heard): ignored
    assert hub.newest(7) == 15
    hub.dispatch(note(7, 20, 18))  # 18 was never heard: the table must be read
    assert hub.cached(7, 15) is None
    hub.dispatch(note(8, 30, 0))  # a loop nobody here watches: no feed made
    assert hub.newest(8) is None


def test_an_event_without_its_text_makes_the_feed_stale():
    hub = quiet_hub()
    hub.watch(7)
    hub.end_read(7, hub.version(7), [], after=0, tail=5)
    assert hub.cached(7, 5) == []
    hub.dispatch(note(7, 6, 5, text=None))  # a tool call: its row must be read
    assert hub.cached(7, 5) is None


def test_a_read_that_overlapped_a_notification_leaves_the_feed_stale():
    hub = quiet_hub()
    hub.watch(7)
    mine, version = hub.begin_read(7, timeout=0)
    assert mine
    hub.dispatch(note(7, 9, 8))  # heard while the read ran
    hub.end_read(7, version, [event(8)], after=0, tail=8)
    assert hub.cached(7, 0) is None  # the read may have missed 9: read again


def test_a_feed_keeps_its_newest_events_and_knows_where_they_start():
    hub = quiet_hub()
    hub.watch(7)
    hub.end_read(7, hub.version(7), [], after=0, tail=0)
    for seq in range(1, FEED_EVENTS + 11):
        hub.dispatch(note(7, seq, seq - 1))
    assert hub.cached(7, 5) is None  # dropped from memory: read the table
    kept = hub.cached(7, 10) or []
    assert [e.seq for e in kept] == list(range(11, FEED_EVENTS + 11))


def test_the_last_stream_of_a_loop_drops_its_feed():
    hub = quiet_hub()
    hub.watch(7)
    hub.watch(7)
    hub.unwatch(7)
    assert hub.streams == 1
    hub.unwatch(7)
    assert hub.streams == 0 and hub.newest(7) is None
