"""The admin's views of tool calls that wait: the "Waiting for approval" page,
a decision on one call (approve, edit and approve, deny, supply a result),
and bulk approve or deny over a filtered set, confirmed first like the loops'
bulk actions (docs/guides/approvals.md).

Reads go through ``loops.pending``, decisions through ``loops.control``: one
decision per call, each its own transaction, a lost race reported (never an
error page). Who decided is the blueprint's ``operator(request)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from flask import Blueprint, Request, Response, redirect, render_template, request, url_for
from werkzeug.datastructures import MultiDict

from ..errors import InvalidArgumentError, SolidLoopError
from ..loops import control, pending
from ..state import SolidLoopState
from .filters import FilterError, json_object

#: The page's filter keys, in the order the form shows them.
FILTER_KEYS = ("agent", "tool", "waits")
#: A bulk decision: action -> label.
BULK_DECISIONS = {"approve": "Approve", "deny": "Deny"}
#: A decision on one call: action -> label.
DECISIONS = {"approve": "Approve", "deny": "Deny", "complete": "Supply the result"}
#: The operator when the host gives no ``operator`` hook.
DEFAULT_OPERATOR = "admin"

Operator = Callable[[Request], "str | None"]


class DecisionInputError(InvalidArgumentError):
    """A decision form that cannot be used; the message names the fix."""


def parse_filters(args: MultiDict[str, str]) -> pending.PendingFilter:
    waits = (args.get("waits") or "approval").strip()
    if waits not in ("approval", "result", "any"):
        raise DecisionInputError(f"waits={waits!r} is unknown; use approval, result or any")
    return pending.PendingFilter(agent=(args.get("agent") or "").strip() or None,
                                 tool=(args.get("tool") or "").strip() or None,
                                 waits_for=None if waits == "any" else waits)


def filter_items(args: MultiDict[str, str]) -> list[tuple[str, str]]:
    return [(key, value) for key in FILTER_KEYS for value in args.getlist(key) if value]


def edited_arguments(raw: str | None) -> dict[str, Any] | None:
    """The JSON object an operator typed for edit-and-approve; None when empty."""
    try:
        return json_object(raw, what="the edited arguments", example='{"amount": 40}')
    except FilterError as exc:
        raise DecisionInputError(str(exc)) from None


def add_views(bp: Blueprint, *, state: Callable[[], SolidLoopState],
              operator: Operator | None, page_size: int) -> None:
    """Register the approvals page and the decision endpoints on ``bp``."""

    def who() -> str:
        if operator is None:
            return DEFAULT_OPERATOR
        name = operator(request)
        return str(name) if name else DEFAULT_OPERATOR

    def decide(action: str, tool_call_id: int, loop_id: int | None,
               form: MultiDict[str, str]) -> str:
        """One decision; returns how it went, in words (never request text).
        DecisionInputError for edited arguments that are not a JSON object."""
        st = state()
        edited = edited_arguments(form.get("arguments")) if action == "approve" else None
        try:
            if action == "approve":
                control.approve(st, tool_call_id, by=who(), loop_id=loop_id, arguments=edited)
            elif action == "deny":
                control.deny(st, tool_call_id, reason=(form.get("reason") or "").strip(),
                             by=who(), loop_id=loop_id)
            else:
                control.complete_call(st, tool_call_id, form.get("result") or "",
                                      is_error=form.get("is_error") == "1", by=who(),
                                      loop_id=loop_id)
        except SolidLoopError as exc:
            # A lost race or a call that no longer waits: say so, change nothing.
            return f"not decided: {exc}"
        return {"approve": "approved", "deny": "denied", "complete": "result supplied"}[action]

    @bp.get("/approvals")
    def approvals() -> Any:
        try:
            filters = parse_filters(request.args)
        except DecisionInputError as exc:
            return Response(f"{exc}\n", status=400, mimetype="text/plain")
        after = request.args.get("after", type=int)
        session = state().db.session
        rows = pending.pending_rows(session, filters, limit=page_size + 1, after_id=after)
        more = len(rows) > page_size
        rows = rows[:page_size]
        items = filter_items(request.args)
        return render_template(
            "solidloop/admin/approvals.html", rows=rows, items=items, args=request.args,
            qs=urlencode(items), next_after=rows[-1][0].id if more and rows else None,
            agents=sorted(state().extension.agents), did=request.args.get("did"),
            note=request.args.get("note"))

    @bp.post("/calls/<int:tool_call_id>/<action>")
    def decide_call(tool_call_id: int, action: str) -> Any:
        if action not in DECISIONS:
            return Response(f"decision {action!r} is unknown; use one of "
                            f"{', '.join(DECISIONS)}\n", status=404, mimetype="text/plain")
        loop_id = request.form.get("loop_id", type=int)
        try:
            note = decide(action, tool_call_id, loop_id, request.form)
        except DecisionInputError as exc:
            return Response(f"{action}: {exc}\n", status=400, mimetype="text/plain")
        if request.form.get("next") == "loop" and loop_id is not None:
            return redirect(url_for(".loop", loop_id=loop_id, decided=tool_call_id,
                                    note=note, back=request.form.get("back") or None), 303)
        back = urlencode(filter_items(request.form))
        return redirect(url_for(".approvals", did=tool_call_id, note=note) +
                        (f"&{back}" if back else ""), 303)

    @bp.post("/approvals/bulk")
    def bulk_decide() -> Any:
        form = request.form
        action = form.get("action", "")
        if action not in BULK_DECISIONS:
            return Response(f"bulk decision {action!r} is unknown; use one of "
                            f"{', '.join(BULK_DECISIONS)}\n", status=400,
                            mimetype="text/plain")
        try:
            filters = parse_filters(form)
        except DecisionInputError as exc:
            return Response(f"{exc}\n", status=400, mimetype="text/plain")
        if filters.waits_for != "approval":
            return Response("bulk decisions apply to calls that await an approval: "
                            "set waits=approval\n", status=400, mimetype="text/plain")
        reason = (form.get("reason") or "").strip()
        if action == "deny" and not reason:
            return Response("deny: give a reason; the model reads it as each call's result\n",
                            status=400, mimetype="text/plain")
        config = state().config
        session = state().db.session
        items = filter_items(form)
        if form.get("confirm") != "1":
            max_id = pending.newest_pending_id(session) or 0
            count = pending.count_pending(session, filters.frozen(max_id),
                                          cap=config.admin_bulk_limit)
            session.rollback()
            return render_template("solidloop/admin/approvals_confirm.html", action=action,
                                   count=count, cap=config.admin_bulk_limit, max_id=max_id,
                                   items=items, reason=reason, qs=urlencode(items),
                                   unfiltered=not (filters.agent or filters.tool))
        confirmed_max = form.get("max_id", type=int)
        if confirmed_max is None:
            return Response("bulk: max_id missing; confirm from the confirmation page\n",
                            status=400, mimetype="text/plain")
        decided: list[int] = []
        skipped: list[int] = []
        batches = 0
        after: int | None = None
        limit = config.admin_bulk_limit
        while len(decided) + len(skipped) < limit:
            ids = pending.pending_ids(session, filters.frozen(confirmed_max), after_id=after,
                                      limit=min(config.admin_bulk_batch,
                                                limit - len(decided) - len(skipped)))
            session.rollback()  # each decision below is its own transaction
            if not ids:
                break
            batches += 1
            for call_id in ids:
                note = decide(action, call_id, None, MultiDict({"reason": reason}))
                (skipped if note.startswith("not decided") else decided).append(call_id)
            after = ids[-1]
        return render_template("solidloop/admin/approvals_done.html", action=action,
                               decided=decided, skipped=skipped, batches=batches,
                               hit_limit=len(decided) + len(skipped) >= limit, limit=limit,
                               qs=urlencode(items))
