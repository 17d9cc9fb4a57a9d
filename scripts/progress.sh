# Sourced by scripts/setup.sh, mcp_peers.sh and mcp_conformance.sh (not run on
# its own): run a long command quietly while telling the user it is alive.
#
#   with_progress PREFIX WHAT COMMAND [ARG...]
#
# COMMAND's output goes to a log; every PROGRESS_EVERY seconds (3 unless set)
# a line "PREFIX: still WHAT (Ns): <the log's last line>" goes to stderr, so a
# first install never looks hung and no gap between lines passes 5 s. When
# COMMAND fails, its log is printed and with_progress returns its status.

PROGRESS_EVERY="${PROGRESS_EVERY:-3}"

with_progress() {
  local prefix=$1 what=$2; shift 2
  local log; log=$(mktemp)
  "$@" >"$log" 2>&1 &
  local pid=$! began=$SECONDS last=$SECONDS latest
  while kill -0 "$pid" 2>/dev/null; do
    sleep 0.5
    if [ $((SECONDS - last)) -ge "$PROGRESS_EVERY" ]; then
      last=$SECONDS
      # The log's last line that is neither blank nor a warning, cut short: what
      # the command is doing now.
      latest=$(grep -Eiv '^[[:space:]]*$|^(npm )?warn' "$log" 2>/dev/null | tail -n 1 |
               cut -c 1-70 || true)
      echo "$prefix:       still $what ($((SECONDS - began))s)${latest:+: $latest}" >&2
    fi
  done
  local status=0
  wait "$pid" || status=$?
  if [ "$status" -ne 0 ]; then
    cat "$log" >&2
    echo "$prefix: $what failed (exit $status, output above)" >&2
  fi
  rm -f "$log"
  return "$status"
}
