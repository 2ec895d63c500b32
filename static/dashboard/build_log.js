/* aenv dashboard: a template build's log, live (the build page).
   /ws/templates/<id>/builds/<build>/logs?offset=N sends the entries
   from N, then new ones, and a status message when the status changes; it closes with
   1000 once the build has ended and everything was sent. A dropped socket reconnects
   from the next index. Log text is user input: it only ever goes in via textContent. */
(function () {
  "use strict";
  var FINISHED = ["ready", "error"];
  var LEVELS = ["debug", "info", "warn", "error"];
  var card = document.querySelector("[data-build-log]");
  if (!card) return;
  var lines = card.querySelector("[data-log-lines]");
  var status = card.querySelector("[data-log-status]");
  var total = document.querySelector("[data-log-total]");
  var path = card.getAttribute("data-ws-path");
  var next = parseInt(card.getAttribute("data-next-index"), 10) || 0;
  var logCount = parseInt(card.getAttribute("data-log-count"), 10) || 0;
  var buildStatus = card.getAttribute("data-build-status");
  var retries = 0;

  function show(text, state) {
    status.textContent = text;
    status.setAttribute("data-status", state);
  }

  function span(cls, text) {
    var el = document.createElement("span");
    el.className = cls;
    el.textContent = text;
    return el;
  }

  function hhmmss(iso) {
    var d = new Date(iso);
    return isNaN(d.getTime()) ? "" : d.toISOString().substring(11, 19);
  }

  function stepPrefix(step, message) { // mirrors template_pages.step_prefix
    var prefix = step ? "[" + step + "]" : "";
    return prefix && message.indexOf(prefix) !== 0 ? prefix : "";
  }

  function atBottom() {
    return lines.scrollHeight - lines.scrollTop - lines.clientHeight < 24;
  }

  function appendLine(msg) {
    if (typeof msg.index !== "number" || msg.index < next) return; // already shown
    var stick = atBottom();
    var empty = lines.querySelector("[data-log-empty]");
    if (empty) empty.remove();
    var li = document.createElement("li");
    li.className = "log-line log-" + (LEVELS.indexOf(msg.level) >= 0 ? msg.level : "info");
    li.setAttribute("data-index", String(msg.index));
    var time = span("log-time", hhmmss(msg.timestamp));
    time.title = String(msg.timestamp || "");
    li.append(time);
    var prefix = stepPrefix(msg.step, String(msg.message));
    if (prefix) li.append(span("log-step", prefix));
    li.append(span("log-message", String(msg.message)));
    lines.append(li);
    next = msg.index + 1;
    total.textContent = next === 1 ? "1 entry" : next + " entries";
    if (stick) lines.scrollTop = lines.scrollHeight;
  }

  function setStatus(msg) {
    var changed = msg.status !== buildStatus;
    buildStatus = msg.status;
    card.setAttribute("data-build-status", msg.status);
    document.querySelectorAll("[data-build-badge]").forEach(function (holder) {
      holder.replaceChildren(span("badge badge-" + msg.status, msg.status));
    });
    if (msg.reason) {
      var reason = document.querySelector("[data-build-reason]");
      reason.replaceChildren(span("error-text", msg.reason));
      if (msg.step) reason.append(" ", span("muted", "in step " + msg.step));
    }
    if (changed && FINISHED.indexOf(msg.status) >= 0) {
      document.querySelector("[data-build-finished-note]").hidden = false;
    }
  }

  function connect() {
    var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    var said = null; // the server's last word (daphne drops close reasons)
    show(retries ? "reconnecting…" : "connecting…", "connecting");
    var ws = new WebSocket(scheme + window.location.host + path + "?offset=" + next);
    ws.onopen = function () { show("live", "open"); };
    ws.onmessage = function (event) {
      var msg;
      try { msg = JSON.parse(event.data); } catch (e) { return; }
      if (msg.type === "log") { retries = 0; appendLine(msg); }
      else if (msg.type === "status") setStatus(msg);
      else if (msg.type === "close") said = msg;
    };
    ws.onclose = function (event) {
      if (event.code === 1000) {
        show("complete", "done");
        return;
      }
      var reason = event.reason || (said && said.code === event.code ? said.reason : "");
      if (event.code >= 4400 && event.code < 4500) { // refused: retrying will not help
        show("closed (" + event.code + "): " + (reason || "refused"), "closed");
        return;
      }
      var wait = Math.min(1000 * Math.pow(2, retries), 10000);
      retries += 1;
      show("connection lost: reconnecting in " + Math.round(wait / 1000) + " s", "closed");
      window.setTimeout(connect, wait);
    };
  }

  lines.scrollTop = lines.scrollHeight;
  if (FINISHED.indexOf(buildStatus) >= 0 && next >= logCount) show("complete", "done");
  else connect();
})();
