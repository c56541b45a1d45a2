//! The Grafana dashboard shipped in deploy/dashboards/meshpath.json is a dashboard Grafana can
//! import (its model's required parts, every panel on the `$datasource` variable, no variable
//! used that it does not define) whose every query reads series and labels that meshpath
//! really exports: read from a real node (the agent, the proxy, two pods through the CNI chain
//! and one connection between them over HBONE), not from a list kept beside the code. The
//! checker is shown to refuse a dashboard with a misspelt series, label or label value. Istio's
//! own ztunnel dashboard, whose queries are read with the same checker, finds every series it
//! reads from the node proxy.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read as _, Write as _},
    net::SocketAddr,
    time::Duration,
};

use meshpath_tests::cni_node::CniNode;
use serde_json::Value;

/// Pods web and db are meshed.
const WORKLOADS: &str = "workloads:\n\
- {uid: uid-web, name: web, namespace: default, serviceAccount: web, protocol: HBONE}\n\
- {uid: uid-db, name: db, namespace: default, serviceAccount: db, protocol: HBONE}\n";

/// Labels Prometheus adds when it scrapes (not in the exposition).
const SCRAPE_LABELS: [&str; 2] = ["instance", "job"];

/// The series a query may read: Istio's, meshpath's own, and the two ztunnel exports without
/// Istio's prefix.
const SERIES_PREFIXES: [&str; 3] = ["istio_", "meshpath_", "workload_manager_"];

/// Grafana's own variables a query may use.
const GRAFANA_VARIABLES: [&str; 3] = ["__rate_interval", "__interval", "__range"];

fn dashboard_text() -> String {
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or(env!("CARGO_MANIFEST_DIR").into());
    let path = format!("{dir}/../deploy/dashboards/meshpath.json");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// What a Prometheus text exposition holds: each series (sample name) with the values each of
/// its labels took, and each declared family (`# TYPE`) with its type.
#[derive(Default)]
struct Exposition {
    series: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
    families: BTreeMap<String, String>,
    /// Each series' samples summed.
    sums: BTreeMap<String, f64>,
}

impl Exposition {
    fn read(&mut self, text: &str) {
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut it = rest.split_whitespace();
                if let (Some(name), Some(kind)) = (it.next(), it.next()) {
                    self.families.insert(name.to_owned(), kind.to_owned());
                }
                continue;
            }
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (name, labels) = match line.split_once('{') {
                Some((name, rest)) => (name, rest.rsplit_once('}').map_or("", |(l, _)| l)),
                None => (line.split_whitespace().next().unwrap_or_default(), ""),
            };
            let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
            *self.sums.entry(name.to_owned()).or_default() += value.unwrap_or(0.0);
            let entry = self.series.entry(name.to_owned()).or_default();
            for pair in split_outside_quotes(labels, ',') {
                if let Some((k, v)) = pair.split_once('=') {
                    let v = v.trim().trim_matches('"').to_owned();
                    entry.entry(k.trim().to_owned()).or_default().insert(v);
                }
            }
        }
    }

    /// Whether `name` is exported: a series with samples, or a declared family with none yet
    /// (a counter's series is its family's name and `_total`).
    fn exports(&self, name: &str) -> bool {
        self.series.contains_key(name)
            || self.families.iter().any(|(f, kind)| {
                name == f || (kind == "counter" && name.strip_suffix("_total") == Some(f.as_str()))
            })
    }
}

/// `s` split at each `sep` that is not inside double quotes.
fn split_outside_quotes(s: &str, sep: char) -> Vec<&str> {
    let (mut out, mut start, mut quoted, mut escaped) = (Vec::new(), 0, false, false);
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => quoted = !quoted,
            c if c == sep && !quoted => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out.into_iter().filter(|p| !p.trim().is_empty()).collect()
}

/// One label matcher of a selector: `label op "value"`.
struct Matcher {
    label: String,
    regex: bool,
    value: String,
}

/// What one PromQL expression reads: each metric with its selector's matchers, the labels its
/// aggregations group by, and the variables it uses.
#[derive(Default)]
struct Reads {
    metrics: Vec<(String, Vec<Matcher>)>,
    by: Vec<String>,
    variables: Vec<String>,
}

fn read_expr(expr: &str) -> Reads {
    let mut r = Reads::default();
    let b = expr.as_bytes();
    let mut i = 0;
    let closing = |from: usize, c: u8| b[from..].iter().position(|&x| x == c).map(|p| from + p);
    while i < b.len() {
        let c = b[i];
        if c == b'$' {
            let start = i + 1;
            i = start;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            r.variables.push(expr[start..i].to_owned());
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b':') {
                i += 1;
            }
            let word = &expr[start..i];
            while i < b.len() && b[i] == b' ' {
                i += 1;
            }
            if (word == "by" || word == "without") && b.get(i) == Some(&b'(') {
                let end = closing(i, b')').unwrap_or(b.len());
                r.by.extend(expr[i + 1..end].split(',').map(|l| l.trim().to_owned()));
                i = end + 1;
            } else if SERIES_PREFIXES.iter().any(|p| word.starts_with(p)) {
                let mut matchers = Vec::new();
                if b.get(i) == Some(&b'{') {
                    let end = closing(i, b'}').unwrap_or(b.len());
                    for m in split_outside_quotes(&expr[i + 1..end], ',') {
                        let op = m.find(['=', '!']).unwrap_or(m.len());
                        let value = m[op..].trim_start_matches(['=', '!', '~']).trim();
                        let value = value.trim_matches('"').to_owned();
                        if value.starts_with('$') {
                            r.variables.push(value.trim_start_matches('$').to_owned());
                        }
                        matchers.push(Matcher {
                            label: m[..op].trim().to_owned(),
                            regex: m[op..].contains('~'),
                            value,
                        });
                    }
                    i = end + 1;
                }
                r.metrics.push((word.to_owned(), matchers));
            }
        } else if c == b'"' {
            i = closing(i + 1, b'"').map_or(b.len(), |e| e + 1);
        } else if c == b'[' {
            // A range: `[$__rate_interval]`.
            let end = closing(i, b']').unwrap_or(b.len());
            r.variables.extend(expr[i + 1..end].strip_prefix('$').map(str::to_owned));
            i = end + 1;
        } else {
            i += 1;
        }
    }
    r
}

/// Every problem with the dashboard `text` against what `exported` holds; empty: none.
fn problems(text: &str, exported: &Exposition) -> Vec<String> {
    let mut out = Vec::new();
    let d: Value = match serde_json::from_str(text) {
        Ok(d) => d,
        Err(e) => return vec![format!("not JSON: {e}")],
    };
    for key in ["uid", "title"] {
        if d[key].as_str().is_none_or(str::is_empty) {
            out.push(format!("no {key}"));
        }
    }
    if d["schemaVersion"].as_u64().is_none_or(|v| v < 36) {
        out.push(format!(
            "schemaVersion {} (Grafana 9 and later read 36 and up)",
            d["schemaVersion"]
        ));
    }
    let variables: BTreeSet<String> = d["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str().map(str::to_owned))
        .collect();
    let datasource = d["templating"]["list"].as_array().into_iter().flatten().any(|v| {
        v["name"] == "datasource" && v["type"] == "datasource" && v["query"] == "prometheus"
    });
    if !datasource {
        out.push("no `datasource` variable of type datasource (prometheus)".into());
    }
    let mut ids = BTreeSet::new();
    let mut queried = 0;
    for p in d["panels"].as_array().into_iter().flatten() {
        let title = p["title"].as_str().unwrap_or("(untitled)");
        if !p["id"].as_u64().is_some_and(|id| ids.insert(id)) {
            out.push(format!("panel {title}: id {} missing or repeated", p["id"]));
        }
        let (x, w) = (p["gridPos"]["x"].as_u64(), p["gridPos"]["w"].as_u64());
        if !x.zip(w).is_some_and(|(x, w)| w > 0 && x + w <= 24) {
            out.push(format!("panel {title}: gridPos {} outside the 24 columns", p["gridPos"]));
        }
        if p["type"] == "row" {
            continue;
        }
        if p["datasource"]["uid"] != "${datasource}" {
            out.push(format!("panel {title}: datasource {} is not $datasource", p["datasource"]));
        }
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        if targets.is_empty() {
            out.push(format!("panel {title}: no query"));
        }
        let mut refs = BTreeSet::new();
        for t in &targets {
            if !t["refId"].as_str().is_some_and(|r| refs.insert(r.to_owned())) {
                out.push(format!("panel {title}: refId {} missing or repeated", t["refId"]));
            }
            let Some(expr) = t["expr"].as_str() else {
                out.push(format!("panel {title}: a query without expr"));
                continue;
            };
            queried += 1;
            out.extend(
                expr_problems(expr, exported, &variables)
                    .into_iter()
                    .map(|e| format!("panel {title}: {e} (in `{expr}`)")),
            );
        }
    }
    if queried == 0 {
        out.push("no queries".into());
    }
    out
}

fn expr_problems(expr: &str, exported: &Exposition, variables: &BTreeSet<String>) -> Vec<String> {
    let mut out = Vec::new();
    let r = read_expr(expr);
    if r.metrics.is_empty() {
        out.push("reads no series of meshpath's".into());
    }
    for v in &r.variables {
        if !variables.contains(v) && !GRAFANA_VARIABLES.contains(&v.as_str()) {
            out.push(format!("variable ${v} is not defined"));
        }
    }
    // Only the decisions' labels are known beyond what was seen: every value the datapath
    // can count.
    let decisions: BTreeSet<&str> =
        datapath_common::decisions::REASONS.iter().map(|(_, _, decision, _)| *decision).collect();
    for (name, matchers) in &r.metrics {
        if !exported.exports(name) {
            out.push(format!("{name} is not exported"));
            continue;
        }
        // Labels are checked where the series has samples.
        let Some(labels) = exported.series.get(name) else { continue };
        let grouped = r.by.iter().map(|l| (l, None));
        let matched = matchers.iter().map(|m| (&m.label, Some(m)));
        for (label, matcher) in grouped.chain(matched) {
            if SCRAPE_LABELS.contains(&label.as_str()) {
                continue;
            }
            let Some(values) = labels.get(label) else {
                out.push(format!("{name} has no label {label}"));
                continue;
            };
            let Some(m) = matcher.filter(|m| !m.value.starts_with('$')) else { continue };
            let wanted: Vec<&str> =
                if m.regex { m.value.split('|').collect() } else { vec![m.value.as_str()] };
            for v in wanted {
                let known = values.contains(v) || (label == "decision" && decisions.contains(v));
                if !known {
                    out.push(format!("{name}: {label} is never {v:?} (seen: {values:?})"));
                }
            }
        }
    }
    out
}

/// A real node's proxy and agent metrics after one connection from web to db over HBONE (the
/// two pods of one node, with the node-local path off: the mutual TLS panel reads its series).
fn exported_by_a_node() -> Exposition {
    let node = CniNode::start_with(WORKLOADS, &["--node-local-hbone"]).expect("node");
    let db = node.add_pod("db").expect("ADD db");
    node.echo_server(&db, 8080).expect("echo");
    node.publish_address(WORKLOADS, "db", db.ip);
    let web = node.add_pod("web").expect("ADD web");
    let mut c = web.connect(SocketAddr::new(db.ip, 8080)).expect("connect");
    c.write_all(b"hello").expect("write");
    let mut back = [0u8; 5];
    c.read_exact(&mut back).expect("read");
    drop(c);
    let closed = |n: &CniNode| {
        n.proxy_metric("istio_tcp_connections_closed_total", &[("reporter", "source")])
            .unwrap_or(0.0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while closed(&node) < 1.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut e = Exposition::default();
    e.read(&node.proxy_metrics_text().expect("the proxy's /metrics"));
    e.read(&node.agent_metrics_text().expect("the agent's /metrics"));
    e
}

#[test]
fn every_query_of_the_dashboard_reads_series_and_labels_a_real_node_exports() {
    let exported = exported_by_a_node();
    for seen in ["istio_tcp_connections_opened_total", "meshpath_datapath_decisions_total"] {
        assert!(exported.series.contains_key(seen), "the node exported no {seen} samples");
    }
    assert_eq!(exported.sums["meshpath_datapath_pods"], 2.0, "the agent enrolled web and db");
    let text = dashboard_text();
    let found = problems(&text, &exported);
    assert!(found.is_empty(), "deploy/dashboards/meshpath.json:\n{}", found.join("\n"));

    // The checker refuses a misspelt series, label, label value and variable.
    for (from, to, says) in [
        ("meshpath_pods{", "meshpath_podz{", "meshpath_podz is not exported"),
        ("by (reporter)", "by (reportr)", "has no label reportr"),
        ("reporter=\\\"source\\\"", "reporter=\\\"sources\\\"", "reporter is never \"sources\""),
        ("refused|dropped", "refused|droped", "decision is never \"droped\""),
        ("$__rate_interval", "$rate_interval", "variable $rate_interval is not defined"),
    ] {
        assert!(text.contains(from), "the dashboard no longer has {from}: pick another");
        let broken = problems(&text.replacen(from, to, 1), &exported);
        assert!(broken.iter().any(|p| p.contains(says)), "{to}: not refused: {broken:#?}");
    }
}

/// The queries Istio's ztunnel dashboard ("Istio Ztunnel Dashboard") makes of the node proxy,
/// as istio/istio declares them (manifests/addons/dashboards/ztunnel.libsonnet and
/// lib/queries.libsonnet at 0098d99: `names.component` is `ztunnel`). `pod` comes from the
/// scrape's Kubernetes labels, not from the proxy. Its CPU and memory panels read the kubelet's
/// cAdvisor series (`container_*`, container `istio-proxy`), which no proxy exports.
const ZTUNNEL_DASHBOARD: [&str; 9] = [
    r#"sum by (tag) (istio_build{component="ztunnel"})"#,
    "sum by (pod) (rate(istio_tcp_connections_opened_total[$__rate_interval]))",
    "sum by (pod) (rate(istio_tcp_connections_closed_total[$__rate_interval]))",
    "sum by (pod) (rate(istio_tcp_sent_bytes_total[$__rate_interval]))",
    "sum by (pod) (rate(istio_tcp_received_bytes_total[$__rate_interval]))",
    "sum by (pod) (rate(istio_dns_requests_total[$__rate_interval]))",
    "sum by (pod) (rate(istio_xds_connection_terminations_total[$__rate_interval]))",
    "sum by (pod) (workload_manager_active_proxy_count)",
    "sum by (pod) (workload_manager_pending_proxy_count)",
];

#[test]
fn istios_ztunnel_dashboard_finds_every_series_it_reads_from_the_node_proxy() {
    let exported = exported_by_a_node();
    let variables = BTreeSet::new();
    let mut found = Vec::new();
    for expr in ZTUNNEL_DASHBOARD {
        // `pod` is the scrape's label here, as `instance` is.
        let expr = expr.replace("by (pod)", "by (instance)");
        found.extend(
            expr_problems(&expr, &exported, &variables)
                .into_iter()
                .map(|p| format!("{p} (in `{expr}`)")),
        );
    }
    assert!(found.is_empty(), "Istio's ztunnel dashboard:\n{}", found.join("\n"));
    let build = &exported.series["istio_build"];
    assert_eq!(build["component"], BTreeSet::from(["ztunnel".to_owned()]));
    assert!(build["tag"].iter().all(|t| t.starts_with("meshpath-")), "{build:?}");
    assert_eq!(exported.sums["workload_manager_active_proxy_count"], 2.0, "web and db served");
    assert_eq!(exported.sums["workload_manager_pending_proxy_count"], 0.0);
}
