//! `meshpath-proxy`: the HBONE node proxy. Serves the pods given with `--pod UID=NETNS`
//! (until the agent hands pods over ZDS): their outbound captured traffic (15001) and their
//! HBONE listener (15008), with workload certificates minted from a local CA.

use std::{io::Write as _, path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

use anyhow::{Context as _, Result};
use clap::Parser;
use meshpath_loader::netns::Netns;
use meshpath_proxy::{
    config::WorkloadStore,
    drain::Drain,
    identity::LocalCa,
    inbound::{self, Pod, Shared},
    inbound_plaintext, outbound,
    pool::Pool,
};

#[derive(Parser)]
#[command(name = "meshpath-proxy", version, about = "meshpath's HBONE node proxy")]
struct Cli {
    /// Workloads (ztunnel's local configuration format, YAML).
    #[arg(long)]
    workloads: PathBuf,
    /// CA certificate (PEM) workload certificates are minted from; also the trust root.
    #[arg(long)]
    ca_cert: PathBuf,
    /// CA key (PKCS#8 PEM, RSA or ECDSA).
    #[arg(long)]
    ca_key: PathBuf,
    /// A pod to serve: its workload uid and its netns path (repeatable).
    #[arg(long = "pod", value_name = "UID=NETNS")]
    pods: Vec<String>,
    /// Lifetime of minted workload certificates, in hours.
    #[arg(long, default_value_t = 24)]
    cert_hours: u64,
    /// On SIGTERM: how long open connections may take to finish, in seconds.
    #[arg(long, default_value_t = 30)]
    drain_seconds: u64,
    /// The datapath's pin root: when given, each pod's inbound plaintext listener (15006) is
    /// opened and registered there.
    #[arg(long)]
    pin_root: Option<PathBuf>,
}

/// `meshpath-proxy new-ca DIR`: writes a new CA (ca.pem, ca-key.pem) for tests and the demo.
fn new_ca(dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let (cert, key) = LocalCa::generate("meshpath local CA")?.to_pem();
    std::fs::write(dir.join("ca.pem"), cert)?;
    std::fs::write(dir.join("ca-key.pem"), key)?;
    println!("wrote {0}/ca.pem and {0}/ca-key.pem", dir.display());
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args: Vec<String> = std::env::args().collect();
    let res = match args.get(1).map(String::as_str) {
        Some("new-ca") => match args.get(2) {
            Some(dir) => new_ca(dir.as_ref()),
            None => Err(anyhow::anyhow!("usage: meshpath-proxy new-ca DIR")),
        },
        _ => run(Cli::parse()),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshpath-proxy: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let store = WorkloadStore::load(&cli.workloads)?;
    let read = |p: &PathBuf| {
        std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
    };
    let ca = LocalCa::from_pem(&read(&cli.ca_cert)?, &read(&cli.ca_key)?)?;
    let roots = vec![ca.cert_der.clone()];
    let shared = Arc::new(Shared { store, ca, roots, drain: Drain::new(), pool: Pool::new() });
    let mut pods = Vec::new();
    for spec in &cli.pods {
        let (uid, path) =
            spec.split_once('=').with_context(|| format!("--pod {spec}: expected UID=NETNS"))?;
        let workload = shared
            .store
            .by_uid(uid)
            .with_context(|| {
                format!("--pod {spec}: no workload with uid {uid} in {}", cli.workloads.display())
            })?
            .clone();
        let identity = workload.identity();
        let cert = shared.ca.issue(&identity, Duration::from_secs(cli.cert_hours * 3600))?;
        let netns = Netns::open(path.as_ref())?;
        let sockets = meshpath_proxy::netns::SocketFactory::new(&netns)
            .with_context(|| format!("entering the netns of pod {uid}"))?;
        pods.push(Arc::new(Pod {
            uid: uid.to_owned(),
            netns,
            sockets,
            workload,
            identity,
            cert,
            proxy: shared.clone(),
        }));
    }
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?.block_on(
        async {
            for pod in &pods {
                outbound::start(pod.clone())?;
                inbound::start(pod.clone())?;
                if let Some(root) = &cli.pin_root {
                    inbound_plaintext::start(pod.clone(), root)?;
                }
                tracing::info!(pod = %pod.uid, identity = %pod.identity, "serving");
            }
            let mut out = std::io::stdout().lock();
            writeln!(out, "READY")?;
            out.flush()?;
            drop(out);
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                _ = term.recv() => {}
                r = tokio::signal::ctrl_c() => r?,
            }
            tracing::info!(
                deadline_s = cli.drain_seconds,
                "draining: no new connections, waiting for open ones"
            );
            let left = shared.drain.shutdown(Duration::from_secs(cli.drain_seconds)).await;
            if left > 0 {
                tracing::warn!(left, "drain deadline reached; closing the remaining connections");
            }
            Ok(())
        },
    )
}
