"""A scriptable MCP server speaking Streamable HTTP on 127.0.0.1, for tests.

:class:`MCPEmulator` is a real server on a real socket (werkzeug, one daemon thread per
connection), so an MCP client's whole HTTP stack is exercised: the official SDK's
``mcp.Client`` connects to :attr:`MCPEmulator.url` unchanged. Messages are parsed and
results shaped with the SDK's own protocol types (``mcp.types.jsonrpc_message_adapter``,
``mcp.types.methods.parse_client_request`` / ``serialize_server_result``,
``mcp.shared.inbound.classify_inbound_request``), so what the emulator sends is what the
SDK's schemas allow for the negotiated protocol version. Nothing is monkeypatched.

Two protocol eras are served on one endpoint (``POST {path}``, default ``/mcp``):

* Handshake era (2024-11-05 .. 2025-11-25): ``initialize`` opens a session and the answer
  carries ``Mcp-Session-Id``; every later request must send it (missing: 400; unknown,
  expired or deleted: 404). ``MCP-Protocol-Version`` may be absent; when present it must
  equal the negotiated version (else 400). Notifications and posted responses get 202 with
  no body. ``DELETE`` ends a session (200; unknown: 404; no session header: 405); ``GET``
  is answered 405 (404 for an unknown session), which the spec allows for a server that
  offers no standalone SSE stream. JSON-RPC errors come with HTTP 200. ``initialize`` with
  an unknown ``Mcp-Session-Id`` is 404, as from the SDK's own server: a client must drop
  the old id before it re-initializes. Sessions live until DELETE, a ``session_lost``
  failure, :meth:`MCPEmulator.drop_session` or :meth:`MCPEmulator.reset` (no TTL).
* Stateless era (2026-07-28, ``stateless=True``, the default): no session. A request is
  routed here when its ``MCP-Protocol-Version`` header is not a handshake version, or when
  ``params._meta`` carries ``io.modelcontextprotocol/protocolVersion``. The envelope and the
  routing headers (``Mcp-Method``, ``Mcp-Name``, ``Mcp-Param-*``) are checked by the SDK's
  validation ladder; ``server/discover`` answers; JSON-RPC errors use the SDK's status
  table (400 / 404); results get ``resultType`` and the ``serverInfo`` ``_meta`` stamp.
  With ``stateless=False`` such requests get ``-32022`` naming only handshake versions, so
  ``mcp.Client(url)`` (``mode="auto"``) falls back to ``initialize``.

Served methods: ``initialize``, ``ping`` (handshake era), ``server/discover`` (stateless
era), ``tools/list`` and ``tools/call``. Anything else is ``-32601``. Batches are refused.
Answers are JSON; with ``sse=True`` a request whose ``Accept`` names ``text/event-stream``
gets its answer as one ``event: message`` SSE frame instead.

Tools::

    with MCPEmulator(token="s3cret") as mcp:
        mcp.tool("greet", input_schema={"type": "object",
                                        "properties": {"name": {"type": "string"}}},
                 handler=lambda args, meta: f"Hello {args['name']}!")
        mcp.tool("weather", result={"city": "Paris", "temp_c": 21},
                 output_schema={"type": "object"})
        ...  # point the client at mcp.url, with "Authorization: Bearer s3cret"

A result (scripted, or returned by a handler) is a ``str`` (one text block), a ``dict``
that looks like a ``CallToolResult`` (a ``content`` list, and only the keys ``content``,
``structuredContent``, ``isError``, ``_meta``, ``resultType``: sent as given), any other
``dict`` (``structuredContent`` plus the same JSON as a text block), or an
``mcp.types.CallToolResult``. A handler is called as ``handler(arguments, meta)``, ``meta``
being the request's ``params._meta`` (``{}`` when absent; the idempotency key and, in the
stateless era, the reserved ``io.modelcontextprotocol/*`` keys travel there). An exception
raised by a handler becomes an ``isError: true`` result naming it; raise ``mcp.MCPError`` for
a JSON-RPC error instead. Arguments are checked against ``input_schema`` (when
``jsonschema`` is importable; a mismatch is an ``isError`` result and the tool does not run).
A tool without ``result`` or ``handler`` echoes its arguments as JSON text.

Failures (:meth:`MCPEmulator.fail_next`) are consumed by POSTed JSON-RPC *requests* (not by
notifications, GET or DELETE), after the Host/Origin and token checks, in the order
queued; ``method=`` / ``tool=`` restrict which requests a failure applies to::

    mcp.fail_next("status", status=503, retry_after=2)   # no JSON-RPC body
    mcp.fail_next("session_lost")                        # 404; the session is gone
    mcp.fail_next("slow", seconds=0.5, method="tools/call")
    mcp.fail_next("is_error", message="quota exceeded")  # next tools/call: isError result
    mcp.fail_next("malformed")                           # 200 with a body that is not JSON-RPC

``malformed`` replaces the answer after the request was processed (a tool call ran, an
``initialize`` opened a session the client never learns about); ``status`` and
``session_lost`` answer before anything runs; ``slow`` delays, then answers normally.

Every request is recorded (:attr:`MCPEmulator.requests`, headers lower-cased), and every
tool run too (:attr:`MCPEmulator.calls`): a tool that ran is a tool whose side effects
happened, whatever became of its answer.

Security: the ``Host`` header must name a loopback host (``localhost``, ``127.0.0.1``,
``::1``, or the bound host), else 421; an ``Origin`` header, when sent, must too, else 403
(the spec's DNS-rebinding rule). With ``token`` set, every request needs
``Authorization: Bearer <token>``, else 401 with ``WWW-Authenticate: Bearer`` and an
OAuth-style JSON body (not JSON-RPC), as real servers answer.

Modules: ``server`` (the emulator and each request's path through it), ``types``
(recorded requests and calls, tools, sessions, failures), ``protocol`` (JSON-RPC and
HTTP answers, what is read off a request), ``tools`` (tool definitions, argument
checks, results) and ``failures`` (failure injection). The HTTP plumbing is
``flask_solidloop/testing/_local_server.py``, shared with the LLM emulator.
"""

from .server import MCPEmulator
from .types import RecordedCall, RecordedRequest

__all__ = ["MCPEmulator", "RecordedCall", "RecordedRequest"]
