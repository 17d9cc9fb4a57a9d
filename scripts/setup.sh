#!/usr/bin/env bash
# One-time (idempotent) setup for a fresh machine: a PostgreSQL that answers on
# 127.0.0.1:5432, a virtualenv in .venv with flask-solidloop and its test
# extras installed. Safe to run again; it only does what is missing: a re-run
# with nothing to do takes a few seconds (the install is skipped while
# pyproject.toml is unchanged; SETUP_FORCE=1 reinstalls anyway).
set -euo pipefail
cd "$(dirname "$0")/.."

started=$SECONDS
step() { echo "setup: [$1/4] $2 ($((SECONDS - started))s)" >&2; }

# Run "$@" with its output in a log, printing a line every 10 s so a long
# first install never looks hung; the log is shown if it fails.
with_progress() {
  local what=$1; shift
  local log; log=$(mktemp)
  "$@" >"$log" 2>&1 &
  local pid=$! waited=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1; waited=$((waited + 1))
    if [ $((waited % 10)) -eq 0 ]; then echo "setup:       still $what (${waited}s)" >&2; fi
  done
  if ! wait "$pid"; then
    cat "$log" >&2; rm -f "$log"
    echo "setup: $what failed (output above)" >&2
    return 1
  fi
  rm -f "$log"
}

PG_PORT="${PGPORT:-5432}"

pg_answers() {
  if command -v pg_isready >/dev/null 2>&1; then
    pg_isready -h 127.0.0.1 -p "$PG_PORT" -q
  else
    python3 - "$PG_PORT" <<'PY'
import socket, sys
s = socket.socket()
s.settimeout(1)
sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
PY
  fi
}

start_postgres() {
  echo "setup: PostgreSQL is not answering on 127.0.0.1:$PG_PORT; starting it" >&2
  if command -v pg_ctlcluster >/dev/null 2>&1 && ls /etc/postgresql/*/main >/dev/null 2>&1; then
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  fi
  for _ in $(seq 1 30); do pg_answers && return 0; sleep 1; done
  # No system cluster: initdb a throwaway one as the postgres user (initdb refuses root).
  bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$bindir" ]; then
    echo "setup: no PostgreSQL server binaries found; install PostgreSQL 15+" >&2
    return 1
  fi
  data=/tmp/solidloop-pgdata
  runuser=""
  if [ "$(id -u)" = "0" ]; then runuser="runuser -u postgres --"; fi
  if [ ! -s "$data/PG_VERSION" ]; then
    mkdir -p "$data" && chown postgres "$data" 2>/dev/null || true
    $runuser "$bindir/initdb" -D "$data" -A trust -U postgres >/dev/null
  fi
  $runuser "$bindir/pg_ctl" -D "$data" -o "-p $PG_PORT -k /tmp" -l "$data/server.log" -w start
  pg_answers
}

step 1 "PostgreSQL on 127.0.0.1:$PG_PORT"
pg_answers || start_postgres

step 2 "virtualenv in .venv"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
fi

# The install is redone only when what it depends on changed: pyproject.toml,
# the interpreter, or an install that no longer imports from this tree.
stamp=.venv/.solidloop-setup-stamp
want="$(cat pyproject.toml .venv/pyvenv.cfg | cksum)"
installed_here() {
  .venv/bin/python - "$PWD" <<'PY' 2>/dev/null
import importlib.util, os, sys
spec = importlib.util.find_spec("flask_solidloop")  # found, not imported: fast
ok = spec and spec.origin and spec.origin.startswith(sys.argv[1] + os.sep)
sys.exit(0 if ok and importlib.util.find_spec("pytest") else 1)
PY
}
if [ -z "${SETUP_FORCE:-}" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && installed_here; then
  step 3 "flask-solidloop and its test extras: already installed, pyproject.toml unchanged"
else
  step 3 "installing flask-solidloop and its test extras into .venv (the first time takes a minute or two)"
  with_progress "installing into .venv" .venv/bin/python -m pip install -q -e '.[test]'
  echo "$want" >"$stamp"
fi
# -- admin browser tests (issue 15): Debian's chromium, driven by Playwright from
# PyPI with executable_path (never `playwright install`, which downloads).
if ! command -v chromium >/dev/null 2>&1; then
  echo "setup: installing Debian's chromium for the admin's browser tests" >&2
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: cannot apt-get install chromium here; the browser tests will skip" >&2
  fi
fi
# -- end admin browser tests

# The real MCP servers the tests talk to (npm and PyPI packages, pinned).
step 4 "MCP peers for the stdio tests"
bash scripts/mcp_peers.sh >&2
# Node 22 and the official MCP conformance suite (both versions), pinned.
bash scripts/mcp_conformance.sh >&2
echo "setup: ready in $((SECONDS - started))s (PostgreSQL on 127.0.0.1:$PG_PORT, virtualenv in .venv, MCP peers)" >&2
