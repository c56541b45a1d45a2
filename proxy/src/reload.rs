//! What changes while the proxy runs, checked every refresh interval: the workload file, in the
//! offline mode (reloaded when it changes; a file that does not parse is reported with its line
//! and field and the previous store is kept), the trust bundle (files mode; istiod's from the
//! CA's answers), each pod's certificate (renewed at half its remaining life in local-CA mode;
//! taken from the CA client once it holds a newer one; re-read when its files change; its TLS
//! settings made again when the trust roots change; the earliest expiry exported), and idle
//! pooled connections (released).

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use tracing::{error, info};

use crate::{
    certs::{file_stamp, FileStamp},
    metrics::ErrorLabels,
    proxy::Proxy,
    state::store::WorkloadStore,
};

/// Runs the refresh loop until the process ends; `seen` is the workload file's stamp when the
/// store in force was read. Supervised: if an iteration panics, the loop is started again
/// (counted in `meshpath_refresh_restarts_total`), so certificates keep being renewed and
/// readiness keeps telling the truth.
pub fn spawn(
    proxy: Arc<Proxy>,
    workloads: Option<PathBuf>,
    seen: Option<FileStamp>,
    every: Duration,
) {
    tokio::spawn(async move {
        let mut seen = seen;
        loop {
            let run = tokio::spawn(refresh(proxy.clone(), workloads.clone(), seen, every));
            match run.await {
                Err(e) if e.is_panic() => {
                    error!(error = %e, "the refresh loop panicked; restarting it");
                    proxy.metrics.refresh_restarts.inc();
                    // Read the file again: the panic may have come before its reload finished.
                    seen = None;
                    tokio::time::sleep(every).await;
                }
                _ => return,
            }
        }
    });
}

async fn refresh(
    proxy: Arc<Proxy>,
    workloads: Option<PathBuf>,
    seen: Option<FileStamp>,
    every: Duration,
) {
    let mut seen = seen;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // In xDS mode there is no file: the store changes as istiod's responses arrive.
        if let Some(workloads) = &workloads {
            let now = file_stamp(workloads);
            if now != seen {
                seen = now;
                reload_store(&proxy, workloads);
            }
        }
        // New roots reach each pod's TLS settings through `refresh_cert`, which compares them
        // with those the settings were made with (so a rebuild that fails is tried again).
        if let Err(e) = proxy.certs.reload_roots() {
            error!(error = %e, "trust bundle not reloaded; keeping the previous one");
        }
        let pods = proxy.pods();
        for pod in &pods {
            if let Err(e) = pod.refresh_cert() {
                error!(pod = %pod.uid, error = %format!("{e:#}"), "certificate not renewed; keeping the current one");
            }
        }
        let earliest = pods.iter().filter_map(|p| p.cert()).map(|c| c.not_after).min();
        proxy.metrics.cert_earliest_expiry.set(earliest.map_or(0, |t| t.unix_timestamp()));
        let released = proxy.pool.release_idle(proxy.settings.pool_idle);
        if released > 0 {
            info!(released, "idle pooled connections released");
        }
    }
}

fn reload_store(proxy: &Proxy, path: &Path) {
    let result = |r: &str| ErrorLabels { direction: "-".into(), reason: r.into() };
    match WorkloadStore::load(path) {
        Ok(store) => {
            info!(
                workloads = store.counts().0,
                services = store.counts().1,
                policies = store.counts().2,
                "workload store reloaded"
            );
            proxy.set_store(store, true);
            proxy.metrics.config_reloads.get_or_create(&result("ok")).inc();
        }
        Err(e) => {
            error!(error = %e, "workload store not reloaded; keeping the previous one");
            proxy.metrics.config_reloads.get_or_create(&result("error")).inc();
        }
    }
}
