/* lmhead's scored-text view, its calibration (the reliability diagrams), next-token panel and diff view.
 *
 * Every text from the data (tokens, prompts, the model's name) is set with textContent, never as
 * markup; the server already made control characters visible (\x1b, \x07) as the terminal does.
 * A long text is built in one DocumentFragment; the tooltip is one element, filled only for the token
 * under the pointer or the keyboard focus.
 *
 * The calibration's two diagrams come as SVG text, the very SVG of `calibrate --html`: each is parsed
 * as an SVG (XML) document, where no script runs, and only an <svg> root is put in the page.
 *
 * DOM contract: every token is an element [data-token-id]; a scored token also has data-rank
 * (1 = the model's top choice) and data-logprob (natural log, as `score --json` gives it).
 */
(function () {
  "use strict";
  if (window.lmhead) { window.lmhead.renderAll(); return; }

  var LN2 = Math.log(2);

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fixed(x, d) { return x === null || x === undefined ? "n/a" : Number(x).toFixed(d); }
  function pct(p) {
    if (p >= 0.001) return (p * 100).toFixed(p >= 0.1 ? 1 : 2) + "%";
    return p.toExponential(2);
  }
  function group(n) { return Number(n).toLocaleString("en-US"); }
  function bucketOf(rank, buckets) {
    for (var i = 0; i < buckets.length; i++) {
      if (buckets[i].max === null || rank <= buckets[i].max) return i;
    }
    return buckets.length - 1;
  }
  var MARKS = ["\u2070", "\u00b9", "\u00b2", "\u00b3", "\u207a"];

  function banner(root, data) {
    if (data.random_weights) {
      root.appendChild(el("div", "banner", "random weights: " + data.model +
        " has untrained weights; its figures say nothing about language"));
    }
  }

  function legend(buckets, scored, label) {
    var ul = el("ul", "legend");
    ul.setAttribute("aria-label", label || "rank buckets");
    buckets.forEach(function (b, i) {
      var li = el("li");
      var sw = el("span", "sw tok b" + i, MARKS[i]);
      sw.setAttribute("aria-hidden", "true");
      li.appendChild(sw);
      var share = scored ? " (" + Math.round(100 * b.count / scored) + "%)" : "";
      li.appendChild(document.createTextNode(b.name + " " + group(b.count) + share));
      ul.appendChild(li);
    });
    var li = el("li");
    li.appendChild(el("span", "sw tok unscored", "\u207b"));
    li.appendChild(document.createTextNode("unscored"));
    ul.appendChild(li);
    return ul;
  }

  /* ---- the scored text ------------------------------------------------------------------------ */

  function renderScore(root, data) {
    var t0 = performance.now();
    root.textContent = "";
    root.classList.add("lmhead-score");
    var toks = data.tokens, buckets = data.buckets, s = data.summary;
    banner(root, data);
    var sum = el("p", "summary");
    sum.textContent = "perplexity " + fixed(s.perplexity, 4) + " \u00b7 " + fixed(s.bits_per_byte, 4) +
      " bits per byte \u00b7 scored " + group(s.scored_tokens) + " of " + group(s.tokens) + " tokens \u00b7 NLL " +
      fixed(s.nll, 4) + " nats (mean " + fixed(s.mean_nll, 4) + ") \u00b7 " + data.model;
    root.appendChild(sum);
    var key = legend(buckets, s.scored_tokens);
    root.appendChild(key);
    var byEntropy = false, ebuckets = data.entropy_buckets;
    var colourBy = el("button", "colour-by", "colour by entropy");
    colourBy.type = "button";
    colourBy.setAttribute("aria-pressed", "false");
    if (ebuckets) root.appendChild(colourBy);

    var strip = el("canvas", "strip");
    strip.setAttribute("role", "img");
    strip.setAttribute("aria-label", "surprisal of each token; click to go to a token");
    root.appendChild(strip);
    var note = el("p", "strip-note");
    root.appendChild(note);

    var box = el("div", "text");
    box.setAttribute("role", "group");
    box.setAttribute("aria-label", "the scored text; arrow keys move between tokens");
    var frag = document.createDocumentFragment();
    for (var i = 0; i < toks.length; i++) {
      var r = toks[i];
      var span = document.createElement("span");
      span.textContent = r[1];
      span.setAttribute("data-token-id", r[0]);
      span.setAttribute("data-i", i);
      if (r[3] === null) {
        span.className = "tok unscored";
      } else {
        span.className = "tok b" + bucketOf(r[3], buckets);
        span.setAttribute("data-rank", r[3]);
        span.setAttribute("data-logprob", r[4]);
      }
      frag.appendChild(span);
    }
    box.appendChild(frag);
    if (box.firstChild) box.firstChild.tabIndex = 0;
    root.appendChild(box);

    // the other colouring: each scored token by the entropy of its prediction (how unsure the model was)
    colourBy.addEventListener("click", function () {
      byEntropy = !byEntropy;
      colourBy.setAttribute("aria-pressed", byEntropy ? "true" : "false");
      colourBy.textContent = byEntropy ? "colour by rank" : "colour by entropy";
      var spans = box.querySelectorAll(".tok[data-rank]");
      for (var j = 0; j < spans.length; j++) {
        var row = toks[+spans[j].getAttribute("data-i")];
        spans[j].className = "tok b" + (byEntropy ? bucketOf(row[5], ebuckets) : bucketOf(row[3], buckets));
      }
      var fresh = byEntropy ? legend(ebuckets, s.scored_tokens, "entropy buckets") : legend(buckets, s.scored_tokens);
      root.replaceChild(fresh, key);
      key = fresh;
    });

    var tip = el("div", "tip");
    tip.hidden = true;
    tip.setAttribute("role", "tooltip");
    root.appendChild(tip);

    function showTip(span) {
      var r = toks[+span.getAttribute("data-i")];
      tip.textContent = "";
      var head = el("div");
      head.appendChild(el("span", "tt", r[2]));
      head.appendChild(document.createTextNode("  id " + r[0] + " \u00b7 #" + span.getAttribute("data-i")));
      tip.appendChild(head);
      if (r[3] === null) {
        tip.appendChild(el("div", null, "unscored: nothing before it predicts it"));
      } else {
        var p = Math.exp(r[4]);
        tip.appendChild(el("div", null, "probability " + pct(p) + " \u00b7 rank " + group(r[3])));
        tip.appendChild(el("div", null, "surprisal " + fixed(-r[4] / LN2, 2) + " bits \u00b7 logprob " +
          fixed(r[4], 3)));
        tip.appendChild(el("div", null, "entropy " + fixed(r[5], 3) + " nats (" + fixed(r[5] / LN2, 2) + " bits)"));
        tip.appendChild(el("div", null, "varentropy " + fixed(r[6], 3) + " nats\u00b2 \u00b7 margin " +
          (r[7] === null ? "n/a (one token possible)" : fixed(r[7], 3) + " nats")));
        var alts = r[8];
        if (alts.length) {
          var tb = el("table");
          tb.appendChild(el("caption", null, "the model's top " + alts.length + " here"));
          alts.forEach(function (a) {
            var tr = el("tr", a[0] === r[0] ? "chosen" : null);
            tr.appendChild(el("td", "tokcell", a[1]));
            tr.appendChild(el("td", "num", pct(Math.exp(a[2]))));
            var bar = el("td");
            var b = el("span", "bar");
            b.style.width = Math.max(1, Math.round(80 * Math.exp(a[2] - alts[0][2]))) + "px";  // against the top one
            bar.appendChild(b);
            tr.appendChild(bar);
            tb.appendChild(tr);
          });
          tip.appendChild(tb);
        }
      }
      tip.hidden = false;
      var rect = span.getBoundingClientRect();
      var w = tip.offsetWidth, h = tip.offsetHeight;
      var x = Math.min(Math.max(4, rect.left), window.innerWidth - w - 4);
      var y = rect.bottom + 6;
      if (y + h > window.innerHeight - 4) y = Math.max(4, rect.top - h - 6);
      tip.style.left = x + "px";
      tip.style.top = y + "px";
    }
    function hideTip() { tip.hidden = true; }
    function tokenOf(target) { return target && target.closest ? target.closest(".tok[data-i]") : null; }

    box.addEventListener("mouseover", function (e) { var t = tokenOf(e.target); if (t) showTip(t); });
    box.addEventListener("mouseleave", hideTip);
    box.addEventListener("focusin", function (e) { var t = tokenOf(e.target); if (t) showTip(t); });
    box.addEventListener("focusout", hideTip);
    box.addEventListener("scroll", hideTip);
    function focusToken(span) {  // one token is in the tab order at a time (a roving tabindex)
      var old = box.querySelector('.tok[tabindex="0"]');
      if (old && old !== span) old.removeAttribute("tabindex");
      span.tabIndex = 0;
      span.focus({ preventScroll: true });
      span.scrollIntoView({ block: "nearest" });
      showTip(span);
    }
    box.addEventListener("click", function (e) { var t = tokenOf(e.target); if (t) focusToken(t); });
    box.addEventListener("keydown", function (e) {
      var t = tokenOf(e.target);
      if (!t) return;
      var n = box.children.length, i = +t.getAttribute("data-i"), j = i;
      if (e.key === "ArrowRight" || e.key === "ArrowDown") j = Math.min(n - 1, i + 1);
      else if (e.key === "ArrowLeft" || e.key === "ArrowUp") j = Math.max(0, i - 1);
      else if (e.key === "Home") j = 0;
      else if (e.key === "End") j = n - 1;
      else if (e.key === "Escape") { hideTip(); return; }
      else return;
      e.preventDefault();
      focusToken(box.children[j]);
    });

    /* the surprisal strip: one bar per pixel column (the mean of its tokens); a click goes there */
    var scoredIdx = [];
    for (var k = 0; k < toks.length; k++) if (toks[k][3] !== null) scoredIdx.push(k);
    function drawStrip() {
      var width = Math.max(100, Math.floor(strip.clientWidth || 600)), height = 44;
      var ratio = window.devicePixelRatio || 1;
      strip.width = width * ratio; strip.height = height * ratio;
      var ctx = strip.getContext("2d");
      if (!ctx) return;
      ctx.scale(ratio, ratio);
      ctx.clearRect(0, 0, width, height);
      var n = scoredIdx.length;
      if (!n) { note.textContent = "no scored tokens"; return; }
      var cols = Math.min(n, width), per = Math.ceil(n / cols), bins = Math.ceil(n / per), vals = [];
      var hi = 0;
      for (var b = 0; b < bins; b++) {
        var tot = 0, c = 0;
        for (var q = b * per; q < Math.min(n, (b + 1) * per); q++) { tot += -toks[scoredIdx[q]][4] / LN2; c++; }
        vals.push(tot / c);
        hi = Math.max(hi, tot / c);
      }
      var bw = width / bins;
      ctx.fillStyle = "#2a788e";
      for (var v = 0; v < bins; v++) {
        var bh = hi > 0 ? Math.max(1, vals[v] / hi * (height - 2)) : 1;
        ctx.fillRect(v * bw, height - bh, Math.max(1, bw - (bw > 3 ? 1 : 0)), bh);
      }
      strip.setAttribute("data-per", per);
      note.textContent = "surprisal, bits per token (up to " + fixed(hi, 2) + "); " +
        (per === 1 ? "one bar per token" : "one bar = the mean of " + per + " tokens") + "; click a bar to go to its token";
      strip.onclick = function (e) {
        var rect = strip.getBoundingClientRect();
        var bin = Math.min(bins - 1, Math.max(0, Math.floor((e.clientX - rect.left) / rect.width * bins)));
        focusToken(box.children[scoredIdx[bin * per]]);
      };
    }
    drawStrip();
    root.setAttribute("data-render-ms", (performance.now() - t0).toFixed(1));
    return root;
  }

  /* ---- self-contained views (score --html, notebooks): the data sits beside the view -------------- */

  function renderAll() {
    var views = document.querySelectorAll("[data-lmhead-view]:not([data-rendered])");
    Array.prototype.forEach.call(views, function (v) {
      var src = v.querySelector("script.lmhead-data");
      if (!src) return;
      var data = JSON.parse(src.textContent);
      var target = el("div");
      v.appendChild(target);
      renderScore(target, data);
      v.setAttribute("data-rendered", "");
    });
  }

  /* ---- the served page ---------------------------------------------------------------------------- */

  var TIMEOUT_MS = 300000;

  function apiKey() {
    try { return sessionStorage.getItem("lmhead-key") || ""; } catch (e) { return ""; }
  }

  function api(path, body) {
    var ctrl = new AbortController();
    var timer = setTimeout(function () { ctrl.abort(); }, TIMEOUT_MS);
    var headers = { "Content-Type": "application/json" };
    if (apiKey()) headers.Authorization = "Bearer " + apiKey();
    return fetch(path, {
      method: body === undefined ? "GET" : "POST", signal: ctrl.signal, headers: headers,
      body: body === undefined ? undefined : JSON.stringify(body)
    }).then(function (res) {
      if (res.status === 401) {
        var row = document.getElementById("key-row");
        if (row) row.hidden = false;
      }
      var answered = performance.now();
      return res.text().then(function (text) {
        var doc = null;
        try { doc = JSON.parse(text); } catch (e) { doc = null; }
        if (!res.ok || doc === null) {
          var msg = doc && doc.error && doc.error.message ? doc.error.message
            : "the server answered " + res.status + " " + res.statusText;
          throw new Error(msg);
        }
        doc.__answered = answered;
        return doc;
      });
    }, function (err) {
      throw new Error(err && err.name === "AbortError" ? "the server did not answer within " +
        TIMEOUT_MS / 1000 + " s" : "the server could not be reached (" + (err && err.message) + ")");
    }).finally(function () { clearTimeout(timer); });
  }

  function status(node, text, isError) {
    node.textContent = text || "";
    node.className = "status" + (isError ? " error" : "");
  }

  function setupPage() {
    var page = document.getElementById("lmhead-page");
    if (!page) return;
    var $ = function (id) { return document.getElementById(id); };

    $("key-go").addEventListener("click", function () {
      try { sessionStorage.setItem("lmhead-key", $("key").value); } catch (e) { /* no storage: nothing kept */ }
      location.reload();
    });
    api("/api/info").then(function (info) {
      $("model-name").textContent = info.model;
      if (info.random_weights) $("model-name").textContent += " (random weights)";
      $("limits").textContent = "texts up to " + group(info.max_text_tokens) + " tokens; context " +
        group(info.n_ctx) + " tokens";
    }, function (e) { status($("page-status"), e.message, true); });

    /* scored text */
    var busy = false;
    function score() {
      if (busy) return;
      var text = $("score-text").value;
      busy = true;
      $("score-go").disabled = true;
      status($("score-status"), "scoring\u2026");
      page.setAttribute("data-score-state", "busy");
      var sent = performance.now();
      api("/api/score", { text: text }).then(function (doc) {
        var t0 = performance.now();
        renderScore($("score-view"), doc);
        var built = performance.now();
        requestAnimationFrame(function () {
          setTimeout(function () {
            var painted = performance.now();
            var timing = { tokens: doc.tokens.length, server_ms: doc.__answered - sent,
              parse_ms: t0 - doc.__answered, render_ms: built - t0, to_paint_ms: painted - doc.__answered };
            window.lmhead.lastRender = timing;
            status($("score-status"), "scored " + group(doc.tokens.length) + " tokens; drawn in " +
              Math.round(timing.to_paint_ms) + " ms after the server's answer");
            page.setAttribute("data-score-state", "done");
          }, 0);
        });
        if (text.length <= 2000) {
          history.replaceState(null, "", "?text=" + encodeURIComponent(text));
        }
      }, function (e) {
        status($("score-status"), e.message, true);
        page.setAttribute("data-score-state", "error");
      }).finally(function () { busy = false; $("score-go").disabled = false; });
    }
    $("score-go").addEventListener("click", score);

    /* the calibration of the same text: is the model's top-1 probability honest on it? */
    function calibrate() {
      status($("calibrate-status"), "calibrating\u2026");
      page.setAttribute("data-calibrate-state", "busy");
      $("calibrate-go").disabled = true;
      api("/api/calibrate", { text: $("score-text").value }).then(function (doc) {
        drawCalibration($("calibrate-view"), doc);
        status($("calibrate-status"), "");
        page.setAttribute("data-calibrate-state", "done");
      }, function (e) {
        status($("calibrate-status"), e.message, true);
        page.setAttribute("data-calibrate-state", "error");
      }).finally(function () { $("calibrate-go").disabled = false; });
    }
    function drawCalibration(view, doc) {
      view.textContent = "";
      banner(view, doc);
      view.appendChild(el("p", "summary", group(doc.positions) + " positions; top-1 right at " + pct(doc.accuracy) +
        ", mean confidence " + pct(doc.confidence) + " \u00b7 ECE " + fixed(doc.ece, 4) + " \u00b7 Brier " +
        fixed(doc.brier, 4) + " \u00b7 NLL " + fixed(doc.nll, 4) + " nats a token"));
      view.appendChild(el("p", "summary", "temperature " + fixed(doc.temperature, 4) + " minimises the NLL: NLL " +
        fixed(doc.nll_at_temperature, 4) + " \u00b7 ECE " + fixed(doc.ece_at_temperature, 4)));
      var row = el("div", "diagrams");
      doc.svg.forEach(function (text) {
        var svg = new DOMParser().parseFromString(text, "image/svg+xml").documentElement;
        if (svg instanceof SVGSVGElement) {  // only an <svg> root goes in the page
          row.appendChild(document.importNode(svg, true));
        }
      });
      view.appendChild(row);
      var tb = el("table", "chart bins");
      var hd = el("tr");
      ["top-1 probability", "count", "confidence", "accuracy"].forEach(function (h, i) {
        hd.appendChild(el("th", i ? "num" : null, h));
      });
      tb.appendChild(hd);
      doc.bins.forEach(function (b) {
        var tr = el("tr");
        tr.setAttribute("data-count", b.count);
        tr.appendChild(el("td", null, "(" + fixed(b.lo, 2) + ", " + fixed(b.hi, 2) + "]"));
        tr.appendChild(el("td", "num", group(b.count)));
        tr.appendChild(el("td", "num", b.count ? fixed(b.confidence, 3) : ""));
        tr.appendChild(el("td", "num", b.count ? fixed(b.accuracy, 3) : ""));
        tb.appendChild(tr);
      });
      view.appendChild(tb);
    }
    $("calibrate-go").addEventListener("click", calibrate);

    /* next token */
    function targets() {
      return $("next-targets").value.split("\n").filter(function (t) { return t.length > 0; });
    }
    function inspect() {
      var prompt = $("next-prompt").value;
      status($("next-status"), "reading\u2026");
      page.setAttribute("data-next-state", "busy");
      api("/api/inspect", { prompt: prompt, top_k: +$("next-k").value || 10, targets: targets() }).then(function (doc) {
        drawNext($("next-view"), doc);
        status($("next-status"), "entropy " + fixed(doc.entropy_bits, 3) + " bits" +
          (doc.truncated ? "; the prompt lost its first " + doc.truncated + " tokens to the context" : ""));
        page.setAttribute("data-next-state", "done");
      }, function (e) {
        status($("next-status"), e.message, true);
        page.setAttribute("data-next-state", "error");
      });
    }
    function append(text) {
      $("next-prompt").value += text;
      inspect();
    }
    function drawNext(view, doc) {
      view.textContent = "";
      banner(view, doc);
      var tb = el("table", "chart");
      var hd = el("tr");
      ["rank", "token", "id", "probability", ""].forEach(function (h, i) {
        hd.appendChild(el("th", i === 0 || i === 2 || i === 3 ? "num" : null, h));
      });
      tb.appendChild(hd);
      var top = doc.top[0] ? doc.top[0].prob : 1;
      function row(t, cls, raw) {
        var tr = el("tr", cls);
        tr.setAttribute("data-token-id", t.id);
        tr.setAttribute("data-rank", t.rank);
        if (t.logprob !== undefined) tr.setAttribute("data-logprob", t.logprob);
        tr.appendChild(el("td", "num", group(t.rank)));
        tr.appendChild(el("td", "tokcell", t.token));
        tr.appendChild(el("td", "num", t.id));
        tr.appendChild(el("td", "num", pct(t.prob)));
        var cell = el("td"), b = el("span", "bar");
        b.style.width = Math.max(1, Math.round(240 * t.prob / top)) + "px";
        cell.appendChild(b);
        tr.appendChild(cell);
        if (raw !== undefined) {
          tr.classList.add("pick");
          tr.tabIndex = 0;
          tr.title = "append this token to the prompt";
          tr.addEventListener("click", function () { append(raw); });
          tr.addEventListener("keydown", function (e) { if (e.key === "Enter") append(raw); });
        }
        tb.appendChild(tr);
      }
      doc.top.forEach(function (t) { row(t, "top", t.raw); });
      if (doc.targets.length) {
        var sep = el("tr"), cell = el("th", null, "targets");
        cell.colSpan = 5;
        sep.appendChild(cell);
        tb.appendChild(sep);
      }
      doc.targets.forEach(function (t) { row(t, "target"); });
      view.appendChild(tb);
      var btn = $("next-append");
      btn.disabled = !doc.top.length;
      btn.onclick = function () { append(doc.append); };
    }
    $("next-go").addEventListener("click", inspect);
    $("next-prompt").addEventListener("keydown", function (e) {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); inspect(); }
    });

    /* two prompts */
    function diff() {
      status($("diff-status"), "comparing\u2026");
      page.setAttribute("data-diff-state", "busy");
      api("/api/diff", { a: $("diff-a").value, b: $("diff-b").value, top_k: 10 }).then(function (doc) {
        var view = $("diff-view");
        view.textContent = "";
        banner(view, doc);
        view.appendChild(el("p", "summary", "KL(A\u2016B) " + fixed(doc.kl_ab_bits, 4) + " bits \u00b7 KL(B\u2016A) " +
          fixed(doc.kl_ba_bits, 4) + " bits \u00b7 Jensen\u2013Shannon " + fixed(doc.js_bits, 4) +
          " bits \u00b7 total variation " + fixed(doc.tv, 4)));
        var cols = el("div", "cols");
        [["A", doc.a, "rank in B"], ["B", doc.b, "rank in A"]].forEach(function (s) {
          var box = el("div");
          box.appendChild(el("p", "summary", s[0] + ": \u201c" + s[1].prompt + "\u201d \u00b7 entropy " +
            fixed(s[1].entropy_bits, 3) + " bits"));
          var tb = el("table", "chart");
          var hd = el("tr");
          ["rank", "token", "probability", s[2]].forEach(function (h, i) { hd.appendChild(el("th", i !== 1 ? "num" : null, h)); });
          tb.appendChild(hd);
          s[1].top.forEach(function (t) {
            var tr = el("tr");
            tr.setAttribute("data-token-id", t.id);
            tr.setAttribute("data-rank", t.rank);
            tr.appendChild(el("td", "num", t.rank));
            tr.appendChild(el("td", "tokcell", t.token));
            tr.appendChild(el("td", "num", pct(t.prob)));
            tr.appendChild(el("td", "num", group(t.other_rank)));
            tb.appendChild(tr);
          });
          box.appendChild(tb);
          cols.appendChild(box);
        });
        view.appendChild(cols);
        status($("diff-status"), "");
        page.setAttribute("data-diff-state", "done");
      }, function (e) {
        status($("diff-status"), e.message, true);
        page.setAttribute("data-diff-state", "error");
      });
    }
    $("diff-go").addEventListener("click", diff);

    var shared = new URLSearchParams(location.search).get("text");
    if (shared !== null) {
      $("score-text").value = shared;
      score();
    }
  }

  window.lmhead = { renderScore: renderScore, renderAll: renderAll, lastRender: null };
  function start() { renderAll(); setupPage(); }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
