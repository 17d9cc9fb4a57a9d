"""The app the MCP server blueprint tests run under gunicorn (and bench/mcp_server.py).

``gunicorn 'tests.support.mcp_server_app:create_app()'`` serves, on the support app's
extension (so its agents and workers are the same):

* ``/mcp/calc``: the support app's ``calc`` toolset and ``probe`` (tools that
  report who called them), behind bearer tokens ``token-<name>`` (principal
  ``<name>``);
* ``/mcp/agents``: the ``assistant`` and ``shop`` agents as start/status (and
  approve/deny) tools, same tokens;
* ``/mcp/tickets``: the ``assistant`` agent again, as an ``ExposedAgent`` whose
  start tool takes a ticket and whose ``on_start`` makes it the loop's subject
  (principal ``mallory`` is refused);
* ``/mcp/conformance``: the fixture tools of the official conformance suite,
  open to any caller (the suite sends no token);
* with ``SOLIDLOOP_TEST_OAUTH_ISSUER`` set (an authorization server of
  tests/support/oauth_server.py), ``/mcp/secure`` and ``/mcp/introspected``:
  ``calc`` and ``probe`` behind OAuth (decision 0041) for the resources
  ``<SOLIDLOOP_TEST_OAUTH_BASE>/mcp/secure`` (JWTs checked against the server's
  JWKS, scope ``mcp`` required) and ``.../mcp/introspected`` (every token
  introspected, as client ``SOLIDLOOP_TEST_OAUTH_RS_ID`` / ``_RS_SECRET``).
"""

from __future__ import annotations

import base64
import os
import time

from flask import Flask

from flask_solidloop import Agent, CallContext, ToolResult, Toolset
from flask_solidloop.jobs import get_current_job
from flask_solidloop.mcp_server import (
    ExposedAgent,
    Introspection,
    OAuthResource,
    report_progress,
)

from .support_app import Assistant, ShopAgent, calc, llm_settings, solidloop
from .support_app import create_app as create_support_app

#: The tokens the test blueprints accept: ``token-<name>`` is principal ``<name>``.
TOKEN_PREFIX = "token-"
#: Where an agent of ours finds the blueprint (set by the test that starts gunicorn).
REMOTE_URL_ENV = "SOLIDLOOP_TEST_MCP_SERVER_URL"
#: The issuer of the authorization server the OAuth blueprints trust (when set).
OAUTH_ISSUER_ENV = "SOLIDLOOP_TEST_OAUTH_ISSUER"


def check_token(token: str | None, request) -> str | None:
    if token and token.startswith(TOKEN_PREFIX) and len(token) > len(TOKEN_PREFIX):
        return token.removeprefix(TOKEN_PREFIX)
    return None


def anyone(token: str | None, request) -> str:
    return "conformance-suite"


probe = Toolset("probe")


@probe.tool
def whoami(ctx: CallContext) -> dict:
    """Who is calling, as the tool sees it."""
    principal = getattr(ctx.principal, "mcp_label", ctx.principal)  # an OAuthPrincipal's label
    return {"principal": principal, "idempotency_key": ctx.idempotency_key,
            "agent": ctx.agent is not None, "loop": ctx.loop is not None, "pid": os.getpid()}


@probe.tool
def echo(text: str) -> str:
    """Answer with the text and the serving process."""
    return f"{text} from {os.getpid()}"


@probe.tool
def remember(note: str, fail: bool, ctx: CallContext) -> str:
    """Keep a note through ctx.session, uncommitted (then fail, if asked)."""
    from sqlalchemy import text

    ctx.session.execute(text("INSERT INTO probe_notes (note) VALUES (:note)"), {"note": note})
    if fail:
        raise RuntimeError("failed after writing")
    return "noted"


@probe.tool
def nap(seconds: float) -> str:
    """Sleep a little (at most 2 s), then answer."""
    time.sleep(min(max(seconds, 0.0), 2.0))
    return "rested"


# -- the conformance suite's fixture tools -------------------------------------------

conformance = Toolset("conformance")
# A 1x1 red PNG and a tiny WAV, as the suite's reference server returns.
RED_PIXEL = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJ"
             "RU5ErkJggg==")
WAV = base64.b64encode(b"RIFF$\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00D\xac\x00\x00"
                       b"\x88X\x01\x00\x02\x00\x10\x00data\x00\x00\x00\x00").decode()


@conformance.tool
def test_simple_text() -> str:
    """Returns a simple text content block."""
    return "This is a simple text response for testing."


@conformance.tool
def test_image_content() -> ToolResult:
    """Returns an image content block."""
    return ToolResult(content=[{"type": "image", "data": RED_PIXEL, "mimeType": "image/png"}])


@conformance.tool
def test_audio_content() -> ToolResult:
    """Returns an audio content block."""
    return ToolResult(content=[{"type": "audio", "data": WAV, "mimeType": "audio/wav"}])


def _resource() -> dict:
    return {"type": "resource", "resource": {
        "uri": "test://embedded-resource", "mimeType": "text/plain",
        "text": "This is an embedded resource content."}}


@conformance.tool
def test_embedded_resource() -> ToolResult:
    """Returns an embedded resource content block."""
    return ToolResult(content=[_resource()])


@conformance.tool
def test_multiple_content_types() -> ToolResult:
    """Returns text, image and resource content blocks."""
    return ToolResult(content=[
        {"type": "text", "text": "Multiple content types test:"},
        {"type": "image", "data": RED_PIXEL, "mimeType": "image/png"},
        _resource(),
    ])


@conformance.tool
def test_error_handling() -> str:
    """Always fails, to show an error result."""
    raise RuntimeError("This tool intentionally returns an error for testing")


@conformance.tool
def test_tool_with_progress() -> str:
    """Reports progress three times, then answers."""
    for step in (0, 50, 100):
        report_progress(step, 100, f"step {step}")
    return "Progress test completed"


# -- the tasks scenarios' fixture tools (run as MCP tasks on the workers) -------------


@conformance.tool
def greet(name: str) -> str:
    """Greets someone (a plain tool: never a task)."""
    return f"Hello, {name}!"


def _cancelled() -> bool:
    job = get_current_job()
    return job is not None and job.get_status() == "canceled"


@conformance.tool(task="optional")
def slow_compute(seconds: float, label: str = "") -> str:
    """Sleeps for `seconds`, then answers; stops early when its task is cancelled."""
    deadline = time.monotonic() + max(0.0, min(seconds, 300.0))
    while time.monotonic() < deadline:
        if _cancelled():
            return f"cancelled {label}"
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    return f"computed {label} after {seconds}s"


@conformance.tool(task="required")
def failing_job() -> ToolResult:
    """Reports a tool execution error after about a second."""
    time.sleep(1)
    return ToolResult.error("failing_job failed, as it always does")


@conformance.tool(task="optional")
def protocol_error_job() -> str:
    """Raises: its task fails with a protocol-level error."""
    raise RuntimeError("protocol_error_job broke, as it always does")


def _ask(message: str, properties: dict) -> dict:
    return {"method": "elicitation/create", "params": {
        "mode": "form", "message": message,
        "requestedSchema": {"type": "object", "properties": properties}}}


@conformance.tool(task="optional")
def confirm_delete(filename: str, ctx: CallContext) -> ToolResult | str:
    """Asks the client to confirm, then "deletes" the file."""
    answer = (ctx.input_responses or {}).get("confirm")
    if answer is None:
        return ToolResult.input_required({"confirm": _ask(
            f"Delete {filename}?", {"confirm": {"type": "boolean"}})})
    accepted = isinstance(answer, dict) and answer.get("action") == "accept"
    return f"deleted {filename}" if accepted else f"kept {filename}"


@conformance.tool(task="optional")
def multi_input(ctx: CallContext) -> ToolResult | str:
    """Asks the client two things at once, then answers with both."""
    answers = ctx.input_responses or {}
    if not answers:
        return ToolResult.input_required({
            "name": _ask("Your name?", {"name": {"type": "string"}}),
            "confirm": _ask("Go ahead?", {"confirm": {"type": "boolean"}})})
    names = [str((a.get("content") or {}).get("name")) for a in answers.values()
             if isinstance(a, dict)]
    return "answers: " + ", ".join(sorted(names))


#: The suite's own JSON Schema 2020-12 fixture (composition, conditionals, $anchor).
JSON_SCHEMA_2020_12 = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {"address": {"$anchor": "addressDef", "type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"}}}},
    "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"},
                   "contactMethod": {"type": "string", "enum": ["phone", "email"]},
                   "phone": {"type": "string"}, "email": {"type": "string"}},
    "allOf": [{"anyOf": [{"required": ["phone"]}, {"required": ["email"]}]}],
    "if": {"properties": {"contactMethod": {"const": "phone"}}, "required": ["contactMethod"]},
    "then": {"required": ["phone"]},
    "else": {"required": ["email"]},
    "additionalProperties": False,
}


def json_schema_2020_12_tool(**arguments) -> str:
    """Tool with JSON Schema 2020-12 features."""
    return "ok"


def test_custom_headers(**arguments) -> str:
    """Routes on a region mirrored into the Mcp-Param-Region header (2026-07-28)."""
    return f"region {arguments.get('region')}"


conformance.add_tool(test_custom_headers, input_schema={
    "type": "object",
    "properties": {"region": {"type": "string", "x-mcp-header": "Region",
                              "description": "Where to route the call."},
                   "query": {"type": "string"}},
    "required": ["region"],
})
conformance.add_tool(json_schema_2020_12_tool, input_schema=JSON_SCHEMA_2020_12)


@solidloop.agent("remote_calc")
class RemoteCalcAgent(Agent):
    """Uses the calc tools through the MCP server blueprint (an outside URL)."""

    system_prompt = "You add numbers with remote tools."

    def mcps(self) -> list[dict]:
        return [{"name": "remote", "url": os.environ.get(REMOTE_URL_ENV, "http://127.0.0.1:9"),
                 "api_token": TOKEN_PREFIX + "our-agent", "tools": ["add", "whoami"]}]

    def llm(self) -> dict:
        return llm_settings()


def start_on_ticket(principal: str, arguments: dict) -> dict:
    """The tickets blueprint's on_start: the ticket is the loop's subject."""
    if principal == "mallory":
        raise PermissionError(f"{principal} may not open tickets")
    ticket = arguments["ticket_id"]
    return {"subject": ("Ticket", ticket),
            "state": {"ticket_id": ticket, "priority": arguments.get("priority", "normal")},
            "message": f"Ticket {ticket}: {arguments['message']}"}


TICKET_ARGUMENTS = {
    "ticket_id": {"type": "integer", "minimum": 1, "description": "The ticket to work on."},
    "priority": {"type": "string", "enum": ["low", "normal", "high"]},
}

calc_blueprint = solidloop.mcp_blueprint(calc, probe, auth=check_token, name="mcp_calc")
agents_blueprint = solidloop.mcp_blueprint(auth=check_token, agents=[Assistant, ShopAgent],
                                           name="mcp_agents")
# expose_errors: the tests read on_start's refusal (a PermissionError) verbatim.
tickets_blueprint = solidloop.mcp_blueprint(
    auth=check_token, name="mcp_tickets", expose_errors=True,
    agents=[ExposedAgent(Assistant, arguments=TICKET_ARGUMENTS, required=["ticket_id"],
                         on_start=start_on_ticket)])
conformance_blueprint = solidloop.mcp_blueprint(conformance, auth=anyone, name="conformance")


def create_app(**config) -> Flask:
    app = create_support_app(**config)
    app.register_blueprint(calc_blueprint, url_prefix="/mcp/calc")
    app.register_blueprint(agents_blueprint, url_prefix="/mcp/agents")
    app.register_blueprint(tickets_blueprint, url_prefix="/mcp/tickets")
    app.register_blueprint(conformance_blueprint, url_prefix="/mcp/conformance")
    issuer = os.environ.get(OAUTH_ISSUER_ENV)
    if issuer:
        base = os.environ["SOLIDLOOP_TEST_OAUTH_BASE"]
        app.register_blueprint(solidloop.mcp_blueprint(
            calc, probe, name="mcp_secure", oauth=OAuthResource(
                f"{base}/mcp/secure", [issuer], required_scopes=["mcp"],
                resource_name="calc (JWT)")), url_prefix="/mcp/secure")
        app.register_blueprint(solidloop.mcp_blueprint(
            calc, probe, name="mcp_introspected", oauth=OAuthResource(
                f"{base}/mcp/introspected", [issuer], introspect_jwts=True,
                introspection=Introspection(os.environ["SOLIDLOOP_TEST_OAUTH_RS_ID"],
                                            os.environ["SOLIDLOOP_TEST_OAUTH_RS_SECRET"]))),
            url_prefix="/mcp/introspected")
    return app
