/* SolidLoop admin: one live stream per browser, shared by every open loop page
 * (a SharedWorker; no build). See docs/decisions/0045-one-stream-per-browser.md.
 *
 * A browser keeps at most six connections per host over HTTP/1.1: with one
 * EventSource per page, the seventh open loop page would not stream and every
 * other admin page would stall. Pages instead tell this worker, over their
 * MessagePort, which loop they show and the event id they show it up to
 * ({type: "watch", loop, cursor, stream}); the worker holds ONE EventSource to
 * <admin>/stream?loop=ID:CURSOR&...&client=ID for all of them (a second one per
 * further 50 loops) and hands each page its loop's messages. When the set of
 * loops changes, or the stream ends or fails, it opens a new one from each
 * loop's last cursor, so every loop resumes with no gap; a page drops what it
 * already has (ids at or below its own cursor), so nothing shows twice. The
 * server ends the older stream of the same client id at once.
 *
 * A page that loads while its loop already streams gets the loop's recent
 * messages after its cursor replayed from a buffer here; when the buffer does
 * not reach back that far, the loop is read again from the page's cursor.
 */
"use strict";

var PER_STREAM = 50;          // loops one stream carries (the server's cap)
var BUFFER = 4000;            // messages kept per loop for pages that join late
var SILENT_PORT_MS = 5 * 60 * 1000;  // a page that neither pinged nor left: gone
var pages = [];               // {port, loops: {id: true}, seen: ms}
var loops = {};               // id -> {cursor, floor, buffer: [message]}
var streamUrl = null;
var sources = [];
var client = "w" + Math.random().toString(36).slice(2) + Date.now().toString(36);
var reopenTimer = null;
var backoff = 500;

function schedule(ms) {
  if (reopenTimer) { clearTimeout(reopenTimer); }
  reopenTimer = setTimeout(function () { reopenTimer = null; open(); }, ms);
}

function closeAll() {
  sources.forEach(function (s) { s.close(); });
  sources = [];
}

function open() {
  closeAll();
  var ids = Object.keys(loops);
  if (!ids.length || !streamUrl) { return; }
  for (var i = 0; i < ids.length; i += PER_STREAM) {
    var query = ids.slice(i, i + PER_STREAM).map(function (id) {
      return "loop=" + id + ":" + loops[id].cursor;
    });
    query.push("client=" + client + "-" + (i / PER_STREAM));
    sources.push(connect(streamUrl + "?" + query.join("&")));
  }
}

function connect(url) {
  var source = new EventSource(url, { withCredentials: true });
  source.onopen = function () { backoff = 500; };
  source.onmessage = function (e) {
    var message;
    try { message = JSON.parse(e.data); } catch (err) { return; }
    var loop = loops[message.loop];
    if (!loop) { return; }
    if (message.id) {
      var seq = +message.id;
      if (seq <= loop.cursor) { return; }
      loop.cursor = seq;
      loop.buffer.push(message);
      if (loop.buffer.length > BUFFER) { loop.floor = +loop.buffer.shift().id; }
    }
    deliver(message);
    if (message.event === "end") { delete loops[message.loop]; }
  };
  source.onerror = function () {
    // Ended at its time limit, or failed: open afresh from each loop's cursor
    // (the browser's own reconnect would resend the first cursors).
    if (sources.indexOf(source) === -1) { source.close(); return; }
    source.close();
    schedule(backoff);
    backoff = Math.min(backoff * 2, 8000);
  };
  return source;
}

function deliver(message) {
  pages.forEach(function (page) {
    if (page.loops[message.loop]) { page.port.postMessage(message); }
  });
}

function watch(page, id, cursor) {
  page.loops[id] = true;
  var loop = loops[id];
  if (!loop) {
    loops[id] = { cursor: cursor, floor: cursor, buffer: [] };
    schedule(30);  // a few pages that open together share one reopen
    return;
  }
  if (cursor >= loop.cursor) { return; }  // what follows comes live
  if (loop.floor <= cursor) {
    loop.buffer.forEach(function (m) { if (+m.id > cursor) { page.port.postMessage(m); } });
    return;
  }
  loop.cursor = cursor;  // read again from the page's cursor; pages drop duplicates
  loop.floor = cursor;
  loop.buffer = [];
  schedule(30);
}

function prune() {
  var wanted = {};
  pages.forEach(function (page) { Object.keys(page.loops).forEach(function (id) { wanted[id] = true; }); });
  var changed = false;
  Object.keys(loops).forEach(function (id) {
    if (!wanted[id]) { delete loops[id]; changed = true; }
  });
  if (changed) { schedule(30); }
}

function leave(page) {
  var i = pages.indexOf(page);
  if (i !== -1) { pages.splice(i, 1); }
  prune();
}

self.onconnect = function (e) {
  var page = { port: e.ports[0], loops: {}, seen: Date.now() };
  pages.push(page);
  page.port.onmessage = function (m) {
    var data = m.data || {};
    page.seen = Date.now();
    if (data.type === "watch") {
      if (pages.indexOf(page) === -1) { pages.push(page); }  // back from the page cache
      streamUrl = data.stream || streamUrl;
      watch(page, String(data.loop), +data.cursor || 0);
    } else if (data.type === "unwatch") {
      delete page.loops[String(data.loop)];
      prune();
    } else if (data.type === "bye") {
      leave(page);
    }
  };
  page.port.start();
};

// A page that closed without saying so (a crash) stops pinging: forget it.
setInterval(function () {
  var now = Date.now();
  pages.slice().forEach(function (page) {
    if (now - page.seen > SILENT_PORT_MS) { leave(page); }
  });
}, 60 * 1000);
