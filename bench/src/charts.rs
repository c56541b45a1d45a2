//! SVG charts of a results file, written next to it (`results/NAME.svg`): one panel per metric,
//! a bar per scenario at its median with a whisker from its lowest round to its highest (a
//! failed round is not drawn: the JSON counts it in `failed_rounds`), and, where the file has
//! them, set-up and teardown time per pod against the pod count. Drawn from the JSON alone, so
//! `meshpath-bench charts FILE…` redraws them without measuring again. Plain SVG, no
//! dependency: bars, lines and text.

use std::{fmt::Write as _, path::Path};

use anyhow::{Context as _, Result};
use serde_json::Value;

/// Per-scenario metrics drawn as bars: key, title, unit.
const BAR_METRICS: &[(&str, &str, &str)] = &[
    ("throughput_gbps", "Throughput, one stream", "Gbit/s (higher is better)"),
    ("throughput_4_gbps", "Throughput, four streams", "Gbit/s (higher is better)"),
    ("conn_per_s", "New connections", "per second (higher is better)"),
    ("rr_p50_us", "Request/response p50", "µs (lower is better)"),
    ("rr_p99_us", "Request/response p99", "µs (lower is better)"),
    ("conn_per_s_100", "New connections, 100 clients", "per second (higher is better)"),
    ("rr_p50_us_100", "Request/response p50, 100 clients", "µs (lower is better)"),
    ("rr_p99_us_100", "Request/response p99, 100 clients", "µs (lower is better)"),
    ("cpu_s_per_gb", "Proxy CPU per GB carried", "s (lower is better)"),
    ("rss_kib_per_idle_conn", "Memory per idle pooled connection", "KiB (lower is better)"),
];

/// Per-pod timings keyed by pod count, drawn as lines: key, legend label.
const SETUP_SERIES: &[(&str, &str)] = &[
    ("enrol_ms_per_pod", "enrol"),
    ("enrol_with_tc_counters_ms_per_pod", "enrol + TC counters"),
    ("unenrol_ms_per_pod", "unenrol"),
    ("cni_add_ms_per_pod", "CNI ADD"),
    ("cni_del_ms_per_pod", "CNI DEL"),
];

const PANEL_W: f64 = 460.0;
const PANEL_H: f64 = 310.0;
/// Tableau 10: enough for every scenario and every set-up series (8 today) to keep its own.
const COLORS: &[&str] = &[
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1", "#9c755f", "#edc948",
    "#ff9da7", "#bab0ac",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// A value axis from 0 to a round number at or above `max`.
fn axis_top(max: f64) -> f64 {
    if max <= 0.0 || !max.is_finite() {
        return 1.0;
    }
    let step = 10f64.powf(max.log10().floor());
    (max / step).ceil() * step
}

struct Bar {
    label: String,
    /// The scenario's place in the file: its colour in every panel.
    index: usize,
    median: f64,
    min: f64,
    max: f64,
}

fn bars(scenarios: &serde_json::Map<String, Value>, key: &str) -> Vec<Bar> {
    scenarios
        .iter()
        .enumerate()
        .filter_map(|(index, (name, s))| {
            let median = s.get(key)?.as_f64()?;
            let rounds: Vec<f64> = s
                .get("rounds")
                .and_then(Value::as_array)
                .map(|r| r.iter().filter_map(|r| r.get(key).and_then(Value::as_f64)).collect())
                .unwrap_or_default();
            let min = rounds.iter().copied().fold(median, f64::min);
            let max = rounds.iter().copied().fold(median, f64::max);
            Some(Bar { label: name.clone(), index, median, min, max })
        })
        .collect()
}

/// A panel's plot area: its origin, left margin, width, value range and value-to-y mapping.
struct Plot<'a> {
    x0: f64,
    y0: f64,
    left: f64,
    width: f64,
    ymax: f64,
    y: &'a dyn Fn(f64) -> f64,
}

impl Plot<'_> {
    /// The panel's title and unit, and five horizontal grid lines with their values.
    fn title_and_grid(&self, svg: &mut String, title: &str, unit: &str) {
        let (x0, y0, left) = (self.x0, self.y0, self.left);
        let _ = write!(
            svg,
            r##"<text x="{}" y="{}" font-size="14" font-weight="bold">{}</text><text x="{}" y="{}" font-size="11" fill="#555">{}</text>"##,
            x0 + 8.0,
            y0 + 18.0,
            esc(title),
            x0 + 8.0,
            y0 + 33.0,
            esc(unit)
        );
        for i in 0..=4 {
            let v = self.ymax * f64::from(i) / 4.0;
            let y = (self.y)(v);
            let _ = write!(
                svg,
                r##"<line x1="{l}" x2="{r}" y1="{y}" y2="{y}" stroke="#ddd"/><text x="{tx}" y="{ty}" font-size="10" text-anchor="end">{v}</text>"##,
                l = x0 + left,
                r = x0 + left + self.width,
                tx = x0 + left - 4.0,
                ty = y + 3.0,
                v = format_num(v)
            );
        }
    }
}

fn bar_panel(svg: &mut String, x0: f64, y0: f64, title: &str, unit: &str, bars: &[Bar]) {
    let (left, bottom, top) = (56.0, 96.0, 40.0);
    let plot_h = PANEL_H - bottom - top;
    let plot_w = PANEL_W - left - 16.0;
    let ymax = axis_top(bars.iter().map(|b| b.max).fold(0.0, f64::max));
    let y = |v: f64| y0 + top + plot_h * (1.0 - v / ymax);
    let plot = Plot { x0, y0, left, width: plot_w, ymax, y: &y };
    plot.title_and_grid(svg, title, unit);
    let slot = plot_w / bars.len().max(1) as f64;
    for (i, b) in bars.iter().enumerate() {
        let cx = x0 + left + slot * (i as f64 + 0.5);
        let w = (slot * 0.6).min(48.0);
        let color = COLORS[b.index % COLORS.len()];
        let _ = write!(
            svg,
            r##"<rect x="{}" y="{}" width="{w}" height="{}" fill="{color}"><title>{}: median {} (rounds {}–{})</title></rect>"##,
            cx - w / 2.0,
            y(b.median),
            (y(0.0) - y(b.median)).max(0.0),
            esc(&b.label),
            format_num(b.median),
            format_num(b.min),
            format_num(b.max)
        );
        let _ = write!(
            svg,
            r##"<line x1="{cx}" x2="{cx}" y1="{}" y2="{}" stroke="#222"/><line x1="{}" x2="{}" y1="{}" y2="{}" stroke="#222"/><line x1="{}" x2="{}" y1="{}" y2="{}" stroke="#222"/>"##,
            y(b.min),
            y(b.max),
            cx - 5.0,
            cx + 5.0,
            y(b.min),
            y(b.min),
            cx - 5.0,
            cx + 5.0,
            y(b.max),
            y(b.max)
        );
        let _ = write!(
            svg,
            r#"<text x="{cx}" y="{}" font-size="10" text-anchor="end" transform="rotate(-30 {cx} {})">{}</text>"#,
            y0 + PANEL_H - bottom + 14.0,
            y0 + PANEL_H - bottom + 14.0,
            esc(&b.label)
        );
    }
}

fn format_num(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Series of (pod count, ms per pod), one per scenario and timing present.
fn setup_series(scenarios: &serde_json::Map<String, Value>) -> Vec<(String, Vec<(u64, f64)>)> {
    let mut out = Vec::new();
    for (name, s) in scenarios {
        for (key, label) in SETUP_SERIES {
            let Some(points) = s.get(*key).and_then(Value::as_object) else { continue };
            let mut pts: Vec<(u64, f64)> =
                points.iter().filter_map(|(n, v)| Some((n.parse().ok()?, v.as_f64()?))).collect();
            pts.sort_by_key(|p| p.0);
            if !pts.is_empty() {
                out.push((format!("{name}: {label}"), pts));
            }
        }
    }
    out
}

fn setup_panel(svg: &mut String, x0: f64, y0: f64, series: &[(String, Vec<(u64, f64)>)]) {
    let (left, bottom, top, legend_w) = (56.0, 40.0, 40.0, 0.0);
    let plot_h = PANEL_H - bottom - top;
    let plot_w = PANEL_W * 2.0 - left - 16.0 - legend_w - 220.0;
    let mut counts: Vec<u64> = series.iter().flat_map(|(_, p)| p.iter().map(|p| p.0)).collect();
    counts.sort_unstable();
    counts.dedup();
    let ymax = axis_top(series.iter().flat_map(|(_, p)| p.iter().map(|p| p.1)).fold(0.0, f64::max));
    let y = |v: f64| y0 + top + plot_h * (1.0 - v / ymax);
    // Pod counts as evenly spaced categories (1, 100, 1000).
    let x = |n: u64| {
        let i = counts.iter().position(|c| *c == n).unwrap_or(0) as f64;
        x0 + left + plot_w * (i + 0.5) / counts.len().max(1) as f64
    };
    let plot = Plot { x0, y0, left, width: plot_w, ymax, y: &y };
    plot.title_and_grid(
        svg,
        "Set-up and teardown time per pod",
        "ms per pod against pods set up at once (lower and flatter is better)",
    );
    for n in &counts {
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" font-size="10" text-anchor="middle">{n} pod{}</text>"#,
            x(*n),
            y0 + PANEL_H - bottom + 16.0,
            if *n == 1 { "" } else { "s" },
        );
    }
    for (i, (label, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = pts.iter().map(|(n, v)| format!("{},{}", x(*n), y(*v))).collect();
        let _ = write!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for (n, v) in pts {
            let _ = write!(
                svg,
                r#"<circle cx="{}" cy="{}" r="3" fill="{color}"><title>{}: {n} pods, {} ms per pod</title></circle>"#,
                x(*n),
                y(*v),
                esc(label),
                format_num(*v)
            );
        }
        let ly = y0 + top + 14.0 * i as f64;
        let lx = x0 + left + plot_w + 16.0;
        let _ = write!(
            svg,
            r#"<rect x="{lx}" y="{}" width="10" height="10" fill="{color}"/><text x="{}" y="{}" font-size="11">{}</text>"#,
            ly - 9.0,
            lx + 14.0,
            ly,
            esc(label)
        );
    }
}

/// The SVG for one results document.
pub fn render(results: &Value) -> String {
    let empty = serde_json::Map::new();
    let scenarios = results.get("scenarios").and_then(Value::as_object).unwrap_or(&empty);
    let panels: Vec<(&str, &str, Vec<Bar>)> = BAR_METRICS
        .iter()
        .map(|(k, t, u)| (*t, *u, bars(scenarios, k)))
        .filter(|(_, _, b)| !b.is_empty())
        .collect();
    let setup = setup_series(scenarios);
    let rows = panels.len().div_ceil(2) + usize::from(!setup.is_empty());
    let (w, h) = (PANEL_W * 2.0, 50.0 + PANEL_H * rows as f64);
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>"#
    );
    let head = format!(
        "commit {} · {} · {}",
        results.get("commit").and_then(Value::as_str).unwrap_or("?"),
        results.get("date").and_then(Value::as_str).unwrap_or("?"),
        results.get("machine").and_then(Value::as_str).unwrap_or("")
    );
    let _ = write!(
        svg,
        r##"<text x="8" y="22" font-size="12" fill="#333">{} — bars: median of rounds; whiskers: lowest to highest round</text>"##,
        esc(&head)
    );
    for (i, (title, unit, b)) in panels.iter().enumerate() {
        let (col, row) = (i % 2, i / 2);
        bar_panel(&mut svg, PANEL_W * col as f64, 40.0 + PANEL_H * row as f64, title, unit, b);
    }
    if !setup.is_empty() {
        setup_panel(&mut svg, 0.0, 40.0 + PANEL_H * panels.len().div_ceil(2) as f64, &setup);
    }
    svg.push_str("</svg>\n");
    svg
}

/// Writes `json`'s chart next to it (same name, `.svg`); returns the path.
pub fn write_for(json: &Path) -> Result<std::path::PathBuf> {
    let text =
        std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    let results: Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", json.display()))?;
    let out = json.with_extension("svg");
    std::fs::write(&out, render(&results)).with_context(|| format!("writing {}", out.display()))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_per_scenario_with_whiskers_from_its_rounds_and_a_line_per_setup_timing() {
        let r = serde_json::json!({"commit": "abc", "date": "d", "machine": "m", "scenarios": {
            "direct": {"conn_per_s": 10.0, "rounds": [{"conn_per_s": 8.0}, {"conn_per_s": 10.0}, {"conn_per_s": 13.0}]},
            "ebpf": {"conn_per_s": 12.0, "rounds": [], "enrol_ms_per_pod": {"1": 1.0, "100": 0.5, "1000": 0.6}}}});
        let svg = render(&r);
        assert!(svg.contains("direct: median 10.0 (rounds 8.00–13.0)"), "{svg}");
        assert!(svg.contains("ebpf: median 12.0 (rounds 12.0–12.0)"));
        assert!(svg.contains("ebpf: enrol: 1000 pods, 0.60 ms per pod"));
        assert!(!svg.contains("Throughput"), "a panel for a metric no scenario has");
    }
}
