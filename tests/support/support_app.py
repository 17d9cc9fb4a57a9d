"""The Flask app our tests (and their real worker subprocesses) run.

Worker subprocesses load it with ``FLASK_APP='tests.support.support_app:create_app()'``;
the database URL and the LLM emulator URL reach them through the environment.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import dramatiq
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from pydantic import BaseModel
from sqlalchemy import select

from flask_solidloop import Agent, CallContext, SolidLoop, Toolset
from flask_solidloop.models import Loop, Message, ToolCall

DATABASE_URL_ENV = "SOLIDLOOP_TEST_DATABASE_URL"
#: In a worker subprocess: drop the connection under statements matching this.
DROP_PATTERN_ENV = "SOLIDLOOP_TEST_DROP_PATTERN"
DROP_TIMES_ENV = "SOLIDLOOP_TEST_DROP_TIMES"
DROP_AFTER_ENV = "SOLIDLOOP_TEST_DROP_AFTER"
LLM_URL_ENV = "SOLIDLOOP_TEST_LLM_URL"
DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_test"

db = SQLAlchemy()
solidloop = SolidLoop()
calc = Toolset("calc")

#: Every in-process side effect, with the idempotency key it ran under.
SIDE_EFFECTS: list[tuple[str, str | None]] = []
_effects_lock = threading.Lock()


@calc.tool
def add(a: int, b: int, ctx: CallContext) -> str:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    with _effects_lock:
        SIDE_EFFECTS.append(("add", ctx.idempotency_key))
    return str(a + b)


@calc.tool
def explode(reason: str) -> str:
    """Always raises, to exercise tool errors."""
    raise RuntimeError(f"exploded: {reason}")


@calc.tool
def lookup(key: str) -> dict:
    """Return a structured record."""
    return {"key": key, "value": len(key)}


def llm_settings() -> dict:
    return {"base_url": os.environ.get(LLM_URL_ENV, "http://127.0.0.1:9"), "model": "test-model",
            "api_key_env": "SOLIDLOOP_TEST_API_KEY", "read_timeout": 10}


@solidloop.agent("assistant")
class Assistant(Agent):
    system_prompt = "You are a test assistant."
    mcps = [{"name": "calc", "toolset": calc}]

    def llm(self) -> dict:
        return llm_settings()


#: The environment mark of the kept stdio server the "stdio_kept" agent runs,
#: so a test can find that server's process.
STDIO_KEPT_MARK = "support-app-stdio-kept"
_EVERYTHING = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), ".mcp-peers", "node_modules", ".bin", "mcp-server-everything")


@solidloop.agent("stdio_kept")
class StdioKeptAssistant(Agent):
    """Calls server-everything's echo over stdio: a server the worker keeps."""

    mcps = [{"name": "ev", "command": [_EVERYTHING, "stdio"], "timeout": 30,
             "env": {"SOLIDLOOP_TEST_MARK": STDIO_KEPT_MARK}, "tools": ["echo"]}]

    def llm(self):
        return llm_settings()


@solidloop.agent("streaming_assistant")
class StreamingAssistant(Agent):
    """The assistant, streaming its answers (and its reasoning into the loop's stream)."""

    system_prompt = "You are a test assistant."
    mcps = [{"name": "calc", "toolset": calc}]
    streaming = True
    stream_reasoning = True

    def llm(self) -> dict:
        return llm_settings()


@solidloop.agent("sequential")
class SequentialAssistant(Agent):
    system_prompt = "You run tools one at a time."
    mcps = [{"name": "calc", "toolset": calc}]
    sequential_tool_calls = True

    def llm(self) -> dict:
        return llm_settings()


class CompleteOnFullySuccessfulToolTurn:
    """The host-driven completion recipe: finish without a final LLM request."""

    def __init__(self, next_step):
        self.next_step = next_step

    def __call__(self, ctx):
        # Only when this turn follows tool results: a resume with a new user
        # message must still reach the model.
        if ctx.history and ctx.history[-1].role == "tool":
            session = ctx.session
            last = session.scalar(
                select(Message).where(Message.loop_id == ctx.loop_id,
                                      Message.role == "assistant",
                                      Message.status == "completed").order_by(Message.id.desc())
            )
            calls = list(session.scalars(select(ToolCall).where(ToolCall.message_id == last.id)))
            session.rollback()
            if calls and all(call.is_success for call in calls):
                ctx.transition(from_="running", to="completed")
                return None
        return self.next_step(ctx)


@solidloop.agent("batch")
class BatchAgent(Agent):
    system_prompt = "You write records with tools."
    mcps = [{"name": "calc", "toolset": calc}]

    def llm(self) -> dict:
        return llm_settings()

    def configure_llm_middlewares(self, builder) -> None:
        from flask_solidloop.pipeline import AgentInitialization

        builder.insert_after(AgentInitialization, CompleteOnFullySuccessfulToolTurn)


# -- chaos: an agent whose tool has an external side effect -------------------------

chaos_tools = Toolset("chaos")
CHAOS_TURNS_ENV = "SOLIDLOOP_CHAOS_TURNS"


# Its own timeout: it rides out a PostgreSQL restart for up to 60 s (below),
# longer than the chaos settings' short default tool timeout.
@chaos_tools.tool(timeout=90)
def effect(n: int, ctx: CallContext) -> str:
    """Record an external side effect (outside any of our transactions), then answer."""
    import random
    import time

    import psycopg

    from flask_solidloop.queue.broker import libpq_url

    url = libpq_url(os.environ.get(DATABASE_URL_ENV, DEFAULT_DATABASE_URL))
    # This "external system" lives in the PostgreSQL that the restart test takes
    # down, which no real one would; so, like a client of a real one, it retries
    # through an outage (for up to a minute) instead of failing the call. A retry
    # after an INSERT that committed counts as a duplicate effect, as a rerun does.
    deadline = time.monotonic() + 60
    while True:
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
                conn.execute(
                    "INSERT INTO chaos_effects (idempotency_key, loop_id, n, pid)"
                    " VALUES (%s, %s, %s, %s)",
                    (ctx.idempotency_key, ctx.loop.id if ctx.loop else None, n, os.getpid()),
                )
            break
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    time.sleep(random.uniform(0.0, 0.3))
    return f"effect {n} done"


@solidloop.agent("chaos")
class ChaosAgent(Agent):
    system_prompt = "You run chaos tools."
    mcps = [{"name": "chaos", "toolset": chaos_tools}]
    max_steps = 20
    streaming = True  # so kills also land mid-stream, between partial writes

    def llm(self) -> dict:
        settings = llm_settings()
        settings["read_timeout"] = float(os.environ.get("SOLIDLOOP_CHAOS_READ_TIMEOUT", "10"))
        return settings


# -- liveness: slow tools whose runs are logged outside our transactions ----------

slow_tools = Toolset("slow")
SLOW_EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS slow_effects (id bigserial PRIMARY KEY, "
    "idempotency_key text, phase text, pid integer, at timestamptz DEFAULT now())"
)


def _log_slow_effect(key: str | None, phase: str) -> None:
    import psycopg

    from flask_solidloop.urls import libpq_url

    url = libpq_url(os.environ.get(DATABASE_URL_ENV, DEFAULT_DATABASE_URL))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(SLOW_EFFECTS_DDL)
        conn.execute("INSERT INTO slow_effects (idempotency_key, phase, pid) VALUES (%s, %s, %s)",
                     (key, phase, os.getpid()))


@slow_tools.tool
def slow(seconds: float, ctx: CallContext) -> str:
    """Sleep, then answer with the pid that ran it; logs its start and its end."""
    import time

    _log_slow_effect(ctx.idempotency_key, "start")
    time.sleep(seconds)
    _log_slow_effect(ctx.idempotency_key, "end")
    return f"slept {seconds}s in {os.getpid()}"


@slow_tools.tool(timeout=1)
def hang_forever(ctx: CallContext) -> str:
    """Never return, ignoring every attempt to stop it (logs its start)."""
    import time

    _log_slow_effect(ctx.idempotency_key, "hang")
    while True:
        time.sleep(1)


@solidloop.agent("liveness")
class SlowAgent(Agent):
    system_prompt = "You run slow tools."
    mcps = [{"name": "slow", "toolset": slow_tools}]

    def llm(self) -> dict:
        return llm_settings()


@solidloop.agent("liveness_sequential")
class SlowSequentialAgent(Agent):
    system_prompt = "You run slow tools, one at a time."
    mcps = [{"name": "slow", "toolset": slow_tools}]
    sequential_tool_calls = True

    def llm(self) -> dict:
        return llm_settings()


@solidloop.agent("capped")
class CappedAgent(Agent):
    """Slow tools, at most two loops in flight (tests of the concurrency caps)."""

    system_prompt = "You run slow tools, two loops at a time."
    mcps = [{"name": "slow", "toolset": slow_tools}]
    max_concurrent_loops = 2

    def llm(self) -> dict:
        return llm_settings()


# -- a real llama-cpp-python server (tests/acceptance/test_provider_outage_llama_cpp.py) --

LLAMA_URL_ENV = "SOLIDLOOP_TEST_LLAMA_URL"


@solidloop.agent("llama")
class LlamaAgent(Agent):
    """Talks to a real llama-cpp-python server serving a tiny random model."""

    system_prompt = "You answer briefly."

    def llm(self) -> dict:
        return {**llm_settings(), "base_url": os.environ.get(LLAMA_URL_ENV, "http://127.0.0.1:9")}

    def llm_params(self) -> dict:
        return {"max_tokens": 8}


# -- bad input: tools whose output PostgreSQL cannot store as it is -----------------

odd_tools = Toolset("odd")


@odd_tools.tool
def unstorable(ctx: CallContext) -> str:
    """Answer with a NUL and a lone surrogate (after recording its side effect)."""
    _log_slow_effect(ctx.idempotency_key, "odd")
    return "before\x00after \ud800 end"


@odd_tools.tool
def odd_block(ctx: CallContext):
    """Answer with a hand-built result block holding a value JSON cannot."""
    import datetime

    from flask_solidloop import ToolResult

    _log_slow_effect(ctx.idempotency_key, "odd")
    return ToolResult(content=[{"type": "text", "text": "made at noon",
                                "at": datetime.datetime(2026, 12, 1, 12, 0)}])


@odd_tools.tool
def big(chars: int, ctx: CallContext) -> str:
    """Answer with ``chars`` characters."""
    _log_slow_effect(ctx.idempotency_key, "odd")
    return "x" * chars


@odd_tools.tool
def nested(value: dict) -> str:
    """Take any object."""
    return "took it"


@solidloop.agent("odd")
class OddAgent(Agent):
    system_prompt = "You use odd tools."
    mcps = [{"name": "odd", "toolset": odd_tools}]

    def llm(self) -> dict:
        return llm_settings()


@solidloop.agent("odd_streaming")
class OddStreamingAgent(OddAgent):
    streaming = True


# -- secrets: URLs with credentials in them ------------------------------------------

CANARY_LLM_URL_ENV = "SOLIDLOOP_TEST_CANARY_LLM_URL"
CANARY_MCP_URL_ENV = "SOLIDLOOP_TEST_CANARY_MCP_URL"


@solidloop.agent("canary")
class CanaryAgent(Agent):
    """Reaches its model and its MCP server through URLs that carry credentials."""

    system_prompt = "You use a remote tool."

    def llm(self) -> dict:
        return {**llm_settings(), "base_url": os.environ.get(CANARY_LLM_URL_ENV,
                                                             "http://127.0.0.1:9")}

    def mcps(self) -> list:
        url = os.environ.get(CANARY_MCP_URL_ENV)
        return [{"name": "remote", "url": url, "timeout": 10}] if url else []


# -- issue 16: tools for models without native tool calling ---------------------------
# The model writes its calls as text (<tool_call> blocks); ToolCallXmlParser turns them
# into real calls before the canonical write.


class XmlToolsAgent(Agent):
    """Tools sent natively; the server hands the model's <tool_call> text back as is."""

    system_prompt = "You write tool calls as text."
    mcps = [{"name": "calc", "toolset": calc}]

    def llm(self) -> dict:
        return llm_settings()

    def configure_llm_middlewares(self, builder) -> None:
        from flask_solidloop.pipeline import ResponseParsing, ToolCallXmlParser

        builder.insert_before(ResponseParsing, ToolCallXmlParser)


solidloop.agent("xml_tools")(XmlToolsAgent)


@solidloop.agent("xml_tools_streaming")
class XmlToolsStreamingAgent(XmlToolsAgent):
    streaming = True


@solidloop.agent("xml_prompted")
class XmlPromptedAgent(XmlToolsAgent):
    """A server with no tool support: tools in the system prompt, results as
    <tool_response> blocks in user messages (the default with tool_prompting)."""

    tool_prompting = "xml"


@solidloop.agent("xml_prompted_streaming")
class XmlPromptedStreamingAgent(XmlPromptedAgent):
    streaming = True


# -- database faults: an agent whose tool stack reads and writes in steps ------------


class AuditBeforeTool:
    """A host tool middleware before ToolExecution that reads the database (as an
    authorization check would): a point between the call's claim and its tool."""

    def __init__(self, next_step):
        self.next_step = next_step

    def __call__(self, ctx):
        ctx.session.execute(select(ToolCall.id).where(ToolCall.loop_id == ctx.loop_id)).all()
        ctx.session.rollback()
        return self.next_step(ctx)


class PassAfterTool:
    """Between ToolExecution and ResponseCreation: the result is then recorded
    (checkpointed) before, and apart from, its answer."""

    def __init__(self, next_step):
        self.next_step = next_step

    def __call__(self, ctx):
        return self.next_step(ctx)


@solidloop.agent("audited")
class AuditedAssistant(Agent):
    system_prompt = "You use audited tools."
    mcps = [{"name": "calc", "toolset": calc}]

    def llm(self) -> dict:
        return llm_settings()

    def configure_tool_middlewares(self, builder) -> None:
        from flask_solidloop.pipeline import ResponseCreation, ToolExecution

        builder.insert_before(ToolExecution, AuditBeforeTool)
        builder.insert_before(ResponseCreation, PassAfterTool)


# -- waiting tool calls: approvals and deferred results ------------------------------

shop = Toolset("shop")
#: Calls the ``on_wait`` hook saw, in the process that ran it.
WAIT_REQUESTS: list = []
#: The host's own queue (declared at import, so worker processes consume it).
notifications = solidloop.queue("notifications")


def notify_staff(tool_call_id: int) -> None:
    """The host's own job: tell someone a call waits."""
    _log_slow_effect(f"notify:{tool_call_id}", "notify")


@shop.tool(requires_approval=lambda arguments, ctx: arguments["amount"] > 50)
def refund(order: str, amount: float, ctx: CallContext) -> str:
    """Refund an order; over 50 it needs a person's approval."""
    _log_slow_effect(ctx.idempotency_key, "refund")
    return f"refunded {amount:g} on {order}"


@shop.tool(requires_approval=True)
def send_email(to: str, body: str, ctx: CallContext) -> str:
    """Send an email (always approved first)."""
    _log_slow_effect(ctx.idempotency_key, "email")
    return f"sent to {to}: {body}"


@shop.tool(deferred=True)
def ask_human(question: str) -> str:
    """Ask a person; the answer comes later."""
    raise AssertionError("a deferred tool is never run by the loop")


@shop.tool(requires_approval=True, approval_timeout=1.0, on_timeout="approve")
def nudge(note: str, ctx: CallContext) -> str:
    """Approved by itself after a second."""
    _log_slow_effect(ctx.idempotency_key, "nudge")
    return f"nudged: {note}"


@shop.tool(requires_approval=True, approval_timeout=1.0)
def risky(note: str, ctx: CallContext) -> str:
    """Denied by itself after a second."""
    _log_slow_effect(ctx.idempotency_key, "risky")
    return f"risky: {note}"


@shop.tool(deferred=True, result_timeout=1.0)
def webhook(ref: str) -> str:
    """Waits a second for a result."""
    raise AssertionError("a deferred tool is never run by the loop")


@shop.tool(requires_approval=True)
def slow_refund(order: str, wait: float, ctx: CallContext) -> str:
    """A refund whose gateway takes ``wait`` seconds to answer before it acts."""
    time.sleep(wait)
    _log_slow_effect(ctx.idempotency_key, "slow_refund")
    return f"refunded {order} after {wait:g}s"


@shop.tool
def lookup_order(order: str, ctx: CallContext) -> str:
    """Look an order up (never waits)."""
    _log_slow_effect(ctx.idempotency_key, "lookup")
    return f"order {order}: paid"


@solidloop.agent("shop")
class ShopAgent(Agent):
    system_prompt = "You run a shop."
    mcps = [{"name": "shop", "toolset": shop}]

    def llm(self) -> dict:
        return llm_settings()

    def on_wait(self, request, session) -> None:
        WAIT_REQUESTS.append(request)
        # The host's notification, committed with the wait (or not at all).
        notifications.enqueue(notify_staff, request.tool_call_id, session=session)
        if request.tool == "send_email" and (request.arguments or {}).get("to") == "boom":
            raise RuntimeError("the notifier failed")


@solidloop.agent("shop_sequential")
class SequentialShopAgent(ShopAgent):
    sequential_tool_calls = True


@solidloop.agent("shop_policy")
class PolicyShopAgent(ShopAgent):
    """Its policy gates lookups of VIP orders; a policy error gates too."""

    def approval_policy(self, tool_name, arguments, ctx) -> bool:
        if arguments.get("order") == "crash":
            raise RuntimeError("policy bug")
        return tool_name == "lookup_order" and str(arguments.get("order", "")).startswith("vip")


# -- exactly-once host writes: tickets closed by a tool the test kills ---------------

ticket_tools = Toolset("tickets")
TICKETS_DDL = (
    "CREATE TABLE IF NOT EXISTS chaos_tickets (id integer PRIMARY KEY, "
    "touches integer NOT NULL DEFAULT 0);"
    "CREATE TABLE IF NOT EXISTS chaos_ticket_runs (key text NOT NULL, pid integer, "
    "at timestamptz DEFAULT clock_timestamp());"
    "CREATE TABLE IF NOT EXISTS chaos_ticket_kills (id bigserial PRIMARY KEY, key text, "
    "pid integer, handled boolean NOT NULL DEFAULT false);"
    "CREATE TABLE IF NOT EXISTS chaos_ticket_closed (loop_id bigint PRIMARY KEY, "
    "runs integer NOT NULL DEFAULT 1)"
)


def _ticket_run_then_maybe_die(key: str | None) -> None:
    """Record this run outside every transaction of ours; on a call's first run,
    ask the test to SIGKILL this worker (the tool's body is done, its commit not
    yet) and wait for it."""
    import time

    import psycopg

    from flask_solidloop.urls import libpq_url

    url = libpq_url(os.environ.get(DATABASE_URL_ENV, DEFAULT_DATABASE_URL))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO chaos_ticket_runs (key, pid) VALUES (%s, %s)",
                     (key, os.getpid()))
        (runs,) = conn.execute("SELECT count(*) FROM chaos_ticket_runs WHERE key = %s",
                               (key,)).fetchone()
        if runs > 1:
            return
        conn.execute("INSERT INTO chaos_ticket_kills (key, pid) VALUES (%s, %s)",
                     (key, os.getpid()))
    time.sleep(60)  # the test kills this process meanwhile


@ticket_tools.tool(timeout=90)
def close_ticket(ticket: int, ctx: CallContext) -> str:
    """Close a ticket through the lent session: it commits with the result."""
    from sqlalchemy import text

    ctx.session.execute(text("UPDATE chaos_tickets SET touches = touches + 1 WHERE id = :id"),
                        {"id": ticket})
    _ticket_run_then_maybe_die(ctx.idempotency_key)
    return f"ticket {ticket} closed"


@ticket_tools.tool(timeout=90)
def close_ticket_committing(ticket: int, ctx: CallContext) -> str:
    """The same, committed by the tool itself: at least once."""
    from sqlalchemy import text

    ctx.session.execute(text("UPDATE chaos_tickets SET touches = touches + 1 WHERE id = :id"),
                        {"id": ticket})
    ctx.session.commit()
    _ticket_run_then_maybe_die(ctx.idempotency_key)
    return f"ticket {ticket} closed"


@solidloop.actor(queue_name="ticket_notices")
def ticket_closed_notice(loop_id: int) -> None:
    """The host's notification job, enqueued by the loop's end."""
    from sqlalchemy import text

    db.session.execute(text(
        "INSERT INTO chaos_ticket_closed (loop_id) VALUES (:id) "
        "ON CONFLICT (loop_id) DO UPDATE SET runs = chaos_ticket_closed.runs + 1"),
        {"id": loop_id})
    db.session.commit()


@solidloop.agent("tickets")
class TicketAgent(Agent):
    system_prompt = "You close tickets."
    mcps = [{"name": "tickets", "toolset": ticket_tools}]

    def llm(self) -> dict:
        return llm_settings()


@solidloop.on_loop_end(agent="tickets")
def notify_ticket_closed(loop: Loop, session) -> None:
    ticket_closed_notice.send_with_options(args=(loop.id,), session=session)


class WedgeWorkerThreads(dramatiq.Middleware):
    """Every worker thread blocks forever as it boots (tests/acceptance/test_fleet_workers.py)."""

    def after_worker_thread_boot(self, broker, thread) -> None:
        threading.Event().wait()


def create_app(**config) -> Flask:
    import json

    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get(DATABASE_URL_ENV, DEFAULT_DATABASE_URL)
    # Workers must survive a PostgreSQL restart: drop dead pooled connections.
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"pool_pre_ping": True}
    app.config["SOLIDLOOP_LLM_RETRY_BASE_DELAY"] = 0.05
    app.config["SOLIDLOOP_LLM_RETRY_MAX_DELAY"] = 0.5
    # Worker subprocesses get the test's settings (e.g. short leases) this way.
    app.config.update(json.loads(os.environ.get("SOLIDLOOP_TEST_APP_CONFIG", "{}")))
    app.config.update(config)
    # A test that reads a worker's log for inline steps' start lines (logged at
    # DEBUG, runtime/job_log.py) asks for them with this key.
    if app.config.get("TEST_JOBS_LOG_LEVEL"):
        logging.getLogger("flask_solidloop.jobs").setLevel(app.config["TEST_JOBS_LOG_LEVEL"])
    db.init_app(app)
    solidloop.init_app(app, db=db)
    if app.config.get("TEST_WEDGE_WORKER_THREADS"):
        # A worker process whose threads never take a job (stuck at boot), while
        # its consumers run: what a wedged process looks like to the queue.
        app.extensions["solidloop"].broker.add_middleware(WedgeWorkerThreads())
    # A worker subprocess of a tracing test: the OTel SDK, exporting to its receiver.
    from .otel import install_from_environment

    install_from_environment()
    drop = os.environ.get(DROP_PATTERN_ENV)
    if drop:
        # A worker subprocess of a fault test: drop the connection under the
        # first statements matching the pattern (tests/support/db_faults.py).
        from .db_faults import install_dropper

        install_dropper(app.config["SQLALCHEMY_DATABASE_URI"], drop,
                        times=int(os.environ.get(DROP_TIMES_ENV, "1")),
                        after=int(os.environ.get(DROP_AFTER_ENV, "0")))
    return app


# -- conversations: follow-up messages while a loop is live -------------------------


@solidloop.agent("chat")
class ChatAgent(Agent):
    """Streams; runs slow tools and an email that waits for approval. A new
    message while it is busy waits for the current work (the default)."""

    system_prompt = "You chat."
    mcps = [{"name": "slow", "toolset": slow_tools, "tools": ["slow"]},
            {"name": "shop", "toolset": shop, "tools": ["send_email"]}]
    streaming = True

    def llm(self) -> dict:
        return llm_settings()


@solidloop.agent("chat_interrupt")
class InterruptingChatAgent(ChatAgent):
    on_new_message = "interrupt"


@solidloop.agent("chat_reject")
class RejectingChatAgent(ChatAgent):
    on_new_message = "reject"


# -- compaction: long histories summarised (pipeline/compaction.py) -----------------

from flask_solidloop import Compaction  # noqa: E402
from flask_solidloop.pipeline import AgentInitialization  # noqa: E402

pages = Toolset("pages")
#: The text of every page: long enough that a few dozen turns pass the trigger.
PAGE_TEXT = "The quick brown fox jumps over the lazy dog. " * 12


@pages.tool
def read_page(page: int) -> str:
    """Read one page of the book."""
    return f"page {page}: {PAGE_TEXT}"


#: Summaries at 4,000 tokens, keeping the last two turns, by a named model.
COMPACTION = Compaction(trigger_tokens=4000, keep_last_turns=2,
                        summarizer={"model": "summary-model"})


@solidloop.agent("compacting")
class CompactingAgent(Agent):
    """Reads pages with tools for as many turns as the model asks; its history
    is compacted past 4,000 tokens."""

    system_prompt = "You read a book page by page."
    mcps = [{"name": "pages", "toolset": pages}]
    max_steps = 200

    def llm(self) -> dict:
        return llm_settings()

    def configure_llm_middlewares(self, builder) -> None:
        builder.insert_after(AgentInitialization, COMPACTION)


@solidloop.agent("quick_compacting")
class QuickCompactingAgent(CompactingAgent):
    """Compacts past 1,000 tokens (a few turns), keeping the last one, with
    its own model as the summarizer."""

    def configure_llm_middlewares(self, builder) -> None:
        builder.insert_after(AgentInitialization, QUICK_COMPACTION)


QUICK_COMPACTION = Compaction(trigger_tokens=1000, keep_last_turns=1)


# -- child agents (tests/support/children_app.py) ------------------------------------

from . import children_app  # noqa: E402,F401  (registers its agents on solidloop)

# -- structured output (docs/decisions/0036-structured-output.md) --------------------


class Profile(BaseModel):
    name: str
    city: str


@solidloop.agent("profiler")
class ProfileAgent(Agent):
    """Streams a structured answer validated as a Profile."""

    system_prompt = "You profile people."
    streaming = True
    output_type = Profile

    def llm(self) -> dict:
        return llm_settings()
