"""Inline continuation (runtime/inline.py): the thread that commits a loop's step
runs the loop's next step itself. A step it adopts is claimed in the previous
step's own commit and has no job row (its lease is the record); one it does
not (the hop budget's last step, a step a commit could not claim) is a plain
job, delivered by a consumer.

These run a real ``dramatiq.Worker`` in the test process (its worker threads are
what continues inline) on the app's PostgreSQL broker, against the LLM emulator.
"""

from __future__ import annotations

import contextlib
import logging
import time

import dramatiq
import psycopg
import pytest
from sqlalchemy import select

from flask_solidloop.loops import store
from flask_solidloop.models import Job, Loop, Message, ToolCall
from flask_solidloop.state import get_state

from ..support.support_app import SIDE_EFFECTS, Assistant, create_app

TURN_ACTORS = ("solidloop.llm_turn", "solidloop.tool_call")


def script_chain(llm, tools: int) -> None:
    """A loop of ``tools`` one-call turns then an answer: add(0, 1), add(1, 1), ..."""
    llm.script("chain", {"tool_calls": [{"name": "add", "arguments": {"a": 0, "b": 1}}]})
    for n in range(1, tools):
        llm.script(lambda body, n=n: body["messages"][-1].get("content") == str(n),
                   {"tool_calls": [{"name": "add", "arguments": {"a": n, "b": 1}}]})
    llm.script(lambda body: body["messages"][-1].get("content") == str(tools),
               {"content": "done"})


class JobLines(logging.Handler):
    """The ``job start`` and ``job done`` records of flask_solidloop.jobs."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[logging.LogRecord] = []
        self.ends: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("job start"):
            self.starts.append(record)
        elif record.getMessage().startswith("job done"):
            self.ends.append(record)


@contextlib.contextmanager
def lines_at(level: int):
    handler = JobLines()
    logger = logging.getLogger("flask_solidloop.jobs")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@pytest.fixture
def job_lines():
    """Every job line, inline steps' DEBUG start lines too."""
    with lines_at(logging.DEBUG) as handler:
        yield handler


def run_worker_until(app, session, loop_ids, *, threads: int = 1, timeout: float = 60.0):
    """A real dramatiq worker on the app's broker until the loops are finished and
    no turn job is live (a guard against hanging the suite, not a speed check)."""
    worker = dramatiq.Worker(get_state(app).broker, worker_threads=threads, worker_timeout=100)
    worker.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            session.expire_all()
            open_loops = session.scalars(select(Loop.id).where(
                Loop.id.in_(loop_ids), Loop.status.in_(("queued", "running")))).all()
            live = session.scalars(select(Job.id).where(
                Job.actor_name.in_(TURN_ACTORS), Job.state.in_(("queued", "running")))).all()
            session.rollback()
            if not open_loops and not live:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"loops {open_loops} / jobs {live} still open")
            time.sleep(0.05)
    finally:
        worker.stop(timeout=10000)


@contextlib.contextmanager
def own_app(**config):
    """An app with its own settings (the ``app`` fixture's are the defaults)."""
    app = create_app(**config)
    try:
        with app.app_context():
            yield app, get_state(app).db.session
            get_state(app).db.session.remove()
            for engine in app.extensions["sqlalchemy"].engines.values():
                engine.dispose()
    finally:
        get_state(app).stop_renewer()
        get_state(app).broker.close()


def turn_jobs(session):
    session.expire_all()
    return list(session.scalars(select(Job).where(Job.actor_name.in_(TURN_ACTORS))
                                .order_by(Job.id)))


def assert_completed_once(session, loop_id: int, calls: int) -> None:
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert loop.status == "completed", loop.error_message
    rows = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)))
    assert len(rows) == calls and all(c.executed_at and c.response_message_id for c in rows)
    answers = session.scalars(select(Message.tool_call_id).where(
        Message.loop_id == loop_id, Message.role == "tool")).all()
    assert sorted(answers) == sorted(c.id for c in rows)  # one answer per call


def test_a_loop_runs_on_its_thread_from_turn_to_turn(app, session, llm, job_lines):
    script_chain(llm, tools=3)
    SIDE_EFFECTS.clear()
    loop = Assistant.start(message="chain")
    run_worker_until(app, session, [loop.id])
    assert_completed_once(session, loop.id, calls=3)
    jobs = turn_jobs(session)
    # Only the delivered first turn is a job: each later turn was claimed by
    # the commit of the turn before it (adopted), so nothing was enqueued.
    assert [(j.actor_name, j.state, j.attempts) for j in jobs] == [
        ("solidloop.llm_turn", "done", 1)]
    assert len(SIDE_EFFECTS) == 3
    # The first turn was delivered by the consumer; every later job ran inline,
    # on the thread that committed the job before it.
    inline = [r.solidloop_inline for r in job_lines.starts]
    assert inline == [False] + [True] * 6
    assert len({r.thread for r in job_lines.starts}) == 1
    assert all(r.getMessage().endswith(" inline") for r in job_lines.starts[1:])


def test_a_delivered_job_its_own_claim_marked_done_is_not_acknowledged_again(
        app, session, llm, monkeypatch):
    """The delivered first turn marks its job done in its claim's statement and
    the thread goes on inline; when the chain ends, the consumer's
    acknowledgement (which would match no row) is skipped. Every statement
    of every thread is watched: the job is written done exactly once."""
    script_chain(llm, tools=2)
    sent: list[str] = []
    execute = psycopg.Cursor.execute

    def observed(cursor, query, *args, **kwargs):
        sent.append(query if isinstance(query, str) else str(query))
        return execute(cursor, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", observed)
    loop = Assistant.start(message="chain")
    run_worker_until(app, session, [loop.id])
    monkeypatch.undo()
    assert_completed_once(session, loop.id, calls=2)
    done_writes = [q for q in sent if "UPDATE solidloop_jobs SET state = 'done'" in q]
    assert len(done_writes) == 1 and done_writes[0].startswith("WITH seen AS"), done_writes
    assert [(j.actor_name, j.state) for j in turn_jobs(session)] == [("solidloop.llm_turn", "done")]


def test_at_info_an_inline_step_logs_its_end_and_a_delivered_job_both(app, session, llm):
    """The default level: the delivered first turn logs its start and its end;
    each step the thread continued inline logs only its end, marked inline
    (its start line is DEBUG)."""
    script_chain(llm, tools=2)
    with lines_at(logging.INFO) as lines:
        loop = Assistant.start(message="chain")
        run_worker_until(app, session, [loop.id])
    assert_completed_once(session, loop.id, calls=2)
    assert [(r.solidloop_job, r.solidloop_inline) for r in lines.starts] == [("llm_turn", False)]
    assert [(r.solidloop_job, r.solidloop_inline) for r in lines.ends] == [
        ("llm_turn", False), ("tool_call", True), ("llm_turn", True), ("tool_call", True),
        ("llm_turn", True)]
    assert all(r.getMessage().endswith("s inline") for r in lines.ends[1:])
    assert all(r.solidloop_loop_id == loop.id for r in lines.starts + lines.ends)


def test_with_inline_continuation_off_every_job_goes_through_a_consumer(
        database_url, llm, job_lines):
    llm.reset()  # the suite's emulator is reset by the app fixture, unused here
    script_chain(llm, tools=2)
    with own_app(SOLIDLOOP_INLINE_CONTINUATION=False) as (app, session):
        loop = Assistant.start(message="chain")
        run_worker_until(app, session, [loop.id])
        assert_completed_once(session, loop.id, calls=2)
        assert {(j.state, j.attempts) for j in turn_jobs(session)} == {("done", 1)}
    assert [r.solidloop_inline for r in job_lines.starts] == [False] * 5


def test_the_hop_budget_hands_the_next_job_back_to_the_queue(database_url, llm, job_lines):
    """At the end of its budget a thread yields when another job waits for a
    thread: here a second loop's first turn, fetched by the one consumer while
    the only thread runs the first loop."""
    llm.reset()
    script_chain(llm, tools=3)
    with own_app(SOLIDLOOP_INLINE_MAX_HOPS=2) as (app, session):
        loop = Assistant.start(message="chain")
        other = Assistant.start(message="chain")
        run_worker_until(app, session, [loop.id, other.id])
        assert_completed_once(session, loop.id, calls=3)
        assert_completed_once(session, other.id, calls=3)
        jobs = [j for j in turn_jobs(session) if j.loop_id == loop.id]
        assert {(j.state, j.attempts) for j in jobs} == {("done", 1)}
        # The first inline hop is adopted; the second runs with adoption off,
        # so its continuation is a job of its own, delivered by the consumer.
        assert [j.actor_name for j in jobs] == ["solidloop.llm_turn", "solidloop.tool_call",
                                                "solidloop.llm_turn"]
    # Two inline jobs after each delivered one; the third is woken and delivered.
    mine = [r.solidloop_inline for r in job_lines.starts if r.solidloop_loop_id == loop.id]
    assert mine == [False, True, True] * 2 + [False]


def test_with_nothing_waiting_the_hop_budget_starts_over(database_url, llm, job_lines):
    """A loop alone keeps its thread past the budget: yielding would only move it
    to another thread (the worker's other threads are idle)."""
    llm.reset()
    script_chain(llm, tools=3)
    with own_app(SOLIDLOOP_INLINE_MAX_HOPS=2) as (app, session):
        loop = Assistant.start(message="chain")
        run_worker_until(app, session, [loop.id], threads=2)
        assert_completed_once(session, loop.id, calls=3)
        # Only the first turn was ever a job.
        assert [j.actor_name for j in turn_jobs(session)] == ["solidloop.llm_turn"]
    assert [r.solidloop_inline for r in job_lines.starts] == [False] + [True] * 6


def test_the_first_parallel_call_stays_on_the_turns_thread_the_others_are_woken(
        app, session, llm, job_lines):
    llm.script("three at once", {"tool_calls": [
        {"name": "add", "arguments": {"a": n, "b": n}} for n in range(3)]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "summed"})
    loop = Assistant.start(message="three at once")
    run_worker_until(app, session, [loop.id], threads=3)
    assert_completed_once(session, loop.id, calls=3)
    jobs = turn_jobs(session)
    assert {(j.state, j.attempts) for j in jobs} == {("done", 1)}
    # The first call is leased to the LLM turn's thread in the turn's commit
    # (no job: the consumer woken for the other two cannot take it); the other
    # two are jobs, run on the other threads. Each call started once.
    assert sorted(j.actor_name for j in jobs) == ["solidloop.llm_turn"] + \
        ["solidloop.tool_call"] * 2
    tool_starts = [r for r in job_lines.starts if r.solidloop_job == "tool_call"]
    assert sorted(r.solidloop_inline for r in tool_starts) == [False, False, True]
    assert len({r.solidloop_tool_call_id for r in tool_starts}) == 3


# -- adoption: the step's commit claims its successor (loops/store) -----------------


def loop_jobs(session, loop_id: int, actor: str) -> list[Job]:
    session.expire_all()
    return list(session.scalars(select(Job).where(Job.loop_id == loop_id,
                                                  Job.actor_name == actor)))


def adopt_first_call(app, session, llm):
    """Run a loop's first LLM turn the way a worker thread does when it continues
    inline (adoption on): its commit leases the call to us."""
    from flask_solidloop.runtime.turns import llm_turn_job

    llm.script("add please", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "3"})
    state = get_state(app)
    loop = Assistant.start(message="add please")
    # Its first job stands for the one a consumer delivered: done.
    session.execute(Job.__table__.update().where(Job.loop_id == loop.id).values(state="done"))
    session.commit()
    adopted = llm_turn_job(state, loop.id, adopt=True)
    return state, loop, adopted


def test_an_adopted_tool_call_is_leased_in_the_turns_commit_with_no_job(app, session, llm):
    from flask_solidloop.leases import worker_identity

    _state, loop, adopted = adopt_first_call(app, session, llm)
    assert isinstance(adopted, store.AdoptedToolCall) and adopted.sole_call
    session.expire_all()
    (call,) = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id))
    assert (call.lease_token, call.lease_holder) == (adopted.lease_token, worker_identity())
    assert call.leased_until is not None and call.executed_at is None
    assert (adopted.tool_call_id, adopted.execution_token) == (
        call.id, session.get(Loop, loop.id).execution_token)
    assert loop_jobs(session, loop.id, "solidloop.tool_call") == []


def test_without_adoption_the_turn_end_writes_a_job(app, session, llm):
    """The same turn run with adoption off (a drain, the hop budget's last step):
    the call gets a job, due now, and nothing is leased."""
    from flask_solidloop.runtime.turns import llm_turn_job

    llm.script("add please", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    state = get_state(app)
    loop = Assistant.start(message="add please")
    session.execute(Job.__table__.update().where(Job.loop_id == loop.id).values(state="done"))
    session.commit()
    assert llm_turn_job(state, loop.id, adopt=False) is None
    session.expire_all()
    (call,) = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id))
    assert call.lease_token is None
    (job,) = loop_jobs(session, loop.id, "solidloop.tool_call")
    assert job.state == "queued" and job.message["args"][0] == call.id


def test_a_handed_back_tool_call_is_a_job_again_and_the_loop_finishes(
        app, session, llm, drain):
    state, loop, adopted = adopt_first_call(app, session, llm)
    assert store.release_tool_call(state, session, adopted)
    session.expire_all()
    call = session.get(ToolCall, adopted.tool_call_id)
    assert (call.lease_token, call.leased_until, call.lease_holder) == (None, None, None)
    (job,) = loop_jobs(session, loop.id, "solidloop.tool_call")
    assert job.state == "queued"
    assert not store.release_tool_call(state, session, adopted)  # the lease is gone
    drain()
    assert_completed_once(session, loop.id, calls=1)


def test_an_adopted_llm_turn_runs_under_its_claim_or_is_handed_back(
        app, session, llm, drain):
    from flask_solidloop.runtime.inline import hand_back
    from flask_solidloop.runtime.turns import run_adopted

    state, loop, adopted_call = adopt_first_call(app, session, llm)
    # The tool turn, continuing inline: its answer's commit claims the next LLM turn.
    adopted = run_adopted(state, adopted_call, True)
    assert isinstance(adopted, store.AdoptedLlmTurn)
    session.expire_all()
    held = session.get(Loop, loop.id)
    assert (held.status, held.execution_token) == ("running", adopted.claim.token)
    assert held.lease_expires_at is not None
    assert loop_jobs(session, loop.id, "solidloop.llm_turn")[0].state == "done"  # the first
    assert len(loop_jobs(session, loop.id, "solidloop.llm_turn")) == 1  # no new job
    session.rollback()
    # Handed back (a stopping worker): queued again with a job, and only once.
    hand_back(state, adopted)
    assert not store.requeue_llm_turn(state, session, loop.id, adopted.claim.token)
    session.expire_all()
    assert session.get(Loop, loop.id).status == "queued"
    assert [j.state for j in loop_jobs(session, loop.id, "solidloop.llm_turn")] == [
        "done", "queued"]
    # The stale adoption finds the loop moved on and does nothing.
    assert run_adopted(state, adopted, True) is None
    assert len(llm.requests) == 1
    drain()
    assert_completed_once(session, loop.id, calls=1)
    assert len(llm.requests) == 2


def test_adopted_steps_start_from_the_rows_their_commit_returned(app, session, llm,
                                                                monkeypatch):
    """The commit that adopts a step reads its rows back whole (RETURNING *); the
    step starts from them: neither the job log nor the turn reads the loop or
    the call again. Only the delivered first turn reads its loop."""
    import re

    script_chain(llm, tools=3)
    reads: list[str] = []
    execute = psycopg.Cursor.execute

    def observed(cursor, query, *args, **kwargs):
        text = query if isinstance(query, str) else str(query)
        if text.lstrip().startswith("SELECT") and "FROM solidloop_" in text:
            reads.append(text)
        return execute(cursor, query, *args, **kwargs)

    loop_id = Assistant.start(message="chain").id
    # Every statement, the ORM's and the plain ones on the driver connection.
    monkeypatch.setattr(psycopg.Cursor, "execute", observed)
    try:
        run_worker_until(app, session, [loop_id])
    finally:
        monkeypatch.undo()
    assert_completed_once(session, loop_id, calls=3)
    # The test's own polling reads loops by status; the turns' reads by id are
    # the ones that count here.
    by_id = re.compile(r"FROM solidloop_loops\s+WHERE (solidloop_loops\.)?id = ")
    loop_by_id = [s for s in reads if by_id.search(s)]
    call_with_loop = [s for s in reads if "JOIN solidloop_loops" in s]
    # Nor a call by id: what a step reads of its call after the tool ran comes
    # from the facts it read before (the call object is expired by then).
    call_by_id = [s for s in reads if re.search(
        r"FROM solidloop_tool_calls\s+WHERE solidloop_tool_calls\.id = ", s)]
    assert len(loop_by_id) == 1, loop_by_id
    assert call_with_loop == []
    assert call_by_id == [], call_by_id


def test_a_turn_end_that_is_its_whole_transaction_runs_in_autocommit(
        app, session, llm, monkeypatch):
    """A turn's end with nothing else to commit (a final answer, or one call this
    thread adopts) is one statement sent in autocommit: no BEGIN, no COMMIT. One
    whose other calls are enqueued with it runs in a transaction with their jobs."""
    ends: list[tuple[bool, int]] = []
    execute = psycopg.Cursor.execute

    def observed(cursor, query, *args, **kwargs):
        text = query if isinstance(query, str) else str(query)
        if text.startswith("WITH fenced AS (UPDATE solidloop_loops"):
            calls = len(args[0].get("call_names", []))  # the calls the turn ends with
            ends.append((cursor.connection.autocommit, calls))
        return execute(cursor, query, *args, **kwargs)

    script_chain(llm, tools=2)
    llm.script("fan out", {"tool_calls": [{"name": "add", "arguments": {"a": 5, "b": 1}},
                                          {"name": "add", "arguments": {"a": 6, "b": 1}}]})
    llm.script(lambda body: body["messages"][-1].get("role") == "tool"
               and body["messages"][-2].get("role") == "tool", {"content": "fanned"})
    chain = Assistant.start(message="chain").id
    monkeypatch.setattr(psycopg.Cursor, "execute", observed)
    try:
        run_worker_until(app, session, [chain])
        chain_ends = list(ends)
        ends.clear()
        fan = Assistant.start(message="fan out").id
        run_worker_until(app, session, [fan])
    finally:
        monkeypatch.undo()
    assert_completed_once(session, chain, calls=2)
    assert_completed_once(session, fan, calls=2)
    # Two one-call turns and the answer: each end alone.
    assert chain_ends == [(True, 1), (True, 1), (True, 0)]
    # The parallel pair's end carries the second call's job: a transaction.
    assert ends == [(False, 2), (True, 0)]


def test_a_row_object_is_loaded_and_unchanged_in_the_session(app, session):
    from sqlalchemy import event
    from sqlalchemy import inspect as sa_inspect

    from flask_solidloop.loops import queries

    loop = Assistant.start(message="hello")
    loop_id = loop.id
    row = dict(session.execute(select(Loop.__table__).where(Loop.id == loop_id))
               .mappings().one())
    session.expunge_all()
    obj = queries.row_object(session, Loop, row)
    state = sa_inspect(obj)
    assert state.persistent and not state.modified and not state.expired_attributes
    statements: list[str] = []
    engine = get_state(app).db.engine
    listen = lambda *args: statements.append(args[2])  # noqa: E731
    event.listen(engine, "before_cursor_execute", listen)
    try:
        assert session.get(Loop, loop_id) is obj and obj.status == row["status"]
    finally:
        event.remove(engine, "before_cursor_execute", listen)
    assert statements == []
    # A row for an object already in the session refreshes it, unchanged.
    again = queries.row_object(session, Loop, {**row, "step_count": 7})
    assert again is obj and obj.step_count == 7 and not sa_inspect(obj).modified
    session.rollback()


def test_an_adopted_turns_shell_commits_with_the_tool_answer(app, session, llm):
    """For the default LLM stack (its request right after its initialization)
    the tool answer's commit that adopts the next turn also writes that turn's
    shell: both rows carry that transaction's now(). The turn itself then
    commits nothing before its request."""
    script_chain(llm, tools=3)
    loop_id = Assistant.start(message="chain").id
    run_worker_until(app, session, [loop_id])
    assert_completed_once(session, loop_id, calls=3)
    messages = list(session.scalars(select(Message).where(Message.loop_id == loop_id)
                                    .order_by(Message.id)))
    answers = [m for m in messages if m.role == "tool"]
    assert len(answers) == 3
    for answer in answers:
        shells = [m for m in messages if m.role == "assistant"
                  and m.created_at == answer.created_at]
        assert len(shells) == 1 and shells[0].status == "completed", shells
        # Written in one statement with the answer, the shell still comes after
        # it: the conversation is ordered by message id.
        assert shells[0].id > answer.id
    first = next(m for m in messages if m.role == "assistant")  # the delivered turn's
    assert first.created_at not in {a.created_at for a in answers}


class PassThrough:
    """A host middleware that only calls the next step."""

    def __init__(self, next_step):
        self.next_step = next_step

    def __call__(self, ctx):
        return self.next_step(ctx)


def test_a_stack_with_a_step_between_initialization_and_request_opens_its_own_shell(
        app, session, llm):
    from flask_solidloop.pipeline import AgentInitialization
    from flask_solidloop.pipeline.plan import stack_plan

    from ..support.support_app import solidloop

    class WithAStepBetween(Assistant):
        def configure_llm_middlewares(self, builder) -> None:
            builder.insert_after(AgentInitialization, PassThrough)

    state = get_state(app)
    assert stack_plan(state, Assistant(None)).open_shell
    assert not stack_plan(state, WithAStepBetween(None)).open_shell
    # End to end: the claim leaves the shell to the turn, which opens it itself.
    solidloop.agent("step_between")(WithAStepBetween)
    script_chain(llm, tools=1)
    loop_id = WithAStepBetween.start(message="chain").id
    run_worker_until(app, session, [loop_id])
    assert_completed_once(session, loop_id, calls=1)


def test_an_adopted_turn_sends_the_history_its_claim_read(app, session, llm, monkeypatch):
    """The tool answer that adopts the next turn reads that turn's history under
    the loop row lock (a sole call's answer: in the answer's own statement);
    the turn sends it without reading it again, and it is the whole
    conversation, as a fresh read would give it."""
    import inspect

    from flask_solidloop.loops import queries

    real_history = queries.history
    from_rows = queries.history_from_rows
    reads: list[tuple[str, int]] = []

    def history_from_rows(rows):
        result = from_rows(rows)
        adopting = {"_outcome"}
        where = ("adoption" if any(f.function in adopting for f in inspect.stack())
                 else "turn")
        reads.append((where, len(result)))
        return result

    monkeypatch.setattr(queries, "history_from_rows", history_from_rows)
    script_chain(llm, tools=3)
    loop_id = Assistant.start(message="chain").id
    run_worker_until(app, session, [loop_id])
    assert_completed_once(session, loop_id, calls=3)
    # The delivered first turn reads its own; each answer reads the next turn's,
    # two messages longer each time (the model's call and its answer).
    assert reads == [("turn", 2), ("adoption", 4), ("adoption", 6), ("adoption", 8)]
    sent = [request.json["messages"] for request in llm.requests]
    assert [len(messages) for messages in sent] == [2, 4, 6, 8]
    monkeypatch.setattr(queries, "history_from_rows", from_rows)
    final = real_history(session, loop_id)
    session.rollback()
    # What the last turn sent is the stored conversation up to its own answer.
    assert [m["role"] for m in sent[-1]] == [m.role for m in final[:-1]]
    assert sent[-1][-1]["content"] == "3" and final[-1].content == "done"
    # The calls and their answers, paired as a fresh read pairs them.
    asked = [call["id"] for m in sent[-1] for call in m.get("tool_calls") or []]
    assert asked == [call.call_id for m in final for call in m.tool_calls]
    assert [(m["tool_call_id"], m["content"]) for m in sent[-1] if m["role"] == "tool"] == [
        (m.tool_call_id, m.content) for m in final if m.role == "tool"]


def test_a_host_middleware_before_initialization_reads_its_turns_history_itself(app):
    """A middleware ahead of AgentInitialization may change the conversation
    before it is read: then the adopting answer leaves the read to the turn."""
    from flask_solidloop.pipeline import AgentInitialization, NetworkCalling
    from flask_solidloop.pipeline.plan import stack_plan

    class WithAStepAhead(Assistant):
        def configure_llm_middlewares(self, builder) -> None:
            builder.insert_before(AgentInitialization, PassThrough)

    class WithAStepBetween(Assistant):
        def configure_llm_middlewares(self, builder) -> None:
            builder.insert_before(NetworkCalling, PassThrough)

    state = get_state(app)
    default = stack_plan(state, Assistant(None))
    assert default.open_shell and default.read_history
    ahead = stack_plan(state, WithAStepAhead(None))
    assert ahead.open_shell and not ahead.read_history
    between = stack_plan(state, WithAStepBetween(None))
    assert not between.open_shell and between.read_history


def test_get_loop_loads_a_loop_as_session_get_would(app, session):
    from sqlalchemy import inspect as sa_inspect

    from flask_solidloop.loops import queries

    loop_id = Assistant.start(message="hello").id
    session.expunge_all()
    loop = queries.get_loop(session, loop_id)  # not in the session: a plain read
    state = sa_inspect(loop)
    assert state.persistent and not state.modified and loop.status == "queued"
    assert queries.get_loop(session, loop_id) is loop
    loop.error_message = "pending"
    # A change the session holds is never overwritten by a read.
    assert queries.get_loop(session, loop_id).error_message == "pending"
    session.rollback()
    assert queries.get_loop(session, loop_id).error_message is None
    assert queries.get_loop(session, 10**12) is None
    session.rollback()
