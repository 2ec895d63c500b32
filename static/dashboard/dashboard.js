/* aenv dashboard: confirmations, team switcher, live sandbox list and detail (polling),
   inline action results. No dependencies. */
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

  // Sandbox detail: poll the small JSON endpoint; when the state or the event log
  // changed, re-render the live regions from the page itself and announce the state.
  function liveDetail(marker) {
    var url = marker.getAttribute("data-json-url");
    var status = document.querySelector("[data-live-status]");
    var busy = false;

    function refresh() {
      return fetch(window.location.href, { credentials: "same-origin" })
        .then(function (resp) { if (!resp.ok) throw new Error("HTTP " + resp.status); return resp.text(); })
        .then(function (html) {
          var doc = new DOMParser().parseFromString(html, "text/html");
          document.querySelectorAll("[data-live-region]").forEach(function (region) {
            var fresh = doc.querySelector('[data-live-region="' + region.getAttribute("data-live-region") + '"]');
            if (fresh) region.innerHTML = fresh.innerHTML;
          });
        });
    }

    function tick(force) {
      if (busy || (document.hidden && !force)) return Promise.resolve();
      busy = true;
      return fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (resp) {
          if (resp.redirected || !resp.ok) throw new Error("HTTP " + resp.status);
          return resp.json();
        })
        .then(function (data) {
          var lastEvent = data.last_event_id === null ? "" : String(data.last_event_id);
          var changed = data.state !== marker.getAttribute("data-state") || lastEvent !== marker.getAttribute("data-last-event");
          if (status) { status.textContent = "live"; status.classList.remove("stale"); }
          if (!changed && !force) return null;
          var stateChanged = data.state !== marker.getAttribute("data-state");
          marker.setAttribute("data-state", data.state);
          marker.setAttribute("data-last-event", lastEvent);
          return refresh().then(function () {
            if (stateChanged) document.dispatchEvent(new CustomEvent("sandbox:state", { detail: { state: data.state } }));
          });
        })
        .catch(function () {
          if (status) { status.textContent = "reconnecting…"; status.classList.add("stale"); }
        })
        .finally(function () { busy = false; });
    }
    setInterval(tick, 2000);
    document.addEventListener("sandbox:changed", function () { tick(true); });
  }

  // Forms marked data-async post with fetch and show the answer (the API's message on
  // errors) inline in [data-action-result]; without JS they post and redirect.
  function submitAsync(form) {
    var result = document.querySelector("[data-action-result]");
    var buttons = form.querySelectorAll("button");
    buttons.forEach(function (b) { b.disabled = true; });
    if (result) {
      result.hidden = false;
      result.className = "action-result message message-info";
      result.textContent = form.getAttribute("data-busy") || "Working…";
    }
    fetch(form.action, {
      method: "POST", body: new FormData(form), credentials: "same-origin",
      headers: { Accept: "application/json" },
    })
      .then(function (resp) {
        return resp.json().catch(function () { return { ok: false, level: "error", message: "HTTP " + resp.status }; });
      })
      .then(function (data) {
        if (data.ok && data.redirect) {
          window.location.assign(data.redirect);
          return;
        }
        if (result) {
          result.className = "action-result message message-" + (data.level || (data.ok ? "success" : "error"));
          result.textContent = data.message || (data.ok ? "Done." : "Failed.");
          result.setAttribute("data-level", data.level || "");
        }
      })
      .catch(function (err) {
        if (result) { result.className = "action-result message message-error"; result.textContent = String(err); }
      })
      .finally(function () {
        buttons.forEach(function (b) { b.disabled = false; });
        document.dispatchEvent(new CustomEvent("sandbox:changed"));
      });
  }

  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (form.hasAttribute("data-confirm") && !window.confirm(form.getAttribute("data-confirm"))) {
      event.preventDefault();
      return;
    }
    if (form.hasAttribute("data-async") && window.fetch) {
      event.preventDefault();
      submitAsync(form);
    }
  });

  document.addEventListener("DOMContentLoaded", function () {
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
    var marker = document.querySelector("[data-sandbox-live]");
    if (marker) liveDetail(marker);
  });
})();
