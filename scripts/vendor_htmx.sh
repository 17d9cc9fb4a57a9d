#!/usr/bin/env bash
# Re-vendor htmx 2.x and its SSE extension into the admin blueprint's static
# folder, from their npm packages (both 0BSD). The version is in each file
# name, so a template change is needed to switch; the old files are removed.
#
#   bash scripts/vendor_htmx.sh                 # the pinned versions below
#   HTMX=2.0.11 SSE=2.2.4 bash scripts/vendor_htmx.sh
set -euo pipefail
cd "$(dirname "$0")/.."

HTMX="${HTMX:-2.0.11}"
SSE="${SSE:-2.2.4}"
dest=flask_solidloop/admin/static/vendor
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

(cd "$work" && npm pack --silent "htmx.org@$HTMX" "htmx-ext-sse@$SSE" >/dev/null)
mkdir -p "$work/htmx" "$work/sse" "$dest"
tar -xzf "$work/htmx.org-$HTMX.tgz" -C "$work/htmx"
tar -xzf "$work/htmx-ext-sse-$SSE.tgz" -C "$work/sse"
# Both must still be 0BSD (htmx says so in package.json, the extension only in
# its LICENSE file).
for pkg in htmx sse; do
  if ! grep -qiE "zero[- ]clause (bsd|license)|bsd zero[- ]clause|0BSD" "$work/$pkg/package/LICENSE"; then
    echo "vendor_htmx: $pkg's LICENSE is no longer 0BSD; refusing to vendor it" >&2
    exit 1
  fi
done
rm -f "$dest"/htmx-*.min.js "$dest"/htmx-ext-sse-*.min.js
cp "$work/htmx/package/dist/htmx.min.js" "$dest/htmx-$HTMX.min.js"
cp "$work/sse/package/dist/sse.min.js" "$dest/htmx-ext-sse-$SSE.min.js"
cp "$work/htmx/package/LICENSE" "$dest/LICENSE-htmx"
cp "$work/sse/package/LICENSE" "$dest/LICENSE-htmx-ext-sse"
cat > "$dest/VERSIONS" <<TXT
htmx.org $HTMX (npm, 0BSD): htmx-$HTMX.min.js
htmx-ext-sse $SSE (npm, 0BSD): htmx-ext-sse-$SSE.min.js
re-vendor with: bash scripts/vendor_htmx.sh
TXT
echo "vendor_htmx: htmx $HTMX and htmx-ext-sse $SSE in $dest" >&2
