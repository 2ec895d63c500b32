/* aenv dashboard: the sandbox terminal (xterm.js <-> /ws/sandboxes/<id>/terminal).
   Binary frames are PTY output; text frames are JSON status; the server closes the
   socket with a 4xxx code and a reason, which is shown as is. */
(function () {
  "use strict";

  var RUNNING = ["running", "snapshotting", "forking"];

  function setup(card) {
    var screen = card.querySelector("[data-terminal-screen]");
    var status = card.querySelector("[data-terminal-status]");
    var again = card.querySelector("[data-terminal-reconnect]");
    var path = card.getAttribute("data-ws-path");
    var term = null, fit = null, ws = null;

    function show(text, state, code) {
      status.textContent = text;
      status.setAttribute("data-status", state);
      if (code !== undefined) status.setAttribute("data-close-code", String(code));
      else status.removeAttribute("data-close-code");
    }

    function send(message) {
      if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(message));
    }

    function ensureTerminal() {
      if (term) return true;
      if (!window.Terminal || !window.FitAddon) {
        show("xterm.js is missing: run scripts/setup_frontend.sh, then collectstatic", "error");
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

    function connect() {
      if (ws && ws.readyState <= WebSocket.OPEN) return;
      if (!ensureTerminal()) return;
      again.hidden = true;
      show("connecting…", "connecting");
      var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
      ws = new WebSocket(scheme + window.location.host + path + "?cols=" + term.cols + "&rows=" + term.rows);
      ws.binaryType = "arraybuffer";
      ws.onmessage = function (event) {
        if (typeof event.data !== "string") {
          term.write(new Uint8Array(event.data));
          return;
        }
        var msg = JSON.parse(event.data);
        if (msg.type === "ready") {
          show((msg.reconnected ? "reattached to" : "connected to") + " shell pid " + msg.pid, "open");
          term.focus();
        } else if (msg.type === "exit") {
          term.write("\r\n[shell exited with code " + msg.exit_code + "]\r\n");
        } else if (msg.type === "close") {
          said = msg;
        }
      };
      var said = null; // the server's last word: some servers drop close reasons
      ws.onclose = function (event) {
        var reason = event.reason || (said && said.code === event.code ? said.reason : "") ||
          (event.code === 1006 ? "connection lost" : "connection closed");
        show("closed (" + event.code + "): " + reason, "closed", event.code);
        again.hidden = false;
        ws = null;
      };
    }

    again.addEventListener("click", connect);
    // The live detail poller announces state changes: a resumed sandbox reconnects.
    document.addEventListener("sandbox:state", function (event) {
      card.setAttribute("data-sandbox-state", event.detail.state);
      if (RUNNING.indexOf(event.detail.state) >= 0 && !ws) connect();
    });
    if (RUNNING.indexOf(card.getAttribute("data-sandbox-state")) >= 0) connect();
  }

  document.addEventListener("DOMContentLoaded", function () {
    var card = document.querySelector("[data-terminal]");
    if (card) setup(card);
  });
})();
