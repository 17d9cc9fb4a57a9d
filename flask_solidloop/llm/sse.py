"""Server-sent events: one incremental, pure parser (no I/O).

:class:`SSEParser` follows the WHATWG event-stream grammar:

* lines end in CRLF, LF or a lone CR, and a CRLF split across two reads is
  still one line end (never an extra, event-dispatching blank line);
* ``data:`` lines of one event are joined with ``"\\n"``; ``event:`` names it;
  ``id:`` sets the last event id, which persists across later events as in
  the browser's ``lastEventId`` (an id containing NUL is ignored); ``retry:``
  and unknown fields are ignored;
* a line starting with ``:`` is a comment (keep-alives) and is ignored;
* one optional space after the colon is removed; a line without a colon is a
  field name with an empty value;
* a blank line dispatches the event; a block that had no ``data`` line
  dispatches nothing (``event: ping`` alone is not an event);
* bytes go through an incremental UTF-8 decoder (invalid sequences become
  U+FFFD), so a character split across reads is decoded whole; a leading BOM is
  dropped.

Unlike a browser, :meth:`SSEParser.close` dispatches a last event that was
not followed by a blank line: a server that closes right after its final
``data:`` line has still said it.

Speed matters (every streamed token passes through here): when a read holds
only ``data: {...}`` events, as an LLM stream does, they are cut out with a
few whole-read string operations done in C, and Python code runs once per
event only to build it.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator

from .dialect import SSEEvent

__all__ = ["SSEParser", "iter_sse"]

_Decoder = codecs.getincrementaldecoder("utf-8")


class SSEParser:
    """Feed it what the network gives, in order; it returns the completed events.

    ``feed`` accepts bytes (decoded as UTF-8) or already-decoded text; do not
    mix the two inside one stream while a multi-byte character is pending.
    """

    __slots__ = ("_decode", "_head", "_id", "_pending", "_pending_nl", "_started",
                 "_trailing_cr")

    def __init__(self) -> None:
        self._decode = _Decoder(errors="replace").decode
        #: Text after the last event boundary ("\n\n"), in pieces: an event still
        #: arriving. Joined only once a boundary shows up, so feeding a long event
        #: in many small reads stays linear.
        self._pending: list[str] = []
        #: The pending text ends in "\n" (a "\n" opening the next read ends the event).
        self._pending_nl = False
        #: The previous read ended in "\r": a "\n" opening the next one is its pair.
        self._trailing_cr = False
        #: No text seen yet (a BOM may open it).
        self._started = False
        #: Either of the two above: the head of the next text needs a look.
        self._head = True
        #: The last event id; it persists across events, as ``lastEventId`` does.
        self._id: str | None = None

    def feed(self, chunk: bytes | str) -> list[SSEEvent]:
        """Consume one read; return the events it completed (often none)."""
        text = chunk if isinstance(chunk, str) else self._decode(chunk)
        if not text:
            return []
        if self._head:
            text = self._trim_head(text)
            if not text:
                return []
        if "\r" in text:
            if text[-1] == "\r":
                self._trailing_cr = self._head = True
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        pending = self._pending
        if "\n\n" not in text and not (self._pending_nl and text[0] == "\n"):
            pending.append(text)  # no event ends in this read
            self._pending_nl = text[-1] == "\n"
            return []
        if pending:
            text = pending[0] + text if len(pending) == 1 else "".join([*pending, text])
            pending.clear()
        end = text.rfind("\n\n")  # the last boundary; what follows starts the next event
        if end + 2 < len(text):
            pending.append(text[end + 2:])
            self._pending_nl = text[-1] == "\n"
        else:
            self._pending_nl = False
        # The hot path: every event in this read is one "data: ..." line. Then the
        # events are exactly the pieces between "\n\ndata: " separators, and the
        # read holds no other line end than those separators.
        if text.startswith("data: "):
            if text.find("\n") == end:  # a single event
                return [SSEEvent(text[6:end], None, self._id)]
            datas = text[6:end].split("\n\ndata: ")
            if text.count("\n", 0, end) == 2 * len(datas) - 2:
                ident = self._id
                return [SSEEvent(data, None, ident) for data in datas]
        events: list[SSEEvent] = []
        for block in text[:end].split("\n\n"):
            if block:
                event = self._block(block)
                if event is not None:
                    events.append(event)
        return events

    def _trim_head(self, text: str) -> str:
        """A BOM opening the stream; the "\n" of a CRLF cut after its "\r"."""
        self._head = False
        if not self._started:
            self._started = True
            if text[0] == "\ufeff":
                text = text[1:]
        if self._trailing_cr and text:
            self._trailing_cr = False
            if text[0] == "\n":
                text = text[1:]
        return text

    def close(self) -> list[SSEEvent]:
        """End of stream: flush the decoder and dispatch a last, unterminated event."""
        tail = self._decode(b"", True)
        events = self.feed(tail) if tail else []
        if self._pending:
            event = self._block("".join(self._pending))
            self._pending.clear()
            self._pending_nl = False
            if event is not None:
                events.append(event)
        return events

    def _block(self, block: str) -> SSEEvent | None:
        """The lines of one event (no blank line inside, except leading ones)."""
        data: str | None = None
        name: str | None = None
        for line in block.split("\n"):
            if not line or line[0] == ":":  # leftover blank line, or a comment
                continue
            field, colon, value = line.partition(":")
            if colon and value.startswith(" "):
                value = value[1:]
            if field == "data":  # "data" without a colon: an empty data line
                data = value if data is None else f"{data}\n{value}"
            elif field == "event":
                name = value or None
            elif field == "id" and "\0" not in value:
                self._id = value or None
            # "retry" and unknown fields: ignored.
        if data is None:  # a block without data dispatches nothing
            return None
        return SSEEvent(data, name, self._id)


def iter_sse(chunks: Iterable[bytes | str]) -> Iterator[SSEEvent]:
    """The events of a whole stream, e.g. ``iter_sse(response.iter_bytes())``."""
    parser = SSEParser()
    feed = parser.feed
    for chunk in chunks:
        if chunk:
            yield from feed(chunk)
    yield from parser.close()
