"""The chat page: a conversation with the weather agent, streamed into the
browser from the loop's event stream (docs/guides/streaming.md).

This module owns the ``chat`` blueprint: who the browser's user is (an id kept
in Flask's signed session cookie), which loops that user may see (those whose
subject is that id), the pages, the actions (start, follow-up, approve, deny)
and ``render``, which turns each stream event into htmx out-of-band swaps.

The page is built from events only: it renders an empty conversation and
opens ``/chat/<id>/events``; with no Last-Event-ID the stream replays the
loop from its first event and then goes on live, so a reload shows exactly
what was written, with nothing duplicated or missing. Model output is always
escaped (markupsafe).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from flask import Blueprint, Response, abort, redirect, render_template, request, session, url_for
from markupsafe import Markup, escape

from flask_solidloop import ConversationBusyError, DecisionConflictError, StreamEvent
from flask_solidloop.models import Loop

from .agents import WeatherAgent, solidloop

bp = Blueprint("chat", __name__, url_prefix="/chat")

#: Every event kind the page swaps in (the stream element listens to these).
KINDS = ("status_changed", "message_started", "text_delta", "message_completed",
         "message_discarded", "tool_call", "approval_requested", "approval_decided",
         "tool_result", "completed", "failed")
#: What a loop's subject is for the chat's users: ("browser", <the cookie's user id>).
SUBJECT_TYPE = "browser"
#: Only our own scripts, styles and streams: model output can never run.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


def current_user() -> str:
    """The browser's user id, minted on its first visit and kept in the signed
    session cookie (a real app would use its login here)."""
    if "user" not in session:
        session["user"] = uuid.uuid4().hex
    return str(session["user"])


def owns(loop: Loop) -> bool:
    """Whether the browser's user may see ``loop``: the ``authorize`` of the
    stream, and the check of every page and action."""
    return loop.subject_type == SUBJECT_TYPE and loop.subject_id == session.get("user")


def own_loop(loop_id: int) -> Loop:
    """The loop, if the browser's user owns it; 404 or 403 otherwise."""
    from . import db  # here: example_app imports this module while it starts

    loop = db.session.get(Loop, loop_id)
    if loop is None:
        abort(404)
    if not owns(loop):
        abort(403)
    return loop


def send_message(loop: Loop, text: str) -> bool:
    """The user's next message. A finished conversation goes on with it; one
    still answering (or waiting for a decision) keeps it and answers it next
    (the agent's ``on_new_message``, "queue" by default). False only for an
    agent that rejects messages while it works."""
    try:
        WeatherAgent(loop).send_message(text)
    except ConversationBusyError:
        return False
    return True


@bp.after_request
def security_headers(response: Response) -> Response:
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    return response


# -- pages and actions ------------------------------------------------------------


@bp.get("/")
def index() -> Any:
    current_user()
    return render_template("chat/new.html")


@bp.post("/")
def start() -> Any:
    text = (request.form.get("message") or "").strip()
    if not text:
        return redirect(url_for(".index"), 303)
    loop = WeatherAgent.start(subject=(SUBJECT_TYPE, current_user()), message=text)
    return redirect(url_for(".conversation", loop_id=loop.id), 303)


@bp.get("/<int:loop_id>")
def conversation(loop_id: int) -> Any:
    loop = own_loop(loop_id)
    return render_template("chat/conversation.html", loop_id=loop.id, kinds=",".join(KINDS))


@bp.get("/<int:loop_id>/events")
def events(loop_id: int) -> Response:
    return solidloop.sse_response(loop_id, authorize=owns, render=render)


@bp.post("/<int:loop_id>/messages")
def follow_up(loop_id: int) -> Any:
    loop = own_loop(loop_id)
    text = (request.form.get("message") or "").strip()
    if not text:
        return Response("Type a message first.", status=400, mimetype="text/plain")
    if not send_message(loop, text):
        return Response("The agent has not finished yet: wait for its answer (or decide on "
                        "its tool call), then send.", status=409, mimetype="text/plain")
    # A fresh stream element: the stream of the finished answer has closed (its
    # ``end``); the new one resumes after the last event this page applied.
    return render_template("chat/_stream.html", loop_id=loop.id, kinds=",".join(KINDS))


@bp.post("/<int:loop_id>/calls/<int:call_id>/<any(approve, deny):decision>")
def decide(loop_id: int, call_id: int, decision: str) -> Any:
    loop = own_loop(loop_id)
    agent = WeatherAgent(loop)
    try:
        if decision == "approve":
            agent.approve(call_id, by=f"chat user {loop.subject_id}")
        else:
            agent.deny(call_id, reason="The user denied it in the chat.",
                       by=f"chat user {loop.subject_id}")
    except DecisionConflictError as exc:
        return Response(str(exc), status=409, mimetype="text/plain")
    # The stream shows the decision (approval_decided) to every open tab.
    return Response(status=204)


# -- the stream, rendered for htmx ------------------------------------------------
# Every fragment is an out-of-band swap, so the one element of the page that
# receives the stream never changes; each names where it goes.

OUTER = Markup(' hx-swap-oob="outerHTML"')  # replace the element of the same id


def append_to(target_id: str, html: Markup | str, *, tag: str = "div") -> Markup:
    """``html`` appended inside the element ``#target_id``."""
    return Markup('<{tag} hx-swap-oob="beforeend:#{target}">{html}</{tag}>').format(
        tag=Markup(tag), target=target_id, html=html)


def text_html(text: str | None) -> Markup:
    """Model output as HTML text: escaped, and a carriage return as a character
    reference (a raw one would end an SSE line, and HTML parsing drops it)."""
    return Markup(str(escape(text or "")).replace("\r", "&#13;"))


def delete(element_id: str) -> Markup:
    return Markup('<div id="{id}" hx-swap-oob="delete"></div>').format(id=element_id)


def bubble(message_id: int | None, role: str, text: Markup, *, done: bool,
           oob: str = "") -> Markup:
    return Markup('<div id="msg-{id}" class="bubble {role}{done}" data-role="{role}"{oob}>'
                  '<div id="msg-{id}-text" class="text">{text}</div></div>').format(
        id=message_id, role=role, done=Markup(" done") if done else "", oob=Markup(oob), text=text)


def render(event: StreamEvent) -> str | None:
    """One stream event as the HTML the page swaps in; None skips it."""
    kind, data = event.kind, event.data
    if kind in ("status_changed", "completed", "failed"):
        status = str(data.get("status") or kind)
        error = f": {data['error']}" if data.get("error") else ""
        return Markup('<span id="status" class="status" data-status="{s}"{oob}>{s}{e}</span>'
                      ).format(s=status, e=error, oob=OUTER)
    if kind == "message_started":
        role = str(data.get("role"))
        if role not in ("user", "assistant"):
            return None
        # A user message arrives whole; an assistant's starts empty, deltas follow.
        return append_to("conversation", bubble(event.message_id, role, text_html(event.text),
                                                done=role == "user"))
    if kind == "text_delta":
        return append_to(f"msg-{event.message_id}-text", text_html(event.text), tag="span")
    if kind == "message_completed":
        if data.get("role") != "assistant":
            return None
        if not event.text:  # a turn that only called tools: no words to keep
            return delete(f"msg-{event.message_id}")
        # The stored text replaces what the deltas built (they add up to it).
        return bubble(event.message_id, "assistant", text_html(event.text), done=True,
                      oob=OUTER)
    if kind == "message_discarded":  # a turn retried after its worker died: drop it
        return delete(f"msg-{event.message_id}")
    if kind == "tool_call":
        arguments = json.dumps(data.get("arguments"), ensure_ascii=False, indent=1)
        card = render_template("chat/_tool_call.html", call_id=event.tool_call_id,
                               name=data.get("name"), arguments=arguments)
        return append_to("conversation", Markup(card))  # autoescaped by Jinja
    if kind == "approval_requested":
        return render_template("chat/_approval.html", loop_id=event.loop_id,
                               call_id=event.tool_call_id, oob=OUTER)
    if kind == "approval_decided":
        who = f" by {data['by']}" if data.get("by") else ""
        why = f": {data['reason']}" if data.get("reason") else ""
        return Markup('<div id="call-{id}-approval" class="approval decided" '
                      'data-decision="{d}"{oob}>{d}{who}{why}</div>').format(
            id=event.tool_call_id, d=data.get("decision"), who=who, why=why, oob=OUTER)
    if kind == "tool_result":
        return Markup('<pre id="call-{id}-result" class="result{err}" data-done="1"{oob}>'
                      '{text}</pre>').format(
            id=event.tool_call_id, err=Markup(" error") if data.get("is_error") else "",
            text=text_html(event.text), oob=OUTER)
    return None
