/* SolidLoop admin: the little behaviour htmx does not give us (no build, no eval).
 *
 * 1. Live regions (class "live-region") refresh on a timer, but not while the
 *    user is editing a form on the page: the request is cancelled, so typed
 *    filters, ticked boxes and focus survive (a row's checkbox belongs to the
 *    bulk form by its form attribute, outside the form element).
 *    The loop page's regions (its actions, decisions) are not refreshed
 *    while a confirmation there is open or one of their fields is edited.
 * 2. A form marked data-submit-once (a bulk action's confirmation) submits
 *    once: its buttons disable themselves, and a second submit is dropped
 *    (the server's idempotency token covers a reload or a replayed POST).
 *    A page restored by the back button gets its buttons back.
 * 3. The SSE extension, when a stream is CLOSED (an HTTP error), opens a new
 *    EventSource, which would forget Last-Event-ID; we carry it in the URL so
 *    the new stream still resumes with no gap and no duplicate. Reconnects of a
 *    stream that merely ended are the browser's own and send the header.
 * 4. Where the browser has SharedWorker, a loop page's stream is not its own
 *    EventSource: the page hands its loop and cursor to static/stream-worker.js,
 *    which holds one stream for every open loop page of the browser, and gets
 *    its loop's messages back over a MessagePort. The htmx sse extension gets
 *    an object that behaves as an EventSource for it (SharedSource below).
 */
(function () {
  "use strict";
  var editing = false;
  document.addEventListener("focusin", function (e) {
    if (e.target.form || (e.target.closest && e.target.closest("form"))) { editing = true; }
  });
  document.addEventListener("focusout", function () {
    window.setTimeout(function () {
      var a = document.activeElement;
      editing = !!(a && (a.form || (a.closest && a.closest("form"))) && a !== document.body);
    }, 0);
  });
  document.addEventListener("input", function (e) {
    var form = e.target.form || (e.target.closest && e.target.closest("form"));
    if (form) { form.dataset.dirty = "1"; }
  });
  document.addEventListener("htmx:beforeRequest", function (e) {
    var elt = e.detail && e.detail.elt;
    var target = e.detail && e.detail.target;
    if (target && target.id === "regions") {
      // The loop page's regions (and its actions, swapped in with them): keep an open confirmation,
      // a half-typed resume message or decision, until the operator is done.
      var a = document.activeElement;
      var actions = document.getElementById("actions");
      var busy = "details.confirm[open], form[data-dirty='1']";
      var typing = a && /^(INPUT|TEXTAREA|SELECT)$/.test(a.tagName) &&
        (target.contains(a) || (actions && actions.contains(a)));
      if (typing || target.querySelector(busy) || (actions && actions.querySelector(busy))) {
        e.preventDefault();
      }
      return;
    }
    if (!elt || !elt.classList || !elt.classList.contains("live-region")) { return; }
    if (editing || document.querySelector("form[data-dirty='1']")) { e.preventDefault(); }
  });

  document.addEventListener("submit", function (e) {
    var form = e.target;
    if (!form.hasAttribute || !form.hasAttribute("data-submit-once")) { return; }
    if (form.dataset.submitted === "1") { e.preventDefault(); return; }
    form.dataset.submitted = "1";
    window.setTimeout(function () {  // after the browser took the submitter's value
      form.querySelectorAll("button, input[type=submit]").forEach(function (b) {
        b.disabled = true;
      });
      form.setAttribute("aria-busy", "true");
    }, 0);
  });
  window.addEventListener("pageshow", function () {
    document.querySelectorAll("form[data-submit-once]").forEach(function (form) {
      delete form.dataset.submitted;
      form.removeAttribute("aria-busy");
      form.querySelectorAll("button, input[type=submit]").forEach(function (b) {
        b.disabled = false;
      });
    });
  });

  var lastIds = {};
  document.addEventListener("htmx:sseMessage", function (e) {
    var src = e.detail && e.detail.target;
    if (src && src.url && e.detail.lastEventId) { lastIds[src.url] = e.detail.lastEventId; }
  });
  // -- one stream per browser (4.) -------------------------------------------
  var shared = null;   // {port, sources: {loop: SharedSource}}
  function sharedWorker(elt) {
    if (shared !== null) { return shared || null; }
    shared = false;
    if (!window.SharedWorker || !elt.dataset.streamWorker) { return null; }
    try {
      var worker = new SharedWorker(elt.dataset.streamWorker, { name: "solidloop-admin-stream" });
      shared = { port: worker.port, sources: {}, url: elt.dataset.streams };
    } catch (err) { return null; }  // blocked (CSP, a private mode): a stream of its own
    shared.port.onmessage = function (e) {
      var source = shared.sources[e.data && e.data.loop];
      if (source) { source.receive(e.data); }
    };
    shared.port.start();
    window.addEventListener("pagehide", function () { shared.port.postMessage({ type: "bye" }); });
    window.addEventListener("pageshow", function (e) {
      if (!e.persisted) { return; }
      Object.keys(shared.sources).forEach(function (k) { shared.sources[k].register(); });
    });
    window.setInterval(function () { shared.port.postMessage({ type: "ping" }); }, 30000);
    return shared;
  }
  function SharedSource(hub, url, loop, cursor) {
    var target = new EventTarget();
    target.url = url;
    target.readyState = 0;
    target.onopen = null;
    target.onerror = null;
    target.last = +cursor || 0;
    target.register = function () {
      hub.port.postMessage({ type: "watch", loop: loop, cursor: target.last, stream: hub.url });
    };
    target.receive = function (m) {
      if (target.readyState === 2) { return; }
      if (m.id) {
        if (+m.id <= target.last) { return; }  // shown already (a replay)
        target.last = +m.id;
      }
      target.dispatchEvent(new MessageEvent(m.event, { data: m.data, lastEventId: m.id || "" }));
    };
    target.close = function () {
      if (target.readyState === 2) { return; }
      target.readyState = 2;
      delete hub.sources[loop];
      hub.port.postMessage({ type: "unwatch", loop: loop });
    };
    hub.sources[loop] = target;
    target.register();
    window.setTimeout(function () {
      if (target.readyState !== 0) { return; }
      target.readyState = 1;
      if (target.onopen) { target.onopen(new Event("open")); }
    }, 0);
    return target;
  }
  function sharedSource(url) {
    var elt = null;
    document.querySelectorAll("[data-stream-loop]").forEach(function (e) {
      if (e.getAttribute("sse-connect") === url) { elt = e; }
    });
    var hub = elt && sharedWorker(elt);
    if (!hub) { return null; }
    var old = hub.sources[elt.dataset.streamLoop];
    var cursor = old ? old.last : elt.dataset.streamCursor;
    if (old) { old.close(); }
    return SharedSource(hub, url, elt.dataset.streamLoop, cursor);
  }

  function install() {
    if (!window.htmx) { return; }
    htmx.createEventSource = function (url) {
      var viaWorker = sharedSource(url);
      if (viaWorker) { return viaWorker; }
      var base = url.split("#")[0];
      var known = null;
      Object.keys(lastIds).forEach(function (k) { if (k.indexOf(base.split("?")[0]) !== -1) { known = lastIds[k]; } });
      if (known) {
        base += (base.indexOf("?") === -1 ? "?" : "&") + "last_event_id=" + encodeURIComponent(known);
      }
      return new EventSource(base, { withCredentials: true });
    };
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", install);
  } else { install(); }
})();
