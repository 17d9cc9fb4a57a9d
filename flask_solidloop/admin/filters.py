"""The loop list's filters: read from the URL's query string into a
:class:`~flask_solidloop.loops.queries.LoopSearch`, and written back, so a
filtered view is a link, survives an action and feeds a bulk action."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from werkzeug.datastructures import MultiDict

from ..errors import InvalidArgumentError
from ..loops.queries import FAILURE_CLASS_NAMES, LoopSearch
from ..models.loop import ALL_STATUSES

#: The query-string keys of the filters, in the order the form shows them.
FILTER_KEYS = ("status", "agent", "failure", "subject_type", "subject_id", "from", "to", "q",
               "state")


class FilterError(InvalidArgumentError):
    """A filter value that cannot be used; the message names it and the fix."""


def _when(key: str, value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise FilterError(f"{key}={value!r} is not a date; use YYYY-MM-DD or "
                          "YYYY-MM-DDTHH:MM") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def json_object(raw: str | None, *, what: str, example: str) -> dict[str, Any] | None:
    """The JSON object an operator typed (None when the field is empty);
    FilterError names ``what`` was wrong and shows ``example``."""
    text = (raw or "").strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise FilterError(f"{what} is not valid JSON ({exc}); give an object such as "
                          f"{example}") from None
    if not isinstance(value, dict):
        raise FilterError(f"{what} must be a JSON object such as {example}")
    return value


def parse(args: MultiDict[str, str]) -> LoopSearch:
    """The search the query string asks for; FilterError names a bad value."""
    statuses = tuple(s for s in args.getlist("status") if s)
    bad = [s for s in statuses if s not in ALL_STATUSES]
    if bad:
        raise FilterError(f"status={bad[0]!r} is not a loop status; use one of "
                          f"{', '.join(ALL_STATUSES)}")
    failure = args.get("failure") or None
    if failure and failure not in FAILURE_CLASS_NAMES:
        raise FilterError(f"failure={failure!r} is not a failure class; use one of "
                          f"{', '.join(FAILURE_CLASS_NAMES)}")
    state = json_object(args.get("state"), what="state", example='{"customer": "acme"}')
    return LoopSearch(
        statuses=statuses,
        agent=(args.get("agent") or "").strip() or None,
        failure=failure,
        subject_type=(args.get("subject_type") or "").strip() or None,
        subject_id=(args.get("subject_id") or "").strip() or None,
        created_from=_when("from", args["from"]) if args.get("from") else None,
        created_to=_when("to", args["to"]) if args.get("to") else None,
        text=(args.get("q") or "").strip() or None,
        state=state,
    )


def query_items(args: MultiDict[str, str]) -> list[tuple[str, str]]:
    """The filter pairs of ``args`` (nothing else), to carry into links and forms."""
    return [(key, value) for key in FILTER_KEYS for value in args.getlist(key) if value]


def query_string(args: MultiDict[str, str], **extra: Any) -> str:
    items = query_items(args) + [(k, str(v)) for k, v in extra.items() if v is not None]
    return urlencode(items)
