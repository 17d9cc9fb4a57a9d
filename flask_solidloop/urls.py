"""URL helpers shared by every layer: the libpq form of a database URL, and the
one redaction every stored URL, error text and log line goes through.

:func:`redact_url` removes credentials from a URL (database, LLM provider or
MCP server alike): the password of its userinfo (a userinfo without a
password is masked whole, since it may itself be a token) and the values of
query and fragment parameters whose names look secret (token, key, secret,
signature, sig, password, auth, ...). :func:`redact_urls_in` does it to every
URL inside a text, and :class:`RedactingFilter` to log records, tracebacks
included. At the bottom of the layer order, so every module can use them.
"""

from __future__ import annotations

import logging
import re
import urllib.parse

MASK = "***"
#: Parameter names that look like they carry a credential.
SECRET_PARAM = re.compile(
    r"(token|key|secret|signature|sig|password|passwd|pwd|auth|credential|session|code)",
    re.IGNORECASE)
#: A user name that is a name, not a token (``postgres``, ``app_rw``): kept.
_PLAIN_USER = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,15}")
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>()\[\]{}]+")


def libpq_url(url: str) -> str:
    """Turn a SQLAlchemy URL (``postgresql+psycopg://``) into one libpq accepts."""
    if "+" in url.split("://", 1)[0]:
        scheme, rest = url.split("://", 1)
        return scheme.split("+", 1)[0] + "://" + rest
    return url


def _redact_params(text: str) -> str:
    if "=" not in text:
        return text
    pairs = []
    for part in text.split("&"):
        name, sep, value = part.partition("=")
        if sep and value and SECRET_PARAM.search(urllib.parse.unquote_plus(name)):
            value = MASK
        pairs.append(f"{name}{sep}{value}")
    return "&".join(pairs)


def redact_url(url: str) -> str:
    """``url`` without credentials, for storage, error messages and logs.

    ``http://user:secret@host/p?token=abc&page=2`` becomes
    ``http://user:***@host/p?token=***&page=2``; a userinfo without a password
    is kept when it is a short plain name (``postgres@host``) and masked
    otherwise (``https://ghp_0123...@host`` becomes ``https://***@host``). Text
    that does not parse as a URL is returned with anything before an ``@`` masked.
    """
    try:
        parts = urllib.parse.urlsplit(str(url))
    except ValueError:
        return MASK + "@" + str(url).rsplit("@", 1)[-1] if "@" in str(url) else str(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        if has_password:
            netloc = f"{user}:{MASK}@{host}"
        elif not _PLAIN_USER.fullmatch(user):
            netloc = f"{MASK}@{host}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path,
                                    _redact_params(parts.query),
                                    _redact_params(parts.fragment)))


def redact_urls_in(text: str) -> str:
    """``text`` with every URL in it redacted (see :func:`redact_url`)."""
    if "://" not in text:
        return text
    return _URL.sub(lambda match: redact_url(match.group()), text)


class RedactingFilter(logging.Filter):
    """Redacts URLs in a log record's message and traceback before any handler
    formats it. The message is formatted here (so its arguments are covered)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        redacted = redact_urls_in(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_urls_in(record.exc_text)
        return True


#: Loggers of our dependencies that log request URLs: httpx (our LLM client)
#: and httpx2 (the MCP SDK's HTTP client) at INFO, for every request; the MCP
#: SDK's transports at DEBUG.
THIRD_PARTY_LOGGERS = ("httpx", "httpcore", "httpx2", "httpcore2",
                       "mcp.client.streamable_http", "mcp.client.sse",
                       "mcp.client.auth.oauth2", "mcp.client.client", "dramatiq")
_FILTER = RedactingFilter()


def install_log_redaction(*handlers: logging.Handler) -> None:
    """Attach the redacting filter to the loggers that log URLs and to ``handlers``
    (a worker passes its root handlers, so every record is covered). Idempotent."""
    for target in [*(logging.getLogger(name) for name in THIRD_PARTY_LOGGERS), *handlers]:
        if _FILTER not in target.filters:
            target.addFilter(_FILTER)
