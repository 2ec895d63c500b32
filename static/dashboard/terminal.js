/* aenv dashboard: the sandbox terminal (xterm.js <-> /ws/sandboxes/<id>/terminal).
   Binary frames are PTY output; text frames are JSON status (dashboard/terminal.py).

   The status line shows the connection's real state (data-status):
     connecting    the socket is opening or the server is still attaching the shell;
     connected     the server said {"type": "ready"}: keystrokes reach the shell;
     reconnecting  the socket dropped without a final word: retried with backoff, and
                   the server re-attaches the same shell (it outlives the socket);
     closed        the shell exited, the sandbox is not running (or gone), or retries
                   ran out; the reason is shown and data-close-code holds the code. */
(function () {
  "use strict";

  var RUNNING = ["running", "snapshotting", "forking"];
  var RETRY_DELAYS_S = [1, 2, 4, 8, 10];
  var MAX_RETRIES = 15; // about two minutes of trying before the page gives up

  function setup(card) {
    var screen = card.querySelector("[data-terminal-screen]");
    var status = card.querySelector("[data-terminal-status]");
    var again = card.querySelector("[data-terminal-reconnect]");
    var path = card.getAttribute("data-ws-path");
    // Close codes after which trying again cannot help (terminal.FINAL_CLOSE_CODES):
    // anything else (network drop, server restart, envd briefly unreachable) is retried.
    var FINAL = (card.getAttribute("data-final-codes") || "").split(/\s+/).filter(Boolean).map(Number);
    var term = null, fit = null, ws = null;
    var retries = 0, retryTimer = null;

    function show(state, text, extra) {
      extra = extra || {};
      status.textContent = text;
      status.setAttribute("data-status", state);
      ["close-code", "pid", "retry"].forEach(function (name) {
        var value = extra[name];
        if (value === undefined || value === null) status.removeAttribute("data-" + name);
        else status.setAttribute("data-" + name, String(value));
      });
      status.title = extra["close-code"] ? "WebSocket close code " + extra["close-code"] : "";
      // Keys typed into a dropped socket would be lost: the screen says so by dimming.
      card.setAttribute("data-connection", state);
      if (term) term.options.disableStdin = state === "reconnecting" || state === "closed";
    }

    function button(label) {
      again.hidden = !label;
      if (label) again.textContent = label;
    }

    function send(message) {
      if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(message));
    }

    function ensureTerminal() {
      if (term) return true;
      if (!window.Terminal || !window.FitAddon) {
        show("error", "xterm.js is missing: run scripts/setup_frontend.sh, then collectstatic");
        return false;
      }
      screen.hidden = false;
      term = new window.Terminal({
        cursorBlink: true, fontSize: 13, scrollback: 5000,
        fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace",
        theme: { background: "#0f172a", foreground: "#e2e8f0", cursor: "#38bdf8" },
      });
      fit = new window.FitAddon.FitAddon();
      term.loadAddon(fit);
      term.open(screen);
      fit.fit();
      term.onData(function (data) { send({ type: "input", data: data }); });
      term.onResize(function (size) { send({ type: "resize", cols: size.cols, rows: size.rows }); });
      window.addEventListener("resize", function () { fit.fit(); });
      return true;
    }

    function retrying(reason) {
      show("reconnecting", "reconnecting… (" + reason + "; try " + retries + ")", { retry: retries });
    }

    function connect() {
      clearTimeout(retryTimer);
      retryTimer = null;
      if (ws && ws.readyState <= WebSocket.OPEN) return;
      if (!ensureTerminal()) return;
      if (retries === 0) {
        show("connecting", "connecting…");
        button(null);
      }
      var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
      var sock = new WebSocket(scheme + window.location.host + path + "?cols=" + term.cols + "&rows=" + term.rows);
      var said = null; // the server's last word: daphne drops close reasons
      ws = sock;
      sock.binaryType = "arraybuffer";
      sock.onmessage = function (event) {
        if (sock !== ws) return;
        if (typeof event.data !== "string") {
          term.write(new Uint8Array(event.data));
          return;
        }
        var msg = JSON.parse(event.data);
        if (msg.type === "ready") {
          retries = 0;
          show("connected", "connected · " + (msg.reconnected ? "reattached to " : "") + "shell pid " + msg.pid,
               { pid: msg.pid });
          button(null);
          term.focus();
        } else if (msg.type === "exit") {
          term.write("\r\n[shell exited with code " + msg.exit_code + "]\r\n");
        } else if (msg.type === "close") {
          said = msg;
        }
      };
      sock.onclose = function (event) {
        if (sock !== ws) return; // an older socket's late close: not the current state
        ws = null;
        var code = event.code;
        var reason = event.reason || (said && said.code === code ? said.reason : "") ||
          (code === 1006 ? "connection lost" : "connection closed (" + code + ")");
        if (FINAL.indexOf(code) >= 0 || retries >= MAX_RETRIES) {
          if (FINAL.indexOf(code) < 0) reason += "; gave up after " + retries + " tries";
          retries = 0;
          show("closed", "closed: " + reason, { "close-code": code });
          // After a final close other than the shell's exit a click would get the same
          // answer (a resumed sandbox reconnects by itself); after giving up it may not.
          button(code === 4000 ? "New shell" : FINAL.indexOf(code) >= 0 ? null : "Reconnect");
          return;
        }
        retries += 1;
        retrying(reason);
        button("Retry now");
        var delay = RETRY_DELAYS_S[Math.min(retries, RETRY_DELAYS_S.length) - 1];
        retryTimer = setTimeout(connect, delay * 1000);
      };
    }

    function connectNowIfWaiting() {
      if (retryTimer !== null) connect();
    }

    again.addEventListener("click", function () {
      if (ws) return; // a try is under way
      if (retryTimer === null) retries = 0; // "Reconnect" starts afresh; "Retry now" keeps counting
      connect();
    });
    // The live detail poller announces state changes: a resumed sandbox reconnects, and a
    // pending retry asks the server now (it answers with the reason if the sandbox is gone).
    document.addEventListener("sandbox:state", function (event) {
      card.setAttribute("data-sandbox-state", event.detail.state);
      if (RUNNING.indexOf(event.detail.state) >= 0 && !ws) connect();
      else connectNowIfWaiting();
    });
    window.addEventListener("online", connectNowIfWaiting);
    // Back/forward cache: a restored page's socket is gone.
    window.addEventListener("pageshow", function (event) {
      if (event.persisted && !ws && RUNNING.indexOf(card.getAttribute("data-sandbox-state")) >= 0) connect();
    });
    if (RUNNING.indexOf(card.getAttribute("data-sandbox-state")) >= 0) connect();
  }

  document.addEventListener("DOMContentLoaded", function () {
    var card = document.querySelector("[data-terminal]");
    if (card) setup(card);
  });
})();
