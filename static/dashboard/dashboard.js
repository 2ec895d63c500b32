/* aenv dashboard: confirmations, team switcher, live sandbox list (polling). No dependencies. */
(function () {
  "use strict";

  function fmtSeconds(seconds) { // mirrors dashboard_tags.human_seconds
    if (seconds === null || seconds === undefined) return "—";
    var s = Math.abs(Math.trunc(seconds)), sign = seconds < 0 ? "-" : "";
    var d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    if (d) return sign + d + "d " + h + "h";
    if (h) return sign + h + "h " + m + "m";
    if (m) return sign + m + "m " + r + "s";
    return sign + r + "s";
  }

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    (children || []).forEach(function (c) { node.append(c); });
    return node;
  }

  function muted(text) { return el("span", { "class": "muted" }, [text]); }

  function sandboxRow(s) {
    var expires;
    if (s.expires_in_s === null) expires = muted("—");
    else if (s.expires_in_s < 0) expires = muted("expired");
    else expires = "in " + fmtSeconds(s.expires_in_s);
    var keys = Object.keys(s.metadata || {});
    var meta = keys.length ? keys.map(function (k) { return el("span", { "class": "tag" }, [k + "=" + s.metadata[k]]); }) : [muted("—")];
    return el("tr", {}, [
      el("td", { "class": "mono" }, [el("a", { href: s.url }, [s.id])]),
      el("td", {}, [el("span", { "class": "badge badge-" + s.state }, [s.state])]),
      el("td", {}, [s.template]),
      el("td", { "class": "mono" }, [s.node || "—"]),
      el("td", {}, [fmtSeconds(s.age_s)]),
      el("td", {}, [expires]),
      el("td", {}, meta),
    ]);
  }

  function liveSandboxes(table) {
    var tbody = table.querySelector("tbody");
    var status = document.querySelector("[data-live-status]");
    var count = document.querySelector("[data-count]");
    var errorBox = document.querySelector("[data-filter-error]");
    var url = table.getAttribute("data-json-url") + window.location.search;
    var busy = false;

    function tick() {
      if (busy || document.hidden) return;
      busy = true;
      fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (resp) {
          if (resp.redirected || !resp.ok) throw new Error("HTTP " + resp.status);
          return resp.json();
        })
        .then(function (data) {
          var rows = data.sandboxes.map(sandboxRow);
          if (!rows.length) rows = [el("tr", { "class": "empty-row" }, [el("td", { colspan: "7", "class": "empty" }, ["No sandboxes match."])])];
          tbody.replaceChildren.apply(tbody, rows);
          if (count) count.textContent = data.count;
          if (errorBox) { errorBox.textContent = data.error || ""; errorBox.hidden = !data.error; }
          if (status) { status.textContent = "live"; status.classList.remove("stale"); }
        })
        .catch(function () {
          if (status) { status.textContent = "reconnecting…"; status.classList.add("stale"); }
        })
        .finally(function () { busy = false; });
    }
    setInterval(tick, 2000);
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("form[data-confirm]").forEach(function (form) {
      form.addEventListener("submit", function (event) {
        if (!window.confirm(form.getAttribute("data-confirm"))) event.preventDefault();
      });
    });
    document.querySelectorAll("select[data-autosubmit]").forEach(function (select) {
      select.addEventListener("change", function () { select.form.submit(); });
    });
    document.querySelectorAll("[data-copy]").forEach(function (button) {
      button.addEventListener("click", function () {
        var secret = document.querySelector("[data-secret]");
        if (secret && navigator.clipboard) {
          navigator.clipboard.writeText(secret.textContent.trim()).then(function () { button.textContent = "Copied"; });
        }
      });
    });
    var table = document.querySelector("[data-sandbox-table]");
    if (table) liveSandboxes(table);
  });
})();
