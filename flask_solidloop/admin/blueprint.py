"""The admin blueprint's views: dashboard (with the charts of admin/charts.py,
also per agent on ``/agents/<name>``), loops (list, page, live stream,
actions, bulk actions), jobs, workers and limits (rate-limit keys, subjects'
budgets), and ``metrics`` (Prometheus's text format, runtime/metrics.py); the
approvals views are admin/approvals.py's, registered here.

Reads go through ``loops.queries`` (``jobs.control`` for job rows,
``maintenance.runs`` for the last reaper and janitor passes), changes through
``loops.control`` and ``jobs.control``: the admin writes no row itself. Every
request first passes :func:`security.allowed` (fail closed) and, when unsafe,
the CSRF check; every response gets the CSP.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode

from flask import (
    Blueprint,
    Response,
    abort,
    current_app,
    redirect,
    render_template,
    request,
    stream_with_context,
    url_for,
)
from sqlalchemy import select
from werkzeug.datastructures import MultiDict

from ..errors import InvalidArgumentError, SolidLoopError
from ..jobs import control as jobs_control
from ..loops import bulk as bulk_jobs
from ..loops import control, listing, pending, queries, stats, wire_reads
from ..loops import export as exporting
from ..loops.lineage import lineage
from ..maintenance import runs as maintenance_runs
from ..models import RESUMABLE_STATUSES, Loop
from ..models.loop import ALL_STATUSES
from ..queue.middleware.worker_registry import MISSED_BEATS, WorkerRow, list_workers
from ..runtime import metrics as runtime_metrics
from ..spending import AgentLimits, Gauge, loop_budget, rate_keys, subjects, tightest
from ..state import SolidLoopState, get_state
from ..streaming import HEADERS
from ..telemetry import tracing
from . import approvals, charts, filters, format, live, passes, security

logger = logging.getLogger("flask_solidloop.admin")

#: A host hook: the subject's URL (str), or {"url": ..., "label": ...}, or None.
SubjectResolver = Callable[[Loop], "str | dict[str, Any] | None"]

#: The pages in the navigation, in order: (endpoint, label).
NAV: list[tuple[str, str]] = [
    ("dashboard", "Dashboard"),
    ("loops", "Loops"),
    ("approvals", "Approvals"),
    ("jobs", "Jobs"),
    ("workers", "Workers"),
    ("limits", "Limits"),
    ("inbound", "Inbound MCP"),
]
#: The dashboard counts waiting calls up to this many (and says "more than").
AWAITING_CAP = 10_000
#: How many subjects the Limits page shows, nearest their budget first.
LIMITS_SUBJECTS = 50
#: How far back the Workers page shows stopped and lost workers by default (s).
WORKERS_RECENT = 3600.0

#: Single-loop actions: name -> label. The loop page offers those
#: ``control.applicable`` lists for the loop's status.
ACTIONS = {
    "pause": "Pause", "resume": "Resume", "stop": "Stop", "force_stop": "Force stop",
    "freeze": "Freeze", "unfreeze": "Unfreeze", "observe": "Observe",
    "unobserve": "Stop observing",
}
#: Actions the loop page asks to confirm first (they end or lock a loop).
CONFIRMED_ACTIONS = {
    "stop": "Stop this loop? It fails with \"stopped by an operator\"; a resume can restart it.",
    "force_stop": "Force stop? The loop fails now, its queued jobs are cancelled and its "
                  "tool leases revoked; a tool already running may still finish its effect.",
    "freeze": "Freeze this loop? It pauses, and nothing resumes it until it is unfrozen.",
}
BULK_ACTIONS = {"resume": "Resume", "pause": "Pause", "stop": "Stop", "freeze": "Freeze",
                "unfreeze": "Unfreeze"}
STOP_REASON = "stopped by an operator in the admin"

#: Messages shown after an action (never text from the request).
RESULTS = {
    (True, "pause"): "Paused.", (False, "pause"): "Not paused: only a queued or running loop "
                                                  "can be paused.",
    (True, "resume"): "Resumed.", (False, "resume"): "Not resumed: the loop is live, frozen, or "
                                                     "not in one of the chosen statuses.",
    (True, "stop"): "Stopped.", (False, "stop"): "Not stopped: the loop has already ended.",
    (True, "force_stop"): "Force stopped: queued jobs cancelled, tool leases revoked.",
    (False, "force_stop"): "Not force stopped: the loop has already ended.",
    (True, "freeze"): "Frozen: resume refuses until it is unfrozen.",
    (False, "freeze"): "Not frozen: it is frozen already or has ended.",
    (True, "unfreeze"): "Unfrozen.", (False, "unfreeze"): "Not unfrozen: it was not frozen.",
    (True, "observe"): "Observing: partial text flushes more often.",
    (False, "observe"): "Already observed.",
    (True, "unobserve"): "No longer observed.", (False, "unobserve"): "It was not observed.",
}


@dataclass(frozen=True)
class SubjectLink:
    label: str
    url: str | None


def create_blueprint(*, authorize: security.Authorize | None,
                     subject_resolver: SubjectResolver | None = None,
                     name: str = "solidloop_admin", require_token: bool = False,
                     page_size: int = 50,
                     operator: approvals.Operator | None = None) -> Blueprint:
    """The admin blueprint; see :meth:`SolidLoop.admin_blueprint`."""
    bp = Blueprint(name, __name__, template_folder="templates", static_folder="static",
                   static_url_path="/_static")

    def state() -> SolidLoopState:
        return get_state()

    def identity() -> str:
        return request.headers.get("Cookie", "")

    @bp.before_request
    def gate() -> Any:
        if not security.allowed(authorize, request):
            why = ("the admin denies every request: pass authorize=... to "
                   "solidloop.admin_blueprint()" if authorize is None else "not authorized")
            return Response(why + "\n", status=403, mimetype="text/plain")
        if request.method in security.UNSAFE_METHODS:
            problem = security.csrf_problem(request, state().config.admin_trusted_origins)
            if problem is None and require_token:
                secret = current_app.secret_key
                if not secret or not security.token_ok(str(secret), identity(),
                                                       request.form.get("_csrf")):
                    problem = "request refused: missing or wrong CSRF token"
            if problem:
                return Response(problem + "\n", status=403, mimetype="text/plain")
        return None

    @bp.after_request
    def headers(response: Response) -> Response:
        return security.harden(response)

    @bp.context_processor
    def context() -> dict[str, Any]:
        token = None
        if require_token and current_app.secret_key:
            token = security.csrf_token(str(current_app.secret_key), identity())
        return {"sl_nav": NAV, "sl": format, "sl_bp": name, "sl_csrf": token,
                "sl_subject": subject, "sl_failure": failure_of, "sl_trace": trace_of,
                "sl_actions": ACTIONS, "sl_bulk_actions": BULK_ACTIONS,
                "sl_confirmed": CONFIRMED_ACTIONS, "sl_applicable": control.applicable,
                "sl_statuses": ALL_STATUSES, "sl_failures": queries.FAILURE_CLASS_NAMES,
                "sl_resumable": RESUMABLE_STATUSES}

    def trace_of(loop: Loop) -> dict[str, str | None] | None:
        """The loop's current run's trace id, linked by SOLIDLOOP_TRACE_URL."""
        trace_id = tracing.trace_id_of(loop.trace)
        if trace_id is None:
            return None
        template = state().config.trace_url
        return {"id": trace_id,
                "url": template.replace("{trace_id}", trace_id) if template else None}

    def subject(loop: Loop) -> SubjectLink | None:
        if loop.subject_type is None and loop.subject_id is None:
            return None
        label = loop.subject_label or ""
        resolved: Any = None
        if subject_resolver is not None:
            try:
                resolved = subject_resolver(loop)
            except Exception:
                logger.warning("subject_resolver raised for loop %s", loop.id, exc_info=True)
        url = resolved
        if isinstance(resolved, dict):
            url = resolved.get("url")
            label = str(resolved.get("label") or label)
        return SubjectLink(label, format.safe_url(url))

    def failure_of(loop: Loop) -> str | None:
        if loop.status == "failed":
            return queries.classify_failure(loop.error_message)
        if loop.status == "paused" and loop.error_message:
            found = queries.classify_failure(loop.error_message)
            return found if found in queries.PAUSING_CLASSES else None
        return None

    def spend_of(rows: list[Loop]) -> dict[int, Gauge]:
        """Each listed loop's tightest budget limit (loops without a budget: none)."""
        agents = AgentLimits(state())
        session = state().db.session
        found = {}
        for row in rows:
            top = tightest(agents.loop_gauges(session, row))
            if top is not None:
                found[row.id] = top
        return found

    def search_or_error(args: MultiDict[str, str]) -> tuple[queries.LoopSearch | None,
                                                            str | None]:
        try:
            return filters.parse(args), None
        except filters.FilterError as exc:
            return None, str(exc)

    # -- pages -----------------------------------------------------------------

    def registry(recent: float) -> list[WorkerRow]:
        # The read `flask solidloop workers` uses, on the request's session.
        session = state().db.session
        try:
            return list_workers(session.connection().connection, recent=recent)
        finally:
            session.rollback()

    @bp.get("/metrics")
    def metrics() -> Any:
        """The fleet's figures, and with SOLIDLOOP_METRICS the counters of the
        processes that share this host's metrics directory, for Prometheus."""
        st = state()
        try:
            body = runtime_metrics.exposition(
                st, st.config.metrics_directory if st.config.metrics else None)
        except ImportError:  # prometheus-client is not installed
            return Response("metrics need prometheus-client: pip install "
                            "'flask-solidloop[metrics]'\n", status=501, mimetype="text/plain")
        return Response(body, content_type=runtime_metrics.CONTENT_TYPE)

    @bp.get("/")
    def dashboard() -> Any:
        st = state()
        data = queries.dashboard(st.db.session)
        interval = st.config.worker_heartbeat
        maintenance = passes.statuses(maintenance_runs.last_runs(st.db.session), data.now,
                                      st.config)
        live_workers = [w for w in registry(interval * MISSED_BEATS) if w.state(interval) == "live"]
        awaiting = pending.pending_counts(st.db.session, cap=AWAITING_CAP)
        return render_template("solidloop/admin/dashboard.html", d=data,
                               live_workers=live_workers, maintenance=maintenance,
                               awaiting=awaiting, awaiting_cap=AWAITING_CAP,
                               status_cap=stats.STATUS_CAP, agents=sorted(st.extension.agents),
                               **charts_of(None, ".dashboard"))

    def charts_of(agent: str | None, endpoint: str, **url_args: Any) -> dict[str, Any]:
        """The charts of the ``?range=`` asked for (24h unless 7d), and the links."""
        chosen = request.args.get("range", "24h")
        series = stats.series(state().db.session,
                              chosen if chosen in stats.RANGES else "24h", agent)
        return {"chart_series": series, "chart_ranges": list(stats.RANGES),
                "charts": charts.charts_for(series, queries.FAILURE_CLASS_NAMES),
                "chart_url": lambda r: url_for(endpoint, range=r, **url_args)}

    @bp.get("/agents/<name>")
    def agent(name: str) -> Any:
        """One agent's charts (the dashboard's, for its loops only)."""
        known = name in state().extension.agents
        if not known and not state().db.session.scalar(select(Loop.id).where(
                Loop.agent_name == name).limit(1)):
            abort(404)
        return render_template("solidloop/admin/agent.html", agent=name, known=known,
                               **charts_of(name, ".agent", name=name))

    @bp.get("/loops")
    def loops() -> Any:
        search, error = search_or_error(request.args)
        before = request.args.get("before", type=int)
        after = request.args.get("after", type=int) if before is None else None
        rows: list[Loop] = []
        searched_to = None
        total = None
        session = state().db.session
        if search is not None and after is not None:
            # "newer": the page just above a loop, so both ways are keyset pages.
            rows = listing.search_loops_newer(session, search, limit=page_size + 1,
                                              after_id=after,
                                              window=2000 if _unindexed(search) else None)
        elif search is not None and _unindexed(search):
            # No index serves these filters: scan newest first within a time
            # budget, and say how far the search went (never a 10 s page).
            rows, searched_to = queries.search_loops_bounded(
                session, search, limit=page_size + 1, before_id=before)
        elif search is not None:
            rows = queries.search_loops(session, search, limit=page_size + 1,
                                        before_id=before)
        if search is not None and _unindexed(search):
            # Counting what no index serves scans what the page could not: the
            # estimate, unless the page's own scan reached the oldest loop.
            whole = before is None and after is None and searched_to is None
            total = (listing.Total(len(rows), True) if whole and len(rows) <= page_size
                     else listing.estimate(session, search))
        elif search is not None:
            total = listing.count_or_estimate(session, search,
                                              budget_seconds=state().config.admin_count_budget)
        if after is not None:
            newer = len(rows) > page_size
            rows = rows[-page_size:]
            more = bool(rows)
        else:
            more = len(rows) > page_size
            rows = rows[:page_size]
            newer = before is not None and bool(rows)
        template = ("solidloop/admin/_loop_rows.html" if request.headers.get("HX-Request")
                    else "solidloop/admin/loops.html")
        return render_template(
            template, rows=rows, error=error, search=search, total=total,
            filter_items=filters.query_items(request.args),
            next_before=rows[-1].id if more and rows else searched_to,
            next_after=rows[0].id if newer and rows else None,
            searched_to=searched_to if not more else None,
            qs=filters.query_string(request.args),
            agents=sorted(state().extension.agents),
            args=request.args, spend=spend_of(rows),
        ), (400 if error else 200)

    @bp.get("/loops/<int:loop_id>")
    def loop(loop_id: int) -> Any:
        session = state().db.session
        row = queries.get_loop(session, loop_id)
        if row is None:
            abort(404)
        begin = live.start(session, loop_id)
        return render_template("solidloop/admin/loop.html", lp=row, cursor=begin.cursor,
                               tree=lineage(session, row),
                               live_parts=begin.parts,
                               back=_back(), did=request.args.get("did"),
                               ok=request.args.get("ok"), results=RESULTS,
                               decided=request.args.get("decided", type=int),
                               note=request.args.get("note"),
                               budget=loop_budget(state(), session, row),
                               **_loop_regions(session, loop_id))

    @bp.get("/loops/<int:loop_id>/regions")
    def loop_regions(loop_id: int) -> Any:
        session = state().db.session
        row = queries.get_loop(session, loop_id)
        if row is None:
            abort(404)
        return render_template("solidloop/admin/_loop_regions.html", lp=row, back=_back(),
                               oob=True,
                               budget=loop_budget(state(), session, row),
                               **_loop_regions(session, loop_id))

    @bp.get("/loops/<int:loop_id>/export.<any(json, md):kind>")
    def loop_export(loop_id: int, kind: str) -> Any:
        """The loop's conversation (loops/export.py): the versioned JSON
        document, or Markdown; a download named after the loop."""
        session = state().db.session
        row = queries.get_loop(session, loop_id)
        if row is None:
            abort(404)
        document = exporting.conversation(session, row)
        body, mimetype = ((exporting.to_json(document), "application/json") if kind == "json"
                          else (exporting.to_markdown(document), "text/markdown"))
        return Response(body, mimetype=mimetype, headers={
            "Content-Disposition": f'inline; filename="loop-{loop_id}.{kind}"'})

    @bp.get("/loops/<int:loop_id>/stream")
    def loop_stream(loop_id: int) -> Any:
        config = state().config
        cursor = (request.headers.get("Last-Event-ID") or request.args.get("last_event_id")
                  or request.args.get("cursor"))
        session = state().db.session
        if queries.get_loop(session, loop_id) is None:
            abort(404)  # never was, or deleted by SOLIDLOOP_LOOP_RETENTION: no reconnects
        if not cursor:
            cursor = live.start(session, loop_id).cursor
        session.remove() if hasattr(session, "remove") else session.close()
        try:
            body = live.stream(state(), loop_id, cursor, seconds=config.admin_stream_seconds,
                               heartbeat=config.admin_heartbeat)
        except InvalidArgumentError as exc:
            return Response(f"{exc}\n", status=400, mimetype="text/plain")
        return Response(stream_with_context(body), mimetype="text/event-stream",
                        headers=dict(HEADERS))

    @bp.get("/stream")
    def streams() -> Any:
        """One browser's stream of many loops (static/stream-worker.js holds it):
        ``?loop=ID:CURSOR&loop=...&client=ID`` (docs/decisions/0045-one-stream-per-browser.md)."""
        config = state().config
        try:
            asked = live.parse_loops(request.args.getlist("loop"), request.args.get("client"))
        except InvalidArgumentError as exc:
            return Response(f"{exc}\n", status=400, mimetype="text/plain")
        session = state().db.session
        cursors = {loop_id: int(live.start(session, loop_id).cursor) if after is None else after
                   for loop_id, after in asked.items()}
        session.remove() if hasattr(session, "remove") else session.close()
        body = live.stream_many(state(), cursors, request.args.get("client"),
                                seconds=config.admin_stream_seconds,
                                heartbeat=config.admin_heartbeat)
        return Response(stream_with_context(body), mimetype="text/event-stream",
                        headers=dict(HEADERS))

    # -- actions ---------------------------------------------------------------

    @bp.post("/loops/<int:loop_id>/act/<action>")
    def act(loop_id: int, action: str) -> Any:
        if action not in ACTIONS:
            abort(404)
        try:
            ok = apply(action, loop_id, request.form)
        except ValueError as exc:
            return Response(f"{action}: {exc}\n", status=400, mimetype="text/plain")
        return redirect(url_for(".loop", loop_id=loop_id, did=action, ok=int(ok),
                                back=_back() or None), 303)

    def apply(action: str, loop_id: int, form: MultiDict[str, str]) -> bool:
        st = state()
        if action == "pause":
            return control.pause(st, loop_id)
        if action == "resume":
            from_ = tuple(form.getlist("resume_from")) or RESUMABLE_STATUSES
            message = (form.get("message") or "").strip() or None
            return control.resume(st, loop_id, from_=from_, message=message)
        if action == "stop":
            return control.stop(st, loop_id, reason=STOP_REASON)
        if action == "force_stop":
            return control.force_stop(st, loop_id, reason=STOP_REASON)
        if action == "freeze":
            return control.freeze(st, loop_id)
        if action == "unfreeze":
            return control.unfreeze(st, loop_id)
        if action == "observe":
            return control.observe(st, loop_id, True)
        if action == "unobserve":
            return control.observe(st, loop_id, False)
        raise InvalidArgumentError(f"unknown action {action!r}")

    @bp.post("/loops/<int:loop_id>/messages/<int:message_id>/fork")
    def fork_at(loop_id: int, message_id: int) -> Any:
        """A new loop from this loop's history up to the message (loops.control.fork);
        the new loop's page."""
        try:
            fork = control.fork(state(), loop_id, message_id)
        except InvalidArgumentError as exc:
            return Response(f"fork: {exc}\n", status=400, mimetype="text/plain")
        return redirect(url_for(".loop", loop_id=fork.id, back=_back() or None), 303)

    @bp.post("/loops/bulk")
    def bulk() -> Any:
        """A bulk action: the confirmation page (a count, the set frozen, a
        token), then, confirmed, its row and job (loops/bulk.py) and a 303 to
        its progress page. The same token again goes to the same action."""
        form = request.form
        # The list's "… selected" buttons say selected_action; the confirmation, scope.
        action = form.get("selected_action") or form.get("action", "")
        if action not in BULK_ACTIONS:
            return Response(f"bulk action {action!r} is unknown; use one of "
                            f"{', '.join(BULK_ACTIONS)}\n", status=400, mimetype="text/plain")
        on_selected = "selected_action" in form or form.get("scope") == "selected"
        selected = _selected(form) if on_selected else None
        if selected == []:
            return Response("bulk: no loop is selected; tick rows of the list, or act on "
                            "every loop matching the filters\n", status=400,
                            mimetype="text/plain")
        search, error = search_or_error(form)
        if search is None:
            return Response(f"{error}\n", status=400, mimetype="text/plain")
        config = state().config
        session = state().db.session
        from_ = tuple(form.getlist("resume_from")) or tuple(
            s for s in search.statuses if s in RESUMABLE_STATUSES) or ("paused", "failed")
        if action == "resume":
            try:
                control.check_resumable(from_)
            except ValueError as exc:
                return Response(f"resume: {exc}\n", status=400, mimetype="text/plain")
        qs = filters.query_string(form)
        if form.get("confirm") != "1":
            max_id = queries.newest_loop_id(session) or 0
            count = (len(selected) if selected is not None else queries.count_loops(
                session, _with_max(search, max_id), cap=config.admin_bulk_limit))
            return render_template("solidloop/admin/bulk_confirm.html", action=action,
                                   count=count, cap=config.admin_bulk_limit, max_id=max_id,
                                   filter_items=filters.query_items(form), qs=qs,
                                   from_=from_, message=form.get("message", ""),
                                   unfiltered=search.empty and selected is None,
                                   selected=selected, token=uuid.uuid4().hex)
        confirmed_max = form.get("max_id", type=int)
        if confirmed_max is None and selected is None:
            return Response("bulk: max_id missing; confirm from the confirmation page\n",
                            status=400, mimetype="text/plain")
        options: dict[str, Any] = {"resume_from": list(from_),
                                   "message": (form.get("message") or "").strip() or None,
                                   "reason": STOP_REASON, "qs": qs}
        try:
            requested = bulk_jobs.request_bulk(
                state(), token=form.get("token", ""), action=action, options=options,
                limit=config.admin_bulk_limit, loop_ids=selected,
                search=None if selected is not None else _with_max(search, confirmed_max or 0),
                requested_by=who())
        except InvalidArgumentError as exc:
            return Response(f"bulk: {exc}\n", status=400, mimetype="text/plain")
        return redirect(url_for(".bulk_action", bulk_id=requested.id), 303)

    @bp.get("/bulk/<int:bulk_id>")
    def bulk_action(bulk_id: int) -> Any:
        """A bulk action's progress; htmx polls its fragment until it ends."""
        row = bulk_jobs.get_bulk(state().db.session, bulk_id)
        if row is None:
            abort(404)
        state().db.session.rollback()
        template = ("solidloop/admin/_bulk_progress.html" if request.headers.get("HX-Request")
                    else "solidloop/admin/bulk_done.html")
        return render_template(template, bulk=row, qs=row.options.get("qs") or "")

    def who() -> str:
        name = operator(request) if operator is not None else None
        return str(name) if name else approvals.DEFAULT_OPERATOR

    approvals.add_views(bp, state=state, operator=operator, page_size=page_size)

    @bp.get("/jobs")
    def jobs() -> Any:
        broker = state().broker
        data = queries.dashboard(state().db.session)
        dead = jobs_control.list_jobs(broker, states=["dead"], limit=100)
        queued = jobs_control.list_jobs(broker, states=["queued"], limit=50)
        return render_template("solidloop/admin/jobs.html", queues=data.queues, dead=dead,
                               queued=queued, dead_count=data.dead_jobs,
                               did=request.args.get("did"), note=request.args.get("note"))

    @bp.post("/jobs/<int:row_id>/<action>")
    def job_action(row_id: int, action: str) -> Any:
        broker = state().broker
        try:
            if action == "retry":
                jobs_control.retry(broker, str(row_id))
            elif action == "cancel":
                jobs_control.cancel(broker, str(row_id))
            elif action == "discard":
                jobs_control.discard(broker, row_id)
            else:
                abort(404)
        except SolidLoopError as exc:
            return Response(f"{action}: {exc}\n", status=409, mimetype="text/plain")
        return redirect(url_for(".jobs", did=f"{action}:{row_id}"), 303)

    @bp.get("/workers")
    def workers() -> Any:
        recent = request.args.get("recent", WORKERS_RECENT, type=float)
        if recent is None or recent < 0:
            recent = WORKERS_RECENT
        rows = registry(recent)
        interval = state().config.worker_heartbeat
        return render_template("solidloop/admin/workers.html", rows=rows, recent=recent,
                               interval=interval,
                               states={w.identity: w.state(interval) for w in rows})

    @bp.get("/limits")
    def limits() -> Any:
        # The read `flask solidloop limits` prints.
        st = state()
        keys, now = rate_keys(st, st.db.session)
        found = subjects(st, st.db.session, top=LIMITS_SUBJECTS)
        st.db.session.rollback()
        return render_template("solidloop/admin/limits.html", keys=keys, now=now,
                               subjects=found, top=LIMITS_SUBJECTS,
                               subject_budget=st.config.subject_budget,
                               hooked=st.extension.subject_budget_hook is not None)

    @bp.get("/inbound")
    def inbound() -> Any:
        session = state().db.session
        sid = request.args.get("session") or None
        before = request.args.get("before", type=int)
        reqs = queries.inbound_requests(session, limit=page_size + 1, session_id=sid,
                                        before_id=before)
        more = len(reqs) > page_size
        reqs = reqs[:page_size]
        sessions = queries.inbound_sessions(session, limit=page_size)
        return render_template("solidloop/admin/inbound.html", sessions=sessions,
                               requests=reqs, sid=sid,
                               next_before=reqs[-1].id if more and reqs else None)

    return bp


def _selected(form: MultiDict[str, str]) -> list[int]:
    """The loop ids the operator ticked (``loop`` fields), valid ones only."""
    return sorted({int(v) for v in form.getlist("loop") if v.isdigit()})


def _unindexed(search: queries.LoopSearch) -> bool:
    return bool(search.text or search.state or search.failure or search.created_from
                or search.created_to)


def _with_max(search: queries.LoopSearch, max_id: int) -> queries.LoopSearch:
    from dataclasses import replace

    return replace(search, max_id=max_id)


def _back() -> str:
    """The list's filters to return to, re-encoded (only filter keys survive)."""
    raw = request.args.get("back") or request.form.get("back") or ""
    pairs = [(k, v) for k, v in parse_qsl(raw) if k in filters.FILTER_KEYS or k == "before"]
    return urlencode(pairs)


def _compacted_folds(messages: list[Any]) -> dict[int, tuple[int, list[Any]]]:
    """Messages a summary replaced (``compacted_by``), folded: by the id of the
    first of each summary's messages, the summary's id and its messages."""
    folds: dict[int, tuple[int, list[Any]]] = {}
    first: dict[int, int] = {}
    for message in messages:
        if message.compacted_by is not None:
            at = first.setdefault(message.compacted_by, message.id)
            folds.setdefault(at, (message.compacted_by, []))[1].append(message)
    return folds


def _loop_regions(session: Any, loop_id: int) -> dict[str, Any]:
    messages = queries.messages(session, loop_id, include_hidden=True)
    calls = queries.tool_calls(session, loop_id)
    by_message: dict[int, list[Any]] = {}
    for call in calls:
        by_message.setdefault(call.message_id, []).append(call)
    # Every LLM turn, the unfinished ones too: a turn a killed worker (or a pause,
    # a stop, a failed request) interrupted is a hidden ``failed`` shell, and an
    # operator reading the timeline must see that the loop paid for it.
    turns = [m for m in messages if m.role == "assistant"]
    # LLM requests on record with no answer yet: the one in flight (a slow or
    # hung model call, with its elapsed time) and those their turns abandoned.
    unanswered = wire_reads.pending_requests(session, loop_id)
    flying = [r for r in unanswered if r.in_flight]
    return {
        "pending_requests": {r.event_id: r for r in unanswered},
        "in_flight": flying[-1] if flying else None,
        "messages": messages,
        "visible": [m for m in messages if not m.is_hidden],
        "hidden": [m for m in messages if m.is_hidden],
        "folds": _compacted_folds(messages),
        "calls": calls,
        "calls_by_message": by_message,
        "call_states": queries.tool_call_states(session, loop_id),
        "turns": turns,
        "events": queries.events(session, loop_id),
        "mcp_sessions": queries.mcp_sessions(session, loop_id),
    }

