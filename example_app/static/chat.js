/* The chat page's small behaviour htmx does not give (no build, no eval).
 *
 * 1. Each stream event is applied once. A stream the server ends is reopened
 *    by the browser itself with Last-Event-ID; but the SSE extension replaces
 *    a stream that failed (an HTTP error) with a new EventSource, and a
 *    follow-up message swaps in a new stream element: both would start from
 *    the first event. So new streams carry the last applied id in the URL
 *    (?last_event_id=, which sse_response() honours), and an event whose id
 *    was applied already (two streams overlapping for a moment) is skipped.
 * 2. The composer is cleared once its message is accepted; a refusal (the
 *    agent is still answering) is shown under it.
 */
(function () {
  "use strict";
  var applied = new Set();
  var lastId = null;

  document.addEventListener("htmx:sseBeforeMessage", function (e) {
    var id = e.detail && e.detail.lastEventId;
    if (id && applied.has(id)) { e.preventDefault(); }
  });
  document.addEventListener("htmx:sseMessage", function (e) {
    var id = e.detail && e.detail.lastEventId;
    if (id) { applied.add(id); lastId = id; }
    var log = document.getElementById("conversation");
    if (log && window.innerHeight + window.scrollY >= document.body.scrollHeight - 80) {
      window.scrollTo(0, document.body.scrollHeight);
    }
  });

  function install() {
    if (!window.htmx) { return; }
    htmx.createEventSource = function (url) {
      if (lastId) {
        url += (url.indexOf("?") === -1 ? "?" : "&") + "last_event_id=" + encodeURIComponent(lastId);
      }
      return new EventSource(url, { withCredentials: true });
    };
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", install);
  } else { install(); }

  document.addEventListener("htmx:afterRequest", function (e) {
    var form = e.detail.elt;
    var notice = document.getElementById("notice");
    if (e.detail.successful) {
      if (form && form.id === "composer") { form.reset(); }
      if (notice) { notice.textContent = ""; }
    } else if (notice) {
      notice.textContent = (e.detail.xhr && e.detail.xhr.responseText) || "The request failed.";
    }
  });
})();
