//! `meshpath-proxy`: the HBONE node proxy. Serves the pods the node agent hands it over ZDS
//! (`--zds-socket`), or those given with `--pod UID=NETNS`: their outbound captured traffic (15001), DNS (15053),
//! HBONE (15008) and inbound plaintext (15006), with workload certificates
//! from a local CA or from files; node-wide admin, metrics and readiness endpoints.

use std::{
    io::Write as _, net::SocketAddr, path::PathBuf, process::ExitCode, sync::Arc, time::Duration,
};

use anyhow::{Context as _, Result};
use clap::Parser;
use datapath_common::consts::ports;
use meshpath_podnet::netns::Netns;
use meshpath_proxy::{
    admin::{self, Endpoints, LogControl},
    certs::ca_client::{CaClient, CaConfig},
    certs::Certs,
    identity::LocalCa,
    inpod,
    istiod::ChannelConfig,
    proxy::{dns, Proxy, Settings},
    reload,
    state::{store::WorkloadStore, Synced},
    xds::{self, NodeInfo, XdsConfig},
};
use tracing_subscriber::{layer::SubscriberExt as _, util::SubscriberInitExt as _, EnvFilter};

#[derive(Parser)]
#[command(name = "meshpath-proxy", version, about = "meshpath's HBONE node proxy")]
#[command(group = clap::ArgGroup::new("certificates").required(true).args(["ca_cert", "cert_dir", "ca_address"]))]
struct Cli {
    /// Workloads, services and policies from a file (ztunnel's local configuration format,
    /// YAML), re-read when it changes: the offline mode, without istiod.
    #[arg(long, required_unless_present = "xds_address", conflicts_with = "xds_address")]
    workloads: Option<PathBuf>,
    /// istiod's xDS: workloads, services and policies over the delta stream, as ztunnel takes
    /// them (`https://HOST:PORT`; ztunnel's default is https://istiod.istio-system.svc:15012).
    #[arg(long, env = "XDS_ADDRESS")]
    xds_address: Option<String>,
    /// The root istiod's xDS certificate must chain to (the istio-ca-root-cert ConfigMap).
    #[arg(long, env = "XDS_ROOT_CA", default_value = "/var/run/secrets/istio/root-cert.pem")]
    xds_root_ca: PathBuf,
    /// Another name istiod's xDS certificate may carry instead of the address's host.
    #[arg(long, env = "ALT_XDS_HOSTNAME")]
    alt_xds_hostname: Option<String>,
    /// istiod's certificate authority: workload certificates asked of it, as ztunnel does (an
    /// ECDSA key made here per identity, a CSR, `ImpersonatedIdentity` for this node's pods).
    #[arg(long, env = "CA_ADDRESS")]
    ca_address: Option<String>,
    /// The root istiod's CA certificate must chain to; also the mesh's trust root until the
    /// CA's first answer brings its own.
    #[arg(long, env = "CA_ROOT_CA", default_value = "/var/run/secrets/istio/root-cert.pem")]
    ca_root_ca: PathBuf,
    /// Another name istiod's CA certificate may carry instead of the address's host.
    #[arg(long, env = "ALT_CA_HOSTNAME")]
    alt_ca_hostname: Option<String>,
    /// The projected service account token (audience istio-ca) sent to istiod with each call,
    /// re-read each time.
    #[arg(long, env = "AUTH_TOKEN", default_value = "/var/run/secrets/tokens/istio-token")]
    auth_token: PathBuf,
    /// The cluster's id, sent to istiod (`clusterid`).
    #[arg(long, env = "CLUSTER_ID", default_value = "Kubernetes")]
    cluster_id: String,
    /// The mesh's trust domain: the SPIFFE identity of a pod handed over by the node agent
    /// before istiod has described it (istiod's workloads carry their own).
    #[arg(long, env = "TRUST_DOMAIN", default_value = "cluster.local")]
    trust_domain: String,
    /// Validity asked of the CA (ztunnel's SECRET_TTL: `24h`, `90m`, `3600s` or seconds).
    #[arg(long, env = "SECRET_TTL", default_value = "24h", value_parser = parse_duration)]
    secret_ttl: Duration,
    /// This node (the downward API's `spec.nodeName`): its HBONE workloads' certificates are
    /// fetched ahead.
    #[arg(long, env = "NODE_NAME", default_value = "")]
    node_name: String,
    /// This proxy's pod, namespace and address, for the node istiod sees.
    #[arg(long, env = "POD_NAME", default_value = "")]
    pod_name: String,
    #[arg(long, env = "POD_NAMESPACE", default_value = "")]
    pod_namespace: String,
    #[arg(long, env = "INSTANCE_IP", default_value = "")]
    instance_ip: String,
    /// Local-CA mode: the CA certificate (PEM) workload certificates are minted from; also the
    /// trust root.
    #[arg(long, requires = "ca_key")]
    ca_cert: Option<PathBuf>,
    /// Local-CA mode: the CA key (PKCS#8 PEM, RSA or ECDSA).
    #[arg(long, requires = "ca_cert")]
    ca_key: Option<PathBuf>,
    /// Local-CA mode: lifetime of minted certificates, in seconds (renewed at half-life).
    #[arg(long, default_value_t = 24 * 3600)]
    cert_lifetime_seconds: u64,
    /// Files mode: DIR/NAMESPACE/SERVICE_ACCOUNT/{cert-chain.pem,key.pem}, re-read on change.
    #[arg(long, requires = "trust_bundle")]
    cert_dir: Option<PathBuf>,
    /// Files mode: the trust bundle (PEM), re-read on change.
    #[arg(long, requires = "cert_dir")]
    trust_bundle: Option<PathBuf>,
    /// A pod to serve: its workload uid and its netns path (repeatable).
    #[arg(long = "pod", value_name = "UID=NETNS")]
    pods: Vec<String>,
    /// The node agent's ZDS socket: pods are added and removed as it says (and `--pod` is for
    /// running without an agent).
    #[arg(long)]
    zds_socket: Option<PathBuf>,
    /// Deprecated, ignored: the proxy no longer opens the datapath (it finds the proxy's
    /// sockets by itself).
    #[arg(long, hide = true)]
    pin_root: Option<PathBuf>,
    /// Connect to apps from the pod's own address rather than the client's (by default the
    /// client's is kept, with `IP_TRANSPARENT`, as ztunnel does).
    #[arg(long)]
    no_preserve_source: bool,
    /// DNS upstreams for names not in the store (repeatable; default: /etc/resolv.conf's).
    #[arg(long = "dns-upstream", value_name = "IP:PORT")]
    dns_upstreams: Vec<SocketAddr>,
    /// Admin endpoint (/config_dump, /logging, /quitquitquit) on TCP. Any process of the host
    /// reaches it under hostNetwork: deploy turns it off (`--no-admin-tcp`) for the socket.
    #[arg(long, default_value_t = SocketAddr::from(([127, 0, 0, 1], ports::ADMIN)))]
    admin_addr: SocketAddr,
    /// Also serve admin on this unix socket, reachable by root only (mode 0600, its directory
    /// 0700).
    #[arg(long)]
    admin_socket: Option<std::path::PathBuf>,
    /// No admin on TCP (with --admin-socket: admin only there).
    #[arg(long, requires = "admin_socket")]
    no_admin_tcp: bool,
    /// Prometheus endpoint (/metrics).
    #[arg(long, default_value_t = SocketAddr::from(([0u16; 8], ports::METRICS)))]
    stats_addr: SocketAddr,
    /// Readiness endpoint (/healthz/ready).
    #[arg(long, default_value_t = SocketAddr::from(([0u16; 8], ports::READINESS)))]
    readiness_addr: SocketAddr,
    /// Streams per pooled HBONE connection before another is opened.
    #[arg(long, default_value_t = 100)]
    pool_max_streams: usize,
    /// Pooled connections per destination that concurrent streams are spread over before they
    /// share one (1: every stream shares the first, as ztunnel does).
    #[arg(long, default_value_t = meshpath_proxy::proxy::settings::POOL_SPREAD)]
    pool_spread: usize,
    /// Seconds a pooled HBONE connection without streams is kept.
    #[arg(long, default_value_t = 300)]
    pool_idle_seconds: u64,
    /// Seconds an inbound TLS + HTTP/2 handshake may take.
    #[arg(long, default_value_t = 10)]
    handshake_timeout_seconds: u64,
    /// Seconds an upstream connect may take.
    #[arg(long, default_value_t = 10)]
    connect_timeout_seconds: u64,
    /// How often a pooled HBONE connection is PINGed, in milliseconds (ztunnel: 10 s).
    #[arg(long, default_value_t = 10_000, hide = true)]
    hbone_keepalive_interval_ms: u64,
    /// How long the peer has to answer a PING before the connection is closed, in
    /// milliseconds (ztunnel: 20 s).
    #[arg(long, default_value_t = 20_000, hide = true)]
    hbone_keepalive_timeout_ms: u64,
    /// Connections carried at once over all pods; more are closed at once and counted
    /// (`meshpath_connection_errors_total{reason="connection_limit"}`). Default: what the
    /// proxy's memory limit (its cgroup's) holds at 64 KiB a connection, after 64 MiB for the
    /// rest and a quarter kept free (between 1,000 and 200,000; 200,000 without a limit), so a
    /// flood of connections is refused before the proxy runs out of memory.
    #[arg(long)]
    max_connections: Option<usize>,
    /// Connections carried at once for one pod, in each direction: to it (15008, 15006, and
    /// each inbound HBONE stream) and from it (15001, TCP 15053), each under its own cap.
    #[arg(long, default_value_t = 20_000)]
    max_connections_per_pod: usize,
    /// Connections one source address may hold to a pod's HBONE port (15008) before its TLS
    /// handshake has proven an identity; more from it are closed at once and counted
    /// (`reason="handshake_limit"`), so that one peer cannot take all of the pod's inbound cap.
    #[arg(long, default_value_t = meshpath_proxy::proxy::settings::MAX_HANDSHAKES_PER_SOURCE)]
    max_handshakes_per_source: usize,
    /// Seconds a connection may carry nothing either way before it is closed (Envoy's TCP
    /// proxy default: an hour); 0: never.
    #[arg(long, default_value_t = 3600)]
    idle_timeout_seconds: u64,
    /// Seconds an inbound HBONE connection may have no stream before it is told to go away
    /// (GOAWAY) and closed, freeing its slot under the connection caps; 0: never.
    #[arg(long, default_value_t = meshpath_proxy::proxy::settings::HBONE_IDLE_SECONDS)]
    hbone_idle_seconds: u64,
    /// Seconds a paused HBONE stream (its peer's proxy being upgraded) waits to be resumed
    /// before its app's connection is closed.
    #[arg(long, default_value_t = meshpath_proxy::proxy::settings::RESUME_WITHIN_SECONDS,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    resume_within_seconds: u64,
    /// Carry connections between two pods of this node over HBONE (mutual TLS on every hop,
    /// through this proxy twice), as ztunnel does, rather than directly from one pod to the
    /// other (the node-local path: the same policy and telemetry, no TLS).
    #[arg(long)]
    node_local_hbone: bool,
    /// How often files are checked for changes, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    refresh_ms: u64,
    /// On SIGTERM: how long open connections may take to finish, in seconds.
    #[arg(long, default_value_t = 30)]
    drain_seconds: u64,
    /// Tokio worker threads carrying the connections (ztunnel's `ZTUNNEL_WORKER_THREADS`).
    #[arg(long, default_value_t = meshpath_proxy::proxy::settings::WORKER_THREADS,
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    worker_threads: u16,
}

/// `meshpath-proxy new-ca DIR`: writes a new CA (ca.pem, ca-key.pem) for tests and the demo.
fn new_ca(dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let (cert, key) = LocalCa::generate("meshpath local CA")?.to_pem();
    std::fs::write(dir.join("ca.pem"), cert)?;
    let key_path = dir.join("ca-key.pem");
    std::fs::write(&key_path, key)?;
    std::fs::set_permissions(&key_path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    println!("wrote {0}/ca.pem and {0}/ca-key.pem", dir.display());
    Ok(())
}

/// Logging to stderr with a filter the admin endpoint can change.
fn init_logging() -> LogControl {
    let initial = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, handle) = tracing_subscriber::reload::Layer::new(initial);
    tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
        )
        .init();
    Arc::new(move |new: Option<&str>| {
        if let Some(f) = new {
            let f = EnvFilter::try_new(f).map_err(|e| format!("bad filter {f:?}: {e}"))?;
            handle.reload(f).map_err(|e| e.to_string())?;
        }
        handle.with_current(ToString::to_string).map_err(|e| e.to_string())
    })
}

/// jemalloc, unprefixed (it serves malloc(3) as well; tuned with `MALLOC_CONF`), as ztunnel's
/// `jemalloc` build feature has it: an idle pooled HBONE connection holds less resident memory
/// than under glibc's malloc (pages of h2's fixed-size buffers it never writes stay unbacked),
/// and freed read buffers stay mapped for reuse for its decay time instead of being trimmed and
/// faulted in again on the next read (the measurements: results/README.md, "Why the proxy has
/// its shape").
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let log = init_logging();
    let args: Vec<String> = std::env::args().collect();
    let res = match args.get(1).map(String::as_str) {
        Some("new-ca") => match args.get(2) {
            Some(dir) => new_ca(dir.as_ref()),
            None => Err(anyhow::anyhow!("usage: meshpath-proxy new-ca DIR")),
        },
        _ => run(Cli::parse(), log),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshpath-proxy: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `24h`, `90m`, `30s`, or a number of seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.find(|c: char| !c.is_ascii_digit()).map_or((s, ""), |i| s.split_at(i));
    let n: u64 = num.parse().map_err(|_| format!("{s:?}: a duration is N, Ns, Nm or Nh"))?;
    let secs = match unit {
        "" | "s" => n,
        "m" => n.saturating_mul(60),
        "h" => n.saturating_mul(3600),
        _ => return Err(format!("{s:?}: a duration is N, Ns, Nm or Nh")),
    };
    if secs == 0 {
        return Err(format!("{s:?}: must be more than zero"));
    }
    Ok(Duration::from_secs(secs))
}

fn read(p: &PathBuf) -> Result<String> {
    std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
}

fn channel(
    cli: &Cli,
    address: &str,
    root: &std::path::Path,
    alt: &Option<String>,
) -> ChannelConfig {
    ChannelConfig {
        address: address.to_owned(),
        root_ca: root.to_path_buf(),
        alt_hostname: alt.clone(),
        // No token file: no authorization header (istiod then refuses, and says so).
        token: cli.auth_token.exists().then(|| cli.auth_token.clone()),
        cluster_id: cli.cluster_id.clone(),
    }
}

fn certs(cli: &Cli, metrics: &Arc<meshpath_proxy::metrics::Metrics>) -> Result<Certs> {
    if let Some(address) = &cli.ca_address {
        let cfg = CaConfig {
            channel: channel(cli, address, &cli.ca_root_ca, &cli.alt_ca_hostname),
            ttl: cli.secret_ttl,
        };
        let client = Arc::new(CaClient::new(cfg, metrics.clone()));
        return Certs::istiod(client, &cli.ca_root_ca)
            .with_context(|| format!("istiod's root {}", cli.ca_root_ca.display()));
    }
    match (&cli.ca_cert, &cli.ca_key, &cli.cert_dir, &cli.trust_bundle) {
        (Some(cert), Some(key), _, _) => {
            let ca = LocalCa::from_pem(&read(cert)?, &read(key)?)
                .with_context(|| format!("CA {} / {}", cert.display(), key.display()))?;
            Ok(Certs::local_ca(ca, Duration::from_secs(cli.cert_lifetime_seconds.max(1))))
        }
        (_, _, Some(dir), Some(bundle)) => Ok(Certs::files(dir.clone(), bundle.clone())?),
        _ => anyhow::bail!(
            "give --ca-address (istiod), --ca-cert and --ca-key, or --cert-dir and --trust-bundle"
        ),
    }
}

fn run(cli: Cli, log: LogControl) -> Result<()> {
    meshpath_proxy::proxy::netns::open_home().context("opening the proxy's own netns")?;
    // Stamped before reading: a change written meanwhile is reloaded, not missed.
    let stamp = cli.workloads.as_deref().and_then(meshpath_proxy::certs::file_stamp);
    let store = match &cli.workloads {
        Some(path) => WorkloadStore::load(path)?,
        // Empty until istiod's first response.
        None => WorkloadStore::default(),
    };
    let dns_upstreams = if cli.dns_upstreams.is_empty() {
        dns::resolv_conf_upstreams(&std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default())
    } else {
        cli.dns_upstreams.clone()
    };
    if cli.pin_root.is_some() {
        tracing::warn!(
            "--pin-root is deprecated and ignored: the datapath needs nothing from the proxy"
        );
    }
    let settings = Settings {
        trust_domain: cli.trust_domain.clone(),
        dns_upstreams,
        pool_max_streams: cli.pool_max_streams,
        pool_spread: cli.pool_spread,
        pool_idle: Duration::from_secs(cli.pool_idle_seconds),
        handshake_timeout: Duration::from_secs(cli.handshake_timeout_seconds),
        connect_timeout: Duration::from_secs(cli.connect_timeout_seconds),
        preserve_source: !cli.no_preserve_source,
        max_connections: cli.max_connections.unwrap_or_else(|| {
            let limit = meshpath_proxy::proxy::memory::own_limit();
            let cap = meshpath_proxy::proxy::memory::cap_for(limit);
            tracing::info!(memory_limit = ?limit, max_connections = cap, "connection cap from the memory limit");
            cap
        }).max(1),
        max_connections_per_pod: cli.max_connections_per_pod.max(1),
        max_handshakes_per_source: cli.max_handshakes_per_source.max(1),
        idle_timeout: (cli.idle_timeout_seconds > 0)
            .then(|| Duration::from_secs(cli.idle_timeout_seconds)),
        hbone_idle: (cli.hbone_idle_seconds > 0)
            .then(|| Duration::from_secs(cli.hbone_idle_seconds)),
        resume_within: Duration::from_secs(cli.resume_within_seconds),
        node_local: !cli.node_local_hbone,
        keepalive: meshpath_proxy::proxy::hbone::Keepalive {
            interval: Duration::from_millis(cli.hbone_keepalive_interval_ms.max(1)),
            timeout: Duration::from_millis(cli.hbone_keepalive_timeout_ms.max(1)),
        },
    };
    let metrics = Arc::new(meshpath_proxy::metrics::Metrics::new());
    let proxy = Proxy::with_metrics(store, certs(&cli, &metrics)?, settings, metrics)?;
    let mut pods = Vec::new();
    for spec in &cli.pods {
        let (uid, path) =
            spec.split_once('=').with_context(|| format!("--pod {spec}: expected UID=NETNS"))?;
        pods.push((uid.to_owned(), Netns::open(path.as_ref())?));
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.worker_threads.into())
        .enable_all()
        .build()?
        .block_on(async {
            let mut out = std::io::stdout().lock();
            if let Some(path) = &cli.admin_socket {
                let listener = admin::bind_unix(path)
                    .with_context(|| format!("binding the admin socket {}", path.display()))?;
                admin::serve_unix(listener, Endpoints::Admin, proxy.clone(), log.clone());
                writeln!(out, "ADMIN_SOCKET {}", path.display())?;
            }
            for (which, addr, name) in [
                (Endpoints::Admin, cli.admin_addr, "ADMIN"),
                (Endpoints::Stats, cli.stats_addr, "STATS"),
                (Endpoints::Readiness, cli.readiness_addr, "READINESS"),
            ] {
                if which == Endpoints::Admin && cli.no_admin_tcp {
                    continue;
                }
                let (listener, bound) =
                    admin::bind(addr).await.with_context(|| format!("binding {name} {addr}"))?;
                admin::serve(listener, which, proxy.clone(), log.clone());
                writeln!(out, "{name} {bound}")?;
            }
            // `--pod`: its workload is the store's, from the file now or from istiod's first
            // responses.
            let synced = cli.xds_address.as_ref().map(|_| Arc::new(Synced::default()));
            let add_pods = {
                let proxy = proxy.clone();
                let synced = synced.clone();
                move || async move {
                    if let Some(s) = &synced {
                        while !s.all() {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                    for (uid, netns) in pods {
                        let workload =
                            proxy.store().by_uid(&uid).cloned().with_context(|| {
                                format!("--pod {uid}: no workload with this uid in the store")
                            })?;
                        let p = proxy.clone();
                        tokio::task::spawn_blocking(move || {
                            inpod::add(&p, &uid, netns, workload, Default::default())
                        })
                            .await??;
                    }
                    anyhow::Ok(())
                }
            };
            if let (Some(address), Some(synced)) = (&cli.xds_address, &synced) {
                proxy.expect_xds(synced.clone());
                let cfg = XdsConfig {
                    channel: channel(&cli, address, &cli.xds_root_ca, &cli.alt_xds_hostname),
                    node: NodeInfo {
                        instance_ip: cli.instance_ip.clone(),
                        pod_name: cli.pod_name.clone(),
                        pod_namespace: cli.pod_namespace.clone(),
                        node_name: cli.node_name.clone(),
                    },
                };
                xds::spawn(proxy.clone(), cfg, synced.clone());
            }
            if let Some(ca) = proxy.certs.ca_client() {
                // Renewed: the served pods' identities, and those of this node's HBONE
                // workloads istiod lists (fetched ahead, before their pods arrive).
                let weak = Arc::downgrade(&proxy);
                let node = cli.node_name.clone();
                ca.spawn_renewal(move || {
                    weak.upgrade().map(|p| p.wanted_identities(&node)).unwrap_or_default()
                });
            }
            // Without an agent, ready once the `--pod`s are served (in xDS mode, after istiod's
            // first responses).
            let standalone = cli.zds_socket.is_none();
            if synced.is_some() {
                let p = proxy.clone();
                tokio::spawn(async move {
                    match add_pods().await {
                        Ok(()) if standalone => p.set_ready(true),
                        Ok(()) => {}
                        Err(e) => {
                            tracing::error!(error = %format!("{e:#}"), "a --pod could not be served")
                        }
                    }
                });
            } else {
                add_pods().await?;
                if standalone {
                    proxy.set_ready(true);
                }
            }
            reload::spawn(
                proxy.clone(),
                cli.workloads.clone(),
                stamp,
                Duration::from_millis(cli.refresh_ms.max(10)),
            );
            if let Some(path) = &cli.zds_socket {
                // Ready once the agent's first snapshot is applied.
                inpod::zds::spawn(proxy.clone(), path.clone());
            }
            writeln!(out, "READY")?;
            out.flush()?;
            drop(out);
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            let signalled = tokio::select! {
                _ = term.recv() => true,
                r = tokio::signal::ctrl_c() => r.map(|()| true)?,
                () = proxy.drain.stopping() => false,
            };
            // Serving still: an agent that restarts holds nothing of this proxy's yet.
            let waited = if !signalled || proxy.pods().is_empty() {
                Duration::ZERO
            } else {
                proxy.handover.wait_for_agent(meshpath_proxy::proxy::handover::AGENT_WAIT).await
            };
            let deadline = Duration::from_secs(cli.drain_seconds)
                .saturating_sub(waited)
                .max(Duration::from_secs(cli.drain_seconds.min(5)));
            let handing_over = proxy.handover.begin();
            tracing::info!(
                deadline_s = deadline.as_secs(),
                handing_over,
                "draining: no new connections, waiting for open ones"
            );
            let left = proxy.drain.shutdown(deadline).await;
            if left > 0 {
                tracing::warn!(left, "drain deadline reached; closing the remaining connections");
            }
            Ok(())
        })
}
