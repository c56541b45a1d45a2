//! Telemetry: Istio's `istio_tcp_*` metrics with its standard labels, meshpath's own counters
//! for what went wrong, and one access-log line per connection (tracing target `access`).
//!
//! `istio_tcp_sent_bytes_total` counts bytes sent towards the client (the response direction),
//! `istio_tcp_received_bytes_total` bytes received from it, as Istio defines them.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Instant,
};

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::{identity::Identity, state::workloads::Workload};

/// Istio's standard TCP labels.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnLabels {
    pub reporter: String,
    pub source_workload: String,
    pub source_canonical_service: String,
    pub source_workload_namespace: String,
    pub source_principal: String,
    pub destination_workload: String,
    pub destination_canonical_service: String,
    pub destination_workload_namespace: String,
    pub destination_principal: String,
    pub destination_service: String,
    pub request_protocol: String,
    pub response_flags: String,
    pub connection_security_policy: String,
}

/// What went wrong, by where.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct XdsLabels {
    /// `address` or `authorization`.
    pub kind: String,
    /// `ack` or `nack` (responses); empty for the resources held.
    pub reply: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub direction: String,
    pub reason: String,
}

/// `istio_build`'s labels: the component Istio's dashboards select (`ztunnel`: the node
/// proxy's role) and the build (`meshpath-VERSION`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub component: String,
    pub tag: String,
}

/// `istio_dns_requests`' labels, as ztunnel's: the query's type (lowercase, one of
/// [`DNS_QUERY_TYPES`] or `other`: a pod chooses the type, so the set is bounded here) and
/// `udp` or `tcp`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DnsLabels {
    pub request_query_type: String,
    pub request_protocol: String,
}

/// The query types `istio_dns_requests` names; any other is counted as `other`.
pub const DNS_QUERY_TYPES: [&str; 12] =
    ["a", "aaaa", "any", "cname", "https", "mx", "ns", "ptr", "soa", "srv", "svcb", "txt"];

/// Why the xDS stream ended, with ztunnel's names for `istio_xds_connection_terminations`.
#[derive(Debug, Clone, Copy)]
pub enum XdsTermination {
    /// istiod could not be reached.
    ConnectionError,
    /// The stream failed.
    Error,
    /// istiod ended it.
    Complete,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TerminationLabels {
    pub reason: String,
}

/// Every metric the proxy exports.
pub struct Metrics {
    registry: Mutex<Registry>,
    pub opened: Family<ConnLabels, Counter>,
    pub closed: Family<ConnLabels, Counter>,
    pub failed: Family<ConnLabels, Counter>,
    pub sent: Family<ConnLabels, Counter>,
    pub received: Family<ConnLabels, Counter>,
    pub errors: Family<ErrorLabels, Counter>,
    pub active: Gauge,
    pub pods: Gauge,
    pub pool_connections: Gauge,
    pub pool_opened: Counter,
    pub cert_rotations: Counter,
    pub config_reloads: Family<ErrorLabels, Counter>,
    /// Unix time at which the first of the served pods' certificates expires (0: no pod).
    pub cert_earliest_expiry: Gauge,
    pub refresh_restarts: Counter,
    /// 1 while the xDS stream to istiod is open.
    pub xds_connected: Gauge,
    /// Unix time the last xDS response was applied (0: none yet).
    pub xds_last_applied: Gauge,
    /// xDS responses by type (`address`, `authorization`) and reply (`ack`, `nack`).
    pub xds_responses: Family<XdsLabels, Counter>,
    /// Resources held from xDS, by type.
    pub xds_resources: Family<XdsLabels, Gauge>,
    /// Certificates asked of the CA, by result (`ok`, `error`).
    pub ca_requests: Family<ErrorLabels, Counter>,
    /// ztunnel's names, which Istio's ztunnel dashboard reads: the build, DNS requests
    /// answered, xDS streams ended, pods served and pods being set up.
    pub build: Family<BuildLabels, Gauge>,
    pub dns_requests: Family<DnsLabels, Counter>,
    pub xds_terminations: Family<TerminationLabels, Counter>,
    pub active_proxies: Gauge,
    pub pending_proxies: Gauge,
    /// Every `istio_tcp_*` label set in use, so that those of workloads that left can be
    /// removed (`expire_workloads`): the series stay bounded by the workloads that exist.
    series: Mutex<std::collections::HashSet<ConnLabels>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registry::default();
        let m = Self {
            registry: Mutex::new(Registry::default()),
            opened: Family::default(),
            closed: Family::default(),
            failed: Family::default(),
            sent: Family::default(),
            received: Family::default(),
            errors: Family::default(),
            active: Gauge::default(),
            pods: Gauge::default(),
            pool_connections: Gauge::default(),
            pool_opened: Counter::default(),
            cert_rotations: Counter::default(),
            config_reloads: Family::default(),
            cert_earliest_expiry: Gauge::default(),
            refresh_restarts: Counter::default(),
            xds_connected: Gauge::default(),
            xds_last_applied: Gauge::default(),
            xds_responses: Family::default(),
            xds_resources: Family::default(),
            ca_requests: Family::default(),
            build: Family::default(),
            dns_requests: Family::default(),
            xds_terminations: Family::default(),
            active_proxies: Gauge::default(),
            pending_proxies: Gauge::default(),
            series: Mutex::new(std::collections::HashSet::new()),
        };
        m.build
            .get_or_create(&BuildLabels {
                component: "ztunnel".into(),
                tag: concat!("meshpath-", env!("CARGO_PKG_VERSION")).into(),
            })
            .set(1);
        r.register("istio_tcp_connections_opened", "TCP connections opened", m.opened.clone());
        r.register("istio_tcp_connections_closed", "TCP connections closed", m.closed.clone());
        r.register("istio_tcp_connections_failed", "TCP connections failed", m.failed.clone());
        r.register("istio_tcp_sent_bytes", "Bytes sent towards the client", m.sent.clone());
        r.register(
            "istio_tcp_received_bytes",
            "Bytes received from the client",
            m.received.clone(),
        );
        r.register(
            "meshpath_connection_errors",
            "Connections refused or failed, by direction and reason",
            m.errors.clone(),
        );
        r.register("meshpath_active_connections", "Connections open now", m.active.clone());
        r.register("meshpath_pods", "Pods served", m.pods.clone());
        r.register(
            "meshpath_pool_connections",
            "Outbound HBONE connections in the pool",
            m.pool_connections.clone(),
        );
        r.register(
            "meshpath_pool_connections_opened",
            "Outbound HBONE connections opened",
            m.pool_opened.clone(),
        );
        r.register(
            "meshpath_certificate_rotations",
            "Workload certificates replaced",
            m.cert_rotations.clone(),
        );
        r.register(
            "meshpath_config_reloads",
            "Workload store reloads, by result",
            m.config_reloads.clone(),
        );
        r.register(
            "meshpath_certificate_earliest_expiry_seconds",
            "Unix time at which the first served pod's certificate expires",
            m.cert_earliest_expiry.clone(),
        );
        r.register(
            "meshpath_refresh_restarts",
            "Times the refresh loop (reload, renewal, pool release) panicked and was restarted",
            m.refresh_restarts.clone(),
        );
        r.register(
            "meshpath_xds_connected",
            "1 while the xDS stream to istiod is open",
            m.xds_connected.clone(),
        );
        r.register(
            "meshpath_xds_last_applied_timestamp_seconds",
            "Unix time the last xDS response was applied",
            m.xds_last_applied.clone(),
        );
        r.register(
            "meshpath_xds_responses",
            "xDS responses, by kind and reply (ack, nack)",
            m.xds_responses.clone(),
        );
        r.register(
            "meshpath_xds_resources",
            "Resources held from xDS, by kind",
            m.xds_resources.clone(),
        );
        r.register(
            "meshpath_ca_requests",
            "Certificate requests to the CA, by result",
            m.ca_requests.clone(),
        );
        r.register("istio_build", "The proxy's build (component and tag)", m.build.clone());
        r.register(
            "istio_dns_requests",
            "DNS requests, by query type and protocol",
            m.dns_requests.clone(),
        );
        r.register(
            "istio_xds_connection_terminations",
            "xDS streams to istiod that ended, by reason",
            m.xds_terminations.clone(),
        );
        r.register(
            "workload_manager_active_proxy_count",
            "Pods served (ztunnel's name for meshpath_pods)",
            m.active_proxies.clone(),
        );
        r.register(
            "workload_manager_pending_proxy_count",
            "Pods handed over whose listeners are being opened",
            m.pending_proxies.clone(),
        );
        if let Ok(mut reg) = m.registry.lock() {
            *reg = r;
        }
        m
    }

    /// Counts one DNS request of `query_type` (any case) over UDP or TCP.
    pub fn dns_request(&self, query_type: &str, tcp: bool) {
        let lower = query_type.to_ascii_lowercase();
        let request_query_type =
            if DNS_QUERY_TYPES.contains(&lower.as_str()) { lower } else { "other".into() };
        let request_protocol = if tcp { "tcp" } else { "udp" }.into();
        self.dns_requests.get_or_create(&DnsLabels { request_query_type, request_protocol }).inc();
    }

    /// Counts an xDS stream's end.
    pub fn xds_terminated(&self, why: XdsTermination) {
        let reason = format!("{why:?}");
        self.xds_terminations.get_or_create(&TerminationLabels { reason }).inc();
    }

    /// The number of pods served, under both names.
    pub fn set_pods(&self, n: i64) {
        self.pods.set(n);
        self.active_proxies.set(n);
    }

    /// The Prometheus text exposition.
    fn track(&self, labels: &ConnLabels) {
        if let Ok(mut s) = self.series.lock() {
            if !s.contains(labels) {
                s.insert(labels.clone());
            }
        }
    }

    /// Removes the `istio_tcp_*` series whose source or destination workload (namespace,
    /// workload label) is not in `live`; `unknown` ones stay. Returns how many went.
    pub fn expire_workloads(&self, live: &std::collections::HashSet<(String, String)>) -> usize {
        let Ok(mut series) = self.series.lock() else { return 0 };
        let gone =
            |ns: &str, w: &str| w != "unknown" && !live.contains(&(ns.to_owned(), w.to_owned()));
        let before = series.len();
        series.retain(|l| {
            let expired = gone(&l.source_workload_namespace, &l.source_workload)
                || gone(&l.destination_workload_namespace, &l.destination_workload);
            if expired {
                for family in [&self.opened, &self.closed, &self.failed, &self.sent, &self.received]
                {
                    family.remove(l);
                }
            }
            !expired
        });
        before - series.len()
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Ok(reg) = self.registry.lock() {
            if encode(&mut out, &reg).is_err() {
                out.clear();
                let _ = writeln!(out, "# encoding failed");
            }
        }
        out
    }

    /// Counts a connection refused or failed before it was carried.
    pub fn error(&self, direction: Direction, reason: &str) {
        self.errors
            .get_or_create(&ErrorLabels {
                direction: direction.as_str().into(),
                reason: reason.into(),
            })
            .inc();
    }
}

/// Which side of the mesh a connection is seen from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From a local pod to elsewhere (we are the source's proxy).
    Outbound,
    /// To a local pod (we are the destination's proxy).
    Inbound,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Outbound => "outbound",
            Self::Inbound => "inbound",
        }
    }
}

/// Everything known about one connection, for its metrics and its access-log line.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub direction: Direction,
    pub src_addr: SocketAddr,
    pub src_workload: Option<Workload>,
    pub src_identity: Option<Identity>,
    pub dst_addr: SocketAddr,
    /// The peer's HBONE address, when carried over HBONE.
    pub hbone_addr: Option<SocketAddr>,
    pub dst_workload: Option<Workload>,
    pub dst_identity: Option<Identity>,
    /// `HOSTNAME` of the service the client addressed.
    pub dst_service: Option<String>,
    /// Carried between two pods of this node with no HBONE (`proxy::node_local`): no mutual
    /// TLS on the wire, whatever the identities.
    pub node_local: bool,
}

impl ConnInfo {
    fn labels(&self) -> ConnLabels {
        let unknown = || "unknown".to_string();
        // By workload (the owner), as Istio labels, never by pod: pod churn adds no series.
        let name = |w: &Option<Workload>| {
            w.as_ref().map_or_else(unknown, |w| w.workload_label().to_owned())
        };
        let canonical = |w: &Option<Workload>| {
            w.as_ref().map_or_else(unknown, |w| {
                if w.canonical_name.is_empty() {
                    w.workload_label().to_owned()
                } else {
                    w.canonical_name.clone()
                }
            })
        };
        let ns = |w: &Option<Workload>| w.as_ref().map_or_else(unknown, |w| w.namespace.clone());
        let id = |i: &Option<Identity>| i.as_ref().map_or_else(unknown, ToString::to_string);
        ConnLabels {
            reporter: match self.direction {
                Direction::Outbound => "source",
                Direction::Inbound => "destination",
            }
            .into(),
            source_workload: name(&self.src_workload),
            source_canonical_service: canonical(&self.src_workload),
            source_workload_namespace: ns(&self.src_workload),
            source_principal: id(&self.src_identity),
            destination_workload: name(&self.dst_workload),
            destination_canonical_service: canonical(&self.dst_workload),
            destination_workload_namespace: ns(&self.dst_workload),
            destination_principal: id(&self.dst_identity),
            destination_service: self.dst_service.clone().unwrap_or_else(unknown),
            request_protocol: "tcp".into(),
            response_flags: "-".into(),
            connection_security_policy: self.security().into(),
        }
    }

    /// Istio's `connection_security_policy`: `mutual_tls` when the connection was carried over
    /// mutual TLS, `none` when it is known not to have been (a node-local connection: the
    /// principals are still the pods' own, known to this proxy, which serves both), `unknown`
    /// otherwise (plain TCP to or from outside the mesh, as ztunnel labels it).
    fn security(&self) -> &'static str {
        let mtls = match self.direction {
            Direction::Outbound => self.hbone_addr.is_some(),
            Direction::Inbound => self.src_identity.is_some(),
        };
        if self.node_local {
            "none"
        } else if mtls {
            "mutual_tls"
        } else {
            "unknown"
        }
    }
}

/// Bytes moving one way: counted as they move (the metric rises during the connection).
#[derive(Debug)]
pub struct Meter {
    /// Shared with the other reporter's meter of a node-local connection.
    total: Arc<AtomicU64>,
    metric: Counter,
    /// A node-local connection's destination reporter's counter: the same bytes, counted by
    /// both reporters as they move (`ConnGuard::open_node_local`).
    twin: Option<Counter>,
}

impl Meter {
    fn new(metric: Counter) -> Self {
        Self { total: Arc::default(), metric, twin: None }
    }

    /// Records `n` bytes moved.
    pub fn add(&self, n: u64) {
        self.total.fetch_add(n, Ordering::Relaxed);
        self.metric.inc_by(n);
        if let Some(twin) = &self.twin {
            twin.inc_by(n);
        }
    }

    /// Bytes so far.
    pub fn get(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

/// A meter that counts into no exported metric (for callers of the HBONE copy loops that keep
/// no telemetry, such as test tools).
impl Default for Meter {
    fn default() -> Self {
        Self::new(Counter::default())
    }
}

/// One connection's telemetry: counted open on creation, its bytes as they move (`from_client`,
/// `to_client`), closed (with the access-log line) by `finish` — or, if dropped unfinished (its
/// pod removed, the proxy stopping), as closed with the error "cancelled".
#[derive(Debug)]
pub struct ConnGuard<'a> {
    metrics: &'a Metrics,
    info: ConnInfo,
    labels: ConnLabels,
    start: Instant,
    done: bool,
    /// Bytes from the client (Istio's "received").
    pub from_client: Meter,
    /// Bytes towards the client (Istio's "sent").
    pub to_client: Meter,
}

impl<'a> ConnGuard<'a> {
    pub fn open(metrics: &'a Metrics, info: ConnInfo) -> Self {
        let labels = info.labels();
        metrics.track(&labels);
        metrics.opened.get_or_create(&labels).inc();
        metrics.active.inc();
        let from_client = Meter::new(metrics.received.get_or_create(&labels).clone());
        let to_client = Meter::new(metrics.sent.get_or_create(&labels).clone());
        Self { metrics, info, labels, start: Instant::now(), done: false, from_client, to_client }
    }

    /// A node-local connection's telemetry, one guard per reporter (`source`: outbound,
    /// `destination`: inbound), as ztunnel keeps for a connection between two of its pods: the
    /// bytes are counted through the source's meters and by both reporters as they move.
    pub fn open_node_local(
        metrics: &'a Metrics,
        source: ConnInfo,
        destination: ConnInfo,
    ) -> (Self, Self) {
        let dst = Self::open(metrics, destination);
        let mut src = Self::open(metrics, source);
        src.from_client.total = dst.from_client.total.clone();
        src.from_client.twin = Some(dst.from_client.metric.clone());
        src.to_client.total = dst.to_client.total.clone();
        src.to_client.twin = Some(dst.to_client.metric.clone());
        (src, dst)
    }

    /// Records the end, with the error that ended it, if any.
    pub fn finish(mut self, error: Option<&str>) {
        self.record(error);
    }

    fn record(&mut self, error: Option<&str>) {
        self.done = true;
        let (up, down) = (self.from_client.get(), self.to_client.get());
        let m = self.metrics;
        // Expired while open (its workload left): tracked again, expired at the next change.
        m.track(&self.labels);
        m.closed.get_or_create(&self.labels).inc();
        if error.is_some() {
            m.failed.get_or_create(&self.labels).inc();
        }
        m.active.dec();
        let i = &self.info;
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        tracing::event!(
            target: "access",
            tracing::Level::INFO,
            src.addr = %i.src_addr,
            src.workload = %opt(i.src_workload.as_ref().map(|w| w.name.clone())),
            src.namespace = %opt(i.src_workload.as_ref().map(|w| w.namespace.clone())),
            src.identity = %opt(i.src_identity.as_ref().map(ToString::to_string)),
            dst.addr = %i.dst_addr,
            dst.hbone_addr = %opt(i.hbone_addr.map(|a| a.to_string())),
            dst.service = %opt(i.dst_service.clone()),
            dst.workload = %opt(i.dst_workload.as_ref().map(|w| w.name.clone())),
            dst.namespace = %opt(i.dst_workload.as_ref().map(|w| w.namespace.clone())),
            dst.identity = %opt(i.dst_identity.as_ref().map(ToString::to_string)),
            direction = i.direction.as_str(),
            bytes_sent = down,
            bytes_recv = up,
            // As ztunnel writes it (`duration="12ms"`), what Kiali's and the dashboards' log
            // queries read.
            duration = %format!("{}ms", self.start.elapsed().as_millis()),
            error = error.unwrap_or("-"),
            "connection complete"
        );
    }
}

impl Drop for ConnGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.record(Some("cancelled"));
        }
    }
}
