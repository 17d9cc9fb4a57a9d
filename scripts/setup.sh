#!/usr/bin/env bash
# One-time (idempotent) set-up for a fresh machine, in two sizes:
#
#   bash scripts/setup.sh           what the demo needs: a PostgreSQL answering on
#                                   127.0.0.1:5432 and a virtualenv in .venv with
#                                   flask-solidloop and its runtime dependencies
#   bash scripts/setup.sh --tests   the same, plus what the test suite needs: the
#                                   test extras, Debian's chromium, pgbouncer and prometheus, the
#                                   MCP peers, Node 22 and the MCP conformance suites
#
# With CI set (CI=true), --tests is implied: CI installs everything, so no test
# skips for want of a tool. Safe to run again; it only does what is missing: a
# re-run with nothing to do takes a few seconds (the install is skipped while
# pyproject.toml is unchanged; SETUP_FORCE=1 reinstalls anyway). Progress goes
# to stderr at least every few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/progress.sh

tests=""
for arg in "$@"; do
  case "$arg" in
    --tests) tests=1 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup: unknown option '$arg'; use: bash scripts/setup.sh [--tests]" >&2; exit 2 ;;
  esac
done
in_ci=""
case "${CI:-}" in ""|0|false|False|FALSE) ;; *) in_ci=1 tests=1 ;; esac

started=$SECONDS
if [ -n "$tests" ]; then steps=8; else steps=3; fi
step() { echo "setup: [$1/$steps] $2 ($((SECONDS - started))s)" >&2; }

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

# A virtualenv without pip, given pip by the interpreter's own pip (>= 22.3 can
# install into another interpreter), is made in a few seconds; `python3 -m venv`
# with ensurepip takes 5-15 s and brings a pip that resolves our dependencies
# slower than a current one does.
make_venv() {
  if python3 -m pip --version 2>/dev/null | python3 -c '
import re, sys
m = re.match(r"pip (\d+)\.(\d+)", sys.stdin.read())
sys.exit(0 if m and (int(m[1]), int(m[2])) >= (22, 3) else 1)'; then
    python3 -m venv --without-pip .venv &&
      python3 -m pip --python .venv/bin/python install --no-compile --progress-bar off --upgrade pip
  else
    python3 -m venv .venv && .venv/bin/python -m pip install --progress-bar off --upgrade pip
  fi
}

step 2 "virtualenv in .venv"
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  rm -rf .venv
  with_progress setup "creating .venv" make_venv
fi

# The install is redone only when what it depends on changed: pyproject.toml,
# the interpreter, the extras asked for, or an install that no longer imports
# from this tree. The stamp names what was installed: "runtime" (the demo's
# set-up) or "test" (which includes the runtime).
stamp=.venv/.solidloop-setup-stamp
want="$(cat pyproject.toml .venv/pyvenv.cfg | cksum)"
installed_here() {  # $1: also need pytest (1) or not (empty)
  .venv/bin/python - "$PWD" "$1" <<'PY' 2>/dev/null
import importlib.util, os, sys
spec = importlib.util.find_spec("flask_solidloop")  # found, not imported: fast
ok = spec and spec.origin and spec.origin.startswith(sys.argv[1] + os.sep)
sys.exit(0 if ok and (not sys.argv[2] or importlib.util.find_spec("pytest")) else 1)
PY
}
have=$(cat "$stamp" 2>/dev/null || true)
if [ -n "$tests" ]; then
  extras="test" spec=".[test]" what="flask-solidloop and its test extras"
  up_to_date=$([ "$have" = "$want test" ] && echo 1 || true)
else
  extras="runtime" spec="." what="flask-solidloop and its runtime dependencies"
  up_to_date=$([ "$have" = "$want test" ] || [ "$have" = "$want runtime" ] && echo 1 || true)
fi
if [ -z "${SETUP_FORCE:-}" ] && [ -n "$up_to_date" ] && installed_here "$tests"; then
  step 3 "$what: already installed, pyproject.toml unchanged"
else
  step 3 "installing $what into .venv"
  # --no-compile: byte-compiling every file of every wheel costs seconds; Python
  # compiles the modules a run imports, once, on first import.
  with_progress setup "installing into .venv" .venv/bin/python -m pip install \
    --no-compile --progress-bar off -e "$spec"
  echo "$want $extras" >"$stamp"
fi

if [ -z "$tests" ]; then
  echo "setup: ready for the demo in $((SECONDS - started))s (PostgreSQL on 127.0.0.1:$PG_PORT," \
       "virtualenv in .venv); for the tests: bash scripts/setup.sh --tests" >&2
  exit 0
fi

# -- admin browser tests (issue 15): Debian's chromium, driven by Playwright from
# PyPI with executable_path (never `playwright install`, which downloads).
step 4 "Debian's chromium and axe-core for the admin's browser tests"
if command -v chromium >/dev/null 2>&1; then
  echo "setup:       chromium already installed" >&2
elif [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  with_progress setup "installing chromium (apt-get)" sh -c \
    'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium'
elif [ -n "$in_ci" ]; then
  echo "setup: cannot apt-get install chromium here (needs root and apt-get); CI runs" \
       "the browser tests, so install Debian's chromium first" >&2
  exit 1
else
  echo "setup: cannot apt-get install chromium here (needs root and apt-get);" \
       "the browser tests will skip" >&2
fi
# axe-core (npm, pinned) for the admin's accessibility checks
# (tests/acceptance/test_admin_layout_browser.py injects it into each page),
# installed into the gitignored .test-js/ directory, never globally.
AXE_VERSION="4.10.3"
if [ -f .test-js/node_modules/axe-core/axe.min.js ] && grep -q "\"version\": \"$AXE_VERSION\"" \
    .test-js/node_modules/axe-core/package.json 2>/dev/null; then
  echo "setup:       axe-core $AXE_VERSION already installed in .test-js" >&2
elif command -v npm >/dev/null 2>&1; then
  mkdir -p .test-js
  with_progress setup "installing axe-core $AXE_VERSION into .test-js (npm)" npm install \
      --prefix .test-js --no-audit --no-fund --save-exact --loglevel=error "axe-core@$AXE_VERSION" ||
    { echo "setup: npm install axe-core@$AXE_VERSION failed (output above); is the npm registry reachable?" >&2; exit 1; }
else
  echo "setup: npm is not on PATH; the admin's accessibility tests will skip (install Node.js with npm)" >&2
fi
# -- end admin browser tests

# -- PgBouncer tests: Debian's pgbouncer, started by the tests themselves as a
# subprocess with an ini of their own (the package's own service is not used).
step 5 "Debian's pgbouncer for the transaction-pooler tests"
if [ -x /usr/sbin/pgbouncer ]; then
  echo "setup:       pgbouncer already installed" >&2
elif [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  with_progress setup "installing pgbouncer (apt-get)" sh -c \
    'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer'
elif [ -n "$in_ci" ]; then
  echo "setup: cannot apt-get install pgbouncer here (needs root and apt-get); CI runs" \
       "the PgBouncer tests, so install Debian's pgbouncer first" >&2
  exit 1
else
  echo "setup: cannot apt-get install pgbouncer here (needs root and apt-get);" \
       "the PgBouncer tests will skip" >&2
fi
# -- end PgBouncer tests

# -- Prometheus tests: Debian's prometheus (its promtool checks the shipped alert
# rules; the tests start the server themselves, with a config and data directory
# of their own, on a free port). Its recommends (node-exporter) are left out,
# and the package's own service is stopped and disabled if the install started
# it, so nothing of it holds a port.
step 6 "Debian's prometheus for the metrics tests"
if [ -x /usr/bin/prometheus ] && [ -x /usr/bin/promtool ]; then
  echo "setup:       prometheus already installed" >&2
elif [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  with_progress setup "installing prometheus (apt-get)" sh -c \
    'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus'
  if command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
  if command -v service >/dev/null 2>&1; then
    service prometheus stop >/dev/null 2>&1 || true
  fi
elif [ -n "$in_ci" ]; then
  echo "setup: cannot apt-get install prometheus here (needs root and apt-get); CI runs" \
       "the metrics tests, so install Debian's prometheus first" >&2
  exit 1
else
  echo "setup: cannot apt-get install prometheus here (needs root and apt-get);" \
       "the Prometheus tests will skip" >&2
fi
# -- end Prometheus tests

# The real MCP servers the tests talk to (npm and PyPI packages, pinned).
step 7 "MCP peers for the stdio tests"
bash scripts/mcp_peers.sh >&2
# Node 22 and the official MCP conformance suite (both versions), pinned.
step 8 "Node 22 and the MCP conformance suites"
bash scripts/mcp_conformance.sh >&2
echo "setup: ready for the tests in $((SECONDS - started))s (PostgreSQL on 127.0.0.1:$PG_PORT," \
     "virtualenv in .venv with the test extras, chromium, pgbouncer, prometheus, MCP peers, conformance suites)" >&2
