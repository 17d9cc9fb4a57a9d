"""SSEParser: the event-stream grammar, however the network cuts the bytes. Pure, no I/O."""

from __future__ import annotations

import json
import random
import re

import pytest

from flask_solidloop.llm.dialect import SSEEvent
from flask_solidloop.llm.openai import OpenAIAggregator
from flask_solidloop.llm.sse import SSEParser, iter_sse


def parse(*chunks: bytes | str) -> list[SSEEvent]:
    parser = SSEParser()
    events = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.close())
    return events


def bytewise(data: bytes) -> list[SSEEvent]:
    return parse(*(data[i:i + 1] for i in range(len(data))))


def datas(events: list[SSEEvent]) -> list[str]:
    return [e.data for e in events]


def reference(data: bytes) -> list[SSEEvent]:
    """The WHATWG algorithm, written plainly over the whole stream (plus our flush at EOF)."""
    text = data.decode("utf-8", errors="replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = re.split(r"\r\n|\r|\n", text)
    if lines and lines[-1] == "":
        lines.pop()  # the stream ended with a line end
    lines.append("")  # the flush at close()
    events, buffer, event_type, last_id = [], None, None, None
    for line in lines:
        if line == "":
            if buffer is not None:
                events.append(SSEEvent(buffer, event_type, last_id))
            buffer, event_type = None, None
            continue
        if line.startswith(":"):
            continue
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            buffer = value if buffer is None else buffer + "\n" + value
        elif field == "event":
            event_type = value or None
        elif field == "id" and "\0" not in value:
            last_id = value or None
    return events


# -- line endings ----------------------------------------------------------------------------


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_each_line_ending(eol):
    stream = f"data: one{eol}{eol}data: two{eol}data: more{eol}{eol}".encode()
    assert datas(parse(stream)) == ["one", "two\nmore"]
    assert datas(bytewise(stream)) == ["one", "two\nmore"]


def test_crlf_split_across_reads_is_one_line_end():
    # Were "\r" | "\n" two line ends, the blank line between them would dispatch "a"
    # alone and "b" would become a second event.
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\ndata: b\r") == []
    assert parser.feed(b"\n") == []
    assert parser.feed(b"\r") == [SSEEvent("a\nb")]
    assert parser.feed(b"\n") == []  # the LF of that CRLF, not another blank line
    assert parser.feed(b"data: c\r\n\r\n") == [SSEEvent("c")]
    assert parser.close() == []


def test_lone_cr_then_lf_in_a_later_read_is_still_one_crlf():
    assert datas(parse(b"data: x\r", b"\n", b"\r", b"\n")) == ["x"]


def test_mixed_line_endings_in_one_stream():
    stream = b"data: a\r\ndata: b\rdata: c\n\r\ndata: d\r\r"
    assert datas(parse(stream)) == ["a\nb\nc", "d"]
    assert datas(bytewise(stream)) == ["a\nb\nc", "d"]


# -- fields ----------------------------------------------------------------------------------


def test_multi_line_data_is_joined_with_newlines():
    assert datas(parse(b"data: {\ndata:  \"a\": 1\ndata: }\n\n")) == ['{\n "a": 1\n}']


def test_event_name_and_id():
    events = parse(b"event: message_start\nid: 7\ndata: x\n\nevent: ping\ndata: y\n\ndata: z\n\n")
    assert events == [
        SSEEvent("x", "message_start", "7"),
        SSEEvent("y", "ping", "7"),  # the last event id persists, as lastEventId does
        SSEEvent("z", None, "7"),  # the event name does not
    ]


def test_last_id_carries_into_later_reads_of_plain_data_events():
    parser = SSEParser()
    assert parser.feed(b"id: 5\ndata: a\n\n") == [SSEEvent("a", None, "5")]
    assert parser.feed(b"data: b\n\ndata: c\n\n") == [SSEEvent("b", None, "5"),
                                                        SSEEvent("c", None, "5")]
    assert parser.feed(b"data: d\n\n") == [SSEEvent("d", None, "5")]


def test_id_with_nul_is_ignored_and_empty_id_resets():
    events = parse(b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\nid\ndata: c\n\n")
    assert [e.id for e in events] == ["1", "1", None]


def test_comments_are_ignored():
    stream = (b": keep-alive\n\n:\n\ndata: a\n: in the middle\ndata: b\n\n"
              b": OPENROUTER PROCESSING\n\n")
    assert datas(parse(stream)) == ["a\nb"]


def test_one_optional_space_after_the_colon():
    assert datas(parse(b"data:x\n\ndata: x\n\ndata:  x\n\ndata:\n\n")) == ["x", "x", " x", ""]


def test_fields_without_a_colon():
    # "data" alone is an empty data line; "event" alone is an empty name.
    assert parse(b"data\n\n") == [SSEEvent("")]
    assert parse(b"event\ndata\ndata\n\n") == [SSEEvent("\n")]
    assert parse(b"event: x\nevent\ndata: y\n\n") == [SSEEvent("y")]


def test_block_without_data_dispatches_nothing():
    assert parse(b"event: ping\n\nid: 4\n\nretry: 100\n\n") == []
    assert parse(b"id: 4\n\ndata: a\n\n") == [SSEEvent("a", None, "4")]


def test_retry_and_unknown_fields_are_ignored():
    assert parse(b"retry: 3000\nfoo: bar\ndata: a\nDATA: b\n\n") == [SSEEvent("a")]


def test_colon_in_value_is_kept():
    assert datas(parse(b'data: {"url": "http://x:1/"}\n\n')) == ['{"url": "http://x:1/"}']


def test_extra_blank_lines_create_no_events():
    assert datas(parse(b"\n\n\ndata: a\n\n\n\n\ndata: b\n\n\n")) == ["a", "b"]
    assert datas(parse(b"\r\n\r\n\r\ndata: a\r\n\r\n\r\n\r\n")) == ["a"]


def test_leading_bom_is_dropped_once():
    bom = "\ufeff".encode()
    assert datas(parse(bom + b"data: a\n\n")) == ["a"]
    assert datas(bytewise(bom + b"data: a\n\n")) == ["a"]
    # only at the very start; a second one is part of the field name
    assert datas(parse(bom + bom + b"data: a\n\n")) == []


# -- chunking and text -------------------------------------------------------------------------


def test_utf8_split_across_reads():
    stream = "data: café 東京 🚀 naïve\n\n".encode()
    assert datas(bytewise(stream)) == ["café 東京 🚀 naïve"]
    rocket = stream.index("🚀".encode())
    assert datas(parse(stream[:rocket + 1], stream[rocket + 1:rocket + 3],
                       stream[rocket + 3:])) == ["café 東京 🚀 naïve"]


def test_invalid_utf8_becomes_replacement_characters():
    assert datas(parse(b"data: a\xffb\n\n")) == ["a\ufffdb"]
    # a truncated character at the very end is flushed by close()
    assert datas(parse(b"data: x\xe6\x9d")) == ["x\ufffd"]


def test_text_chunks_are_accepted():
    assert datas(parse("data: é", "\n", "\ndata: b\r", "\n\r\n")) == ["é", "b"]


def test_event_split_across_many_reads():
    value = "x" * 100_000
    stream = f"data: {value}\n\n".encode()
    parser = SSEParser()
    events = []
    for i in range(0, len(stream), 7):
        events.extend(parser.feed(stream[i:i + 7]))
    assert datas(events) == [value]
    assert parser.close() == []


def test_event_completes_only_at_its_blank_line():
    parser = SSEParser()
    assert parser.feed(b"data: a\n") == []
    assert parser.feed(b"data: b\n") == []
    assert parser.feed(b"\n") == [SSEEvent("a\nb")]


def test_many_events_in_one_read():
    stream = b"".join(b"data: %d\n\n" % i for i in range(1000))
    assert datas(parse(stream)) == [str(i) for i in range(1000)]


def test_close_flushes_an_unterminated_last_event():
    assert datas(parse(b"data: a\n\ndata: b")) == ["a", "b"]
    assert datas(parse(b"data: a\n\ndata: b\n")) == ["a", "b"]
    assert datas(parse(b"data: a\n\ndata: b\r")) == ["a", "b"]
    assert datas(parse(b"data: a\n\n: comment")) == ["a"]
    assert parse(b"") == []


def test_close_twice_is_harmless():
    parser = SSEParser()
    parser.feed(b"data: a")
    assert datas(parser.close()) == ["a"]
    assert parser.close() == []


def test_empty_reads_are_harmless():
    assert datas(parse(b"", b"data: a", b"", b"\n", b"", b"\n", b"")) == ["a"]


def test_iter_sse_over_a_byte_iterator():
    chunks = iter([b"data: a\n", b"\nevent: e\ndata: b\n\n", b"data: c"])
    assert list(iter_sse(chunks)) == [SSEEvent("a"), SSEEvent("b", "e"), SSEEvent("c")]
    assert list(iter_sse(iter([]))) == []


# -- against the reference, with random streams and random cuts ---------------------------------


def random_stream(rng: random.Random) -> bytes:
    eols = ["\n", "\r\n", "\r"]
    lines = []
    for _ in range(rng.randint(0, 40)):
        kind = rng.random()
        if kind < 0.45:
            value = rng.choice(["{\"a\": 1}", "", " lead", "é🚀東", "x:y", "[DONE]", "data: x"])
            lines.append(rng.choice(["data: ", "data:", "data"]) + (value if rng.random() < .9
                                                                    else ""))
        elif kind < 0.65:
            lines.append("")
        elif kind < 0.72:
            lines.append(": keep-alive")
        elif kind < 0.80:
            lines.append(rng.choice(["event: ", "event:", "event"]) + rng.choice(["", "x", "é"]))
        elif kind < 0.87:
            lines.append(rng.choice(["id: 1", "id:2", "id", "id: a\0b"]))
        elif kind < 0.93:
            lines.append(rng.choice(["retry: 10", "foo: bar", "DATA: no"]))
        else:
            lines.append("")
            lines.append("")
    text = "".join(line + rng.choice(eols) for line in lines)
    if lines and rng.random() < 0.2:
        text = text.rstrip("\r\n")  # a stream that ends mid-line
    if rng.random() < 0.1:
        text = "\ufeff" + text
    return text.encode()


def random_cuts(rng: random.Random, data: bytes) -> list[bytes]:
    cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randint(0, 12))))
    pieces, start = [], 0
    for cut in [*cuts, len(data)]:
        pieces.append(data[start:cut])
        start = cut
    return pieces


def test_random_streams_and_cuts_match_the_reference():
    rng = random.Random(20240917)
    for _ in range(1500):
        stream = random_stream(rng)
        expected = reference(stream)
        assert parse(stream) == expected, stream
        assert parse(*random_cuts(rng, stream)) == expected, stream
    for _ in range(100):
        stream = random_stream(rng)
        assert bytewise(stream) == reference(stream), stream


# -- a realistic OpenAI stream ------------------------------------------------------------------


def openai_stream(eol: str = "\n") -> bytes:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": "gpt-4o", "system_fingerprint": "fp_1"}
    chunks = []

    def emit(delta, finish=None, usage=None, choices=True):
        chunk = dict(base, choices=[{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}] if choices else [],
                     usage=usage)
        chunks.append("data: " + json.dumps(chunk, ensure_ascii=False))

    emit({"role": "assistant", "content": "", "refusal": None})
    for word in ["Hé", "llo", " 🚀", " wörld", " 東京", "."]:
        emit({"content": word})
    emit({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                          "function": {"name": "search", "arguments": ""}}]})
    for piece in ['{"q": ', '"caf', 'é"', "}"]:
        emit({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
    emit({}, "tool_calls")
    emit(None, usage={"prompt_tokens": 10, "completion_tokens": 12}, choices=False)
    body = "".join(f": keep-alive{eol}{eol}" * (i == 3) + c + eol + eol
                   for i, c in enumerate(chunks))
    return (body + f"data: [DONE]{eol}{eol}").encode()


@pytest.mark.parametrize("eol", ["\n", "\r\n"])
def test_realistic_openai_stream_fed_byte_at_a_time(eol):
    stream = openai_stream(eol)
    whole = parse(stream)
    assert len(whole) == 15 and whole[-1].data == "[DONE]"
    assert bytewise(stream) == whole
    aggregator = OpenAIAggregator()
    deltas = [d for d in (aggregator.feed(e) for e in bytewise(stream)) if d]
    assert "".join(d.content for d in deltas) == "Héllo 🚀 wörld 東京."
    assert aggregator.finished
    turn = aggregator.result()
    assert turn.content == "Héllo 🚀 wörld 東京."
    assert [(c.call_id, c.name, c.arguments_raw) for c in turn.tool_calls] == [
        ("call_1", "search", '{"q": "café"}')]
    assert turn.usage is not None and turn.usage.output_tokens == 12
    assert turn.finish_reason == "tool_calls"
