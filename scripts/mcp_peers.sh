#!/usr/bin/env bash
# Install the real MCP servers the stdio transport tests talk to, into the repo
# (never globally):
#
#   .mcp-peers/node_modules/.bin/mcp-server-filesystem   npm @modelcontextprotocol/server-filesystem
#   .mcp-peers/node_modules/.bin/mcp-server-everything   npm @modelcontextprotocol/server-everything
#   .mcp-peers/node_modules/.bin/mcp-inspector           npm @modelcontextprotocol/inspector
#                                                        (its CLI calls the OAuth-protected
#                                                        blueprint, tests/acceptance/test_mcp_server_oauth.py)
#   .venv/bin/mcp-server-time                            PyPI mcp-server-time
#
# Versions are pinned to the ones tests/integration/test_mcp_stdio_transport.py was written
# against. Idempotent: a peer already installed at its pinned version is left
# alone, so running it again costs a few hundred milliseconds.
#
# `scripts/setup.sh --tests` calls this after it has created .venv;
# it can also be run on its own from any directory:  bash scripts/mcp_peers.sh
# Needs node >= 18 with npm, and the project virtualenv in .venv (the Inspector declares
# node >= 22.19; the CLI mode the tests use runs on node 20 too).
set -euo pipefail
here="${BASH_SOURCE[0]%/*}"
[ "$here" = "${BASH_SOURCE[0]}" ] && here=.
cd "$here/.."
source scripts/progress.sh

FILESYSTEM_VERSION="2026.8.31"
EVERYTHING_VERSION="2026.8.31"
INSPECTOR_VERSION="2.12.0"
TIME_VERSION="2026.10.19"
PREFIX=".mcp-peers"

say() { echo "mcp_peers: $*" >&2; }
fail() { say "ERROR: $*"; exit 1; }

# -- npm peers ------------------------------------------------------------------

command -v node >/dev/null 2>&1 || fail "node is not on PATH; install Node.js >= 18 (with npm)"
command -v npm >/dev/null 2>&1 || fail "npm is not on PATH; install npm alongside Node.js"

npm_installed_version() {  # prints the installed version of package $1, or nothing
  local manifest="$PREFIX/node_modules/$1/package.json"
  [ -f "$manifest" ] || return 0
  node -e 'process.stdout.write(String(require(process.argv[1]).version || ""))' "$PWD/$manifest"
}

wanted=()
for spec in "@modelcontextprotocol/server-filesystem@$FILESYSTEM_VERSION" \
            "@modelcontextprotocol/server-everything@$EVERYTHING_VERSION" \
            "@modelcontextprotocol/inspector@$INSPECTOR_VERSION"; do
  name="${spec%@*}"
  version="${spec##*@}"
  if [ "$(npm_installed_version "$name")" = "$version" ]; then
    say "$name $version already installed in $PREFIX"
  else
    wanted+=("$spec")
  fi
done
if [ "${#wanted[@]}" -gt 0 ]; then
  say "installing ${wanted[*]} into $PREFIX (npm)"
  mkdir -p "$PREFIX"
  with_progress mcp_peers "installing into $PREFIX" npm install --prefix "$PREFIX" \
      --no-audit --no-fund --save-exact --loglevel=error "${wanted[@]}" ||
    fail "npm install into $PREFIX failed (output above); is the npm registry reachable?"
fi
for bin in mcp-server-filesystem mcp-server-everything mcp-inspector; do
  [ -x "$PREFIX/node_modules/.bin/$bin" ] || fail "$PREFIX/node_modules/.bin/$bin is missing after install"
done

# -- PyPI peer --------------------------------------------------------------------

PY=.venv/bin/python
[ -x "$PY" ] || fail ".venv/bin/python not found; run bash scripts/setup.sh first (it creates .venv)"

py_installed_version() {  # prints the installed version of distribution $1, or nothing
  "$PY" - "$1" <<'PY'
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]), end="")
except metadata.PackageNotFoundError:
    pass
PY
}

if [ "$(py_installed_version mcp-server-time)" = "$TIME_VERSION" ] && [ -x .venv/bin/mcp-server-time ]; then
  say "mcp-server-time $TIME_VERSION already installed in .venv"
else
  # Hold the project's own mcp SDK where it is: mcp-server-time must not move it.
  pins=("mcp-server-time==$TIME_VERSION")
  sdk_version=$(py_installed_version mcp)
  if [ -n "$sdk_version" ]; then pins+=("mcp==$sdk_version"); fi
  say "installing ${pins[0]} into .venv (pip)"
  with_progress mcp_peers "installing into .venv" "$PY" -m pip install --no-compile \
      --progress-bar off --disable-pip-version-check "${pins[@]}" ||
    fail "pip install ${pins[*]} failed (output above); is PyPI reachable?"
  [ -x .venv/bin/mcp-server-time ] || fail ".venv/bin/mcp-server-time is missing after install"
fi

say "ready: server-filesystem $FILESYSTEM_VERSION, server-everything $EVERYTHING_VERSION," \
    "inspector $INSPECTOR_VERSION (in $PREFIX), mcp-server-time $TIME_VERSION (in .venv)"
