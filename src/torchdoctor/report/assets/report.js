// torchdoctor report: hover read-out for the timelines. The charts are plain SVG and read
// without this script; it only shows each series' value under the mouse in the legend.
(function () {
  "use strict";

  var SCALES = {
    "B": [["GiB", 1073741824], ["MiB", 1048576], ["KiB", 1024], ["B", 1]],
    "B/s": [["GB/s", 1e9], ["MB/s", 1e6], ["kB/s", 1e3], ["B/s", 1]],
    "s": [["s", 1], ["ms", 1e-3], ["\u00b5s", 1e-6]]
  };

  function round(v) {
    if (v === 0) { return "0"; }
    var digits = Math.max(0, 2 - Math.floor(Math.log10(Math.abs(v))));
    return String(Number(v.toFixed(Math.min(digits, 6))));
  }

  function format(v, unit) {
    if (v === null || v === undefined || !isFinite(v)) { return "n/a"; }
    if (unit === "%") { return round(v) + " %"; }
    var table = SCALES[unit];
    if (!table) { return round(v) + (unit ? " " + unit : ""); }
    for (var i = 0; i < table.length; i++) {
      if (Math.abs(v) >= table[i][1] || i === table.length - 1) {
        return round(v / table[i][1]) + " " + table[i][0];
      }
    }
    return round(v);
  }

  function clock(s) {
    var total = Math.round(s), h = Math.floor(total / 3600), m = Math.floor((total % 3600) / 60);
    var sec = total % 60, pad = function (n) { return (n < 10 ? "0" : "") + n; };
    return h ? h + ":" + pad(m) + ":" + pad(sec) : m + ":" + pad(sec);
  }

  // Index of the point nearest to time t (points are in time order).
  function nearest(points, t) {
    var lo = 0, hi = points.length - 1;
    while (hi - lo > 1) {
      var mid = (lo + hi) >> 1;
      if (points[mid][0] < t) { lo = mid; } else { hi = mid; }
    }
    return Math.abs(points[lo][0] - t) <= Math.abs(points[hi][0] - t) ? lo : hi;
  }

  function attach(box) {
    var script = box.querySelector("script.chart-data");
    var svg = box.querySelector("svg.chart");
    if (!script || !svg) { return; }
    var data = JSON.parse(script.textContent);
    var hover = svg.querySelector("rect.hover");
    var cross = svg.querySelector("line.crosshair");
    var values = box.querySelectorAll(".legend .val");
    var when = box.querySelector(".legend .at");
    var g = data.geometry;

    function show(ev) {
      var ctm = svg.getScreenCTM();
      if (!ctm) { return; }
      var pt = svg.createSVGPoint();
      pt.x = ev.clientX;
      pt.y = ev.clientY;
      var loc = pt.matrixTransform(ctm.inverse());
      var frac = Math.min(Math.max((loc.x - g[0]) / g[2], 0), 1);
      var t = frac * data.span;
      var x = g[0] + frac * g[2];
      cross.setAttribute("x1", x);
      cross.setAttribute("x2", x);
      cross.setAttribute("visibility", "visible");
      if (when) { when.textContent = "at " + clock(t); }
      var tolerance = data.span / 50;
      data.series.forEach(function (s, i) {
        var el = values[i];
        if (!el || !s.points.length) { return; }
        var p = s.points[nearest(s.points, t)];
        el.textContent = Math.abs(p[0] - t) > tolerance ? "\u2013" : format(p[1], data.unit);
      });
    }

    function hide() {
      cross.setAttribute("visibility", "hidden");
      if (when) { when.textContent = ""; }
      for (var i = 0; i < values.length; i++) {
        values[i].textContent = values[i].getAttribute("data-summary");
      }
    }

    hover.addEventListener("mousemove", show);
    hover.addEventListener("mouseleave", hide);
    box.setAttribute("data-interactive", "yes");
  }

  var boxes = document.querySelectorAll(".chart-box");
  for (var i = 0; i < boxes.length; i++) { attach(boxes[i]); }
})();
