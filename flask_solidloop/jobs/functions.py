"""Plain functions as jobs: recorded by import path, imported again in the worker.

An RQ-style job names its function as ``"package.module:qualname"``. That is
all a message can carry between processes, so only functions a worker can
import by that path are accepted: module-level functions (and lazy actors,
static methods, anything reachable by attribute from a module). Lambdas,
nested functions and functions of ``__main__`` are refused at enqueue, where
the mistake is made, instead of failing later in a worker.

:func:`run_job` is the body of the ``solidloop.job`` actor. It imports the
function (:class:`JobImportError`, never retried, when it cannot), calls it,
hands the return value to the host-job middleware, and turns a failure into
RQ's retry policy: ``dramatiq.Retry(delay=...)`` with the job's own interval,
while retries remain.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import dramatiq

from ..errors import InvalidJobError, JobImportError
from ..queue.middleware.host_jobs import current_host_message, set_return_value

logger = logging.getLogger("flask_solidloop.jobs")

_cache: dict[str, Callable[..., Any]] = {}
_cache_lock = threading.Lock()


def import_path_of(func: Any) -> str:
    """``"module:qualname"`` of a module-level callable, or InvalidJobError naming the fix."""
    if isinstance(func, str):
        if ":" not in func and "." not in func:
            raise InvalidJobError(
                f"cannot enqueue {func!r}: name a function by its import path, "
                "'package.module:function' (or 'package.module.function')"
            )
        return func if ":" in func else ":".join(func.rsplit(".", 1))
    if not callable(func):
        raise InvalidJobError(f"cannot enqueue {func!r}: it is not a function")
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", None)
    if not module or not qualname:
        raise InvalidJobError(
            f"cannot enqueue {func!r}: a job is recorded by import path, and this callable "
            "has none; pass a module-level function"
        )
    if "<lambda>" in qualname or "<locals>" in qualname:
        kind = "a lambda" if "<lambda>" in qualname else "a nested function"
        raise InvalidJobError(
            f"cannot enqueue {module}.{qualname}: it is {kind}, which a worker cannot import. "
            "Define the function at module level and enqueue that"
        )
    if module == "__main__":
        raise InvalidJobError(
            f"cannot enqueue {qualname} from __main__: workers import jobs by module path. "
            "Move it into an importable module"
        )
    if getattr(func, "__self__", None) is not None and not isinstance(func.__self__, type):
        raise InvalidJobError(
            f"cannot enqueue the bound method {module}.{qualname}: its instance cannot travel "
            "in a message. Enqueue a module-level function that takes ids instead"
        )
    return f"{module}:{qualname}"


def resolve(path: str) -> Callable[..., Any]:
    """Import the callable at ``path`` (cached); JobImportError naming the path if that fails."""
    func = _cache.get(path)
    if func is not None:
        return func
    module_name, _, qualname = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise JobImportError(
            f"cannot import the job function {path!r} in this worker "
            f"({type(exc).__name__}: {exc}). Is the module on the worker's path and in "
            "the same version as the web app's? The job is failed, not retried"
        ) from exc
    if not callable(target):
        raise JobImportError(f"the job function {path!r} is not callable here: {target!r}")
    with _cache_lock:
        _cache[path] = target
    return target


def run_job(path: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """The ``solidloop.job`` actor: run one RQ-style job."""
    func = resolve(path)
    try:
        result = func(*args, **kwargs)
    except Exception as exc:
        delay = _retry_delay()
        if delay is None:
            raise
        logger.warning("job %s failed (%s: %s); retrying in %.3f s", path,
                       type(exc).__name__, exc, delay / 1000, exc_info=True)
        raise dramatiq.Retry(str(exc), delay=delay) from exc
    set_return_value(result)


def _retry_delay() -> int | None:
    """Milliseconds before the next attempt under the job's Retry policy, or None
    when no retries are left (dramatiq's Retries then fails the message)."""
    message = current_host_message()
    if message is None:
        return None
    retries = int(message.options.get("retries", 0))
    if retries >= int(message.options.get("max_retries", 0)):
        return None
    intervals = message.options.get("solidloop_retry_intervals") or [0]
    return int(intervals[min(retries, len(intervals) - 1)])
