#!/usr/bin/env bash
# Install what tests/acceptance/test_mcp_conformance.py runs, into the repo (never
# globally):
#
#   .mcp-conformance/node/node_modules/node/bin/node              npm node@22 (Node 22)
#   .mcp-conformance/v0.1/node_modules/.bin/conformance           @modelcontextprotocol/conformance 0.1.16
#   .mcp-conformance/v0.2/node_modules/.bin/conformance           @modelcontextprotocol/conformance 0.2.0-alpha.12
#
# Node 22 comes from the npm package node@22: the machine's Node 20 is too old
# for the MCP tooling. Versions are pinned; idempotent: what is installed at its
# pinned version is left alone, so a re-run costs a few hundred milliseconds.
# `scripts/setup.sh --tests` calls it; it can also run alone:  bash scripts/mcp_conformance.sh
set -euo pipefail
here="${BASH_SOURCE[0]%/*}"
[ "$here" = "${BASH_SOURCE[0]}" ] && here=.
cd "$here/.."
source scripts/progress.sh

NODE_SPEC="node@22.23.3"
CONFORMANCE_OLD="0.1.16"
CONFORMANCE_NEW="0.2.0-alpha.12"
PREFIX=".mcp-conformance"

say() { echo "mcp_conformance: $*" >&2; }
fail() { say "ERROR: $*"; exit 1; }

command -v npm >/dev/null 2>&1 || fail "npm is not on PATH; install Node.js (any version) with npm"

installed_version() {  # $1 prefix, $2 package: prints its installed version, or nothing
  local manifest="$1/node_modules/$2/package.json"
  [ -f "$manifest" ] || return 0
  sed -n 's/^ *"version": *"\([^"]*\)".*/\1/p' "$manifest" | head -n 1
}

npm_install() {  # $1 prefix, $2 spec
  mkdir -p "$1"
  PATH="$PWD/$PREFIX/node/node_modules/node/bin:$PATH" with_progress mcp_conformance \
      "installing $2" npm install --prefix "$1" --no-audit --no-fund --save-exact \
      --loglevel=error "$2" ||
    fail "npm install $2 into $1 failed (output above); is the npm registry reachable?"
}

node_version="${NODE_SPEC##*@}"
if [ "$(installed_version "$PREFIX/node" node)" = "$node_version" ]; then
  say "node $node_version already installed in $PREFIX/node"
else
  say "installing $NODE_SPEC into $PREFIX/node (npm)"
  npm_install "$PREFIX/node" "$NODE_SPEC"
fi
NODE="$PREFIX/node/node_modules/node/bin/node"
[ -x "$NODE" ] || fail "$NODE is missing after install"

for pair in "v0.1:$CONFORMANCE_OLD" "v0.2:$CONFORMANCE_NEW"; do
  dir="$PREFIX/${pair%%:*}"
  version="${pair#*:}"
  if [ "$(installed_version "$dir" @modelcontextprotocol/conformance)" = "$version" ]; then
    say "@modelcontextprotocol/conformance $version already installed in $dir"
  else
    say "installing @modelcontextprotocol/conformance@$version into $dir (npm)"
    npm_install "$dir" "@modelcontextprotocol/conformance@$version"
  fi
  [ -x "$dir/node_modules/.bin/conformance" ] || fail "$dir/node_modules/.bin/conformance is missing"
done
say "ready: node $("$NODE" --version), conformance $CONFORMANCE_OLD and $CONFORMANCE_NEW (in $PREFIX)"
