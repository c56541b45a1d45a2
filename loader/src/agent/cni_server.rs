//! The CNI plugin's requests, one JSON line each way over a unix stream socket (types in
//! `meshpath_cni::agent`).
//!
//! ADD: a pod the directory marks meshed is recorded (before anything else, so a crash leaves a
//! trace reconcile finds), enrolled in the datapath (outbound, inbound and DNS capture, probe
//! bypass), and sent to the proxy; the answer waits for the proxy's ack. If any step fails the
//! earlier ones are undone and the error returned: nothing half-done. A repeated ADD for the
//! same sandbox is answered from what is there. DEL tells the proxy, unenrols and forgets; it
//! succeeds for a pod that is unknown or already gone. CHECK verifies the pod is enrolled and
//! its netns alive.

use std::{path::Path, sync::Arc};

use meshpath_cni::agent::{Command, Request, Response};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader},
    net::{UnixListener, UnixStream},
};
use tracing::{info, warn};

use super::{
    directory,
    records::{self, PodRecord},
    Agent, LivePod,
};
use crate::{
    netns::Netns,
    pods::{self, EnrolOptions},
};

/// Listens at `path` (a stale socket file is replaced; owner-only access).
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
        _ => {}
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    Ok(l)
}

/// Serves the plugin's requests, each on its own task.
pub fn spawn(agent: Arc<Agent>, listener: UnixListener) {
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((conn, _)) => {
                    let agent = agent.clone();
                    tokio::spawn(async move {
                        if let Err(e) = serve(&agent, conn).await {
                            warn!(error = %format!("{e:#}"), "CNI request failed to complete");
                        }
                    });
                }
                Err(e) => {
                    warn!(error = %e, "CNI accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
}

async fn serve(agent: &Arc<Agent>, conn: UnixStream) -> anyhow::Result<()> {
    let (r, mut w) = conn.into_split();
    let mut line = String::new();
    BufReader::new(r).read_line(&mut line).await?;
    let resp = match serde_json::from_str::<Request>(&line) {
        Ok(req) => {
            let cmd = req.command;
            let (pod, ns) = (req.pod_name.clone(), req.pod_namespace.clone());
            match handle(agent, req).await {
                Ok(enrolled) => Response { error: String::new(), enrolled },
                Err(e) => {
                    let error = format!("{e:#}");
                    warn!(?cmd, pod = %format!("{ns}/{pod}"), %error, "CNI request refused");
                    Response { error, enrolled: false }
                }
            }
        }
        Err(e) => Response { error: format!("malformed request: {e}"), enrolled: false },
    };
    let mut out = serde_json::to_string(&resp)?;
    out.push('\n');
    w.write_all(out.as_bytes()).await?;
    Ok(())
}

async fn handle(agent: &Arc<Agent>, req: Request) -> anyhow::Result<bool> {
    let _one_at_a_time = agent.cni_lock.lock().await;
    match req.command {
        Command::Add => add(agent, req).await,
        Command::Del => del(agent, &req).await.map(|()| false),
        Command::Check => check(agent, &req).map(|()| true),
    }
}

fn find(agent: &Agent, req: &Request) -> Option<String> {
    let pods = agent.pods.lock().ok()?;
    pods.values()
        .find(|p| {
            p.record.container_id == req.container_id
                || (!req.pod_uid.is_empty() && p.record.uid == req.pod_uid)
        })
        .map(|p| p.record.uid.clone())
}

async fn add(agent: &Arc<Agent>, req: Request) -> anyhow::Result<bool> {
    let Some(entry) =
        directory::lookup(&agent.cfg.workloads, &req.pod_uid, &req.pod_namespace, &req.pod_name)?
    else {
        info!(pod = %format!("{}/{}", req.pod_namespace, req.pod_name), "not in the mesh: left alone");
        return Ok(false);
    };
    if !entry.meshed() {
        return Ok(false);
    }
    let netns = Netns::open(Path::new(&req.netns))?;
    // A repeated ADD for the same sandbox: already done.
    if let Some(uid) = find(agent, &req) {
        let same = agent
            .pods
            .lock()
            .ok()
            .and_then(|p| p.get(&uid).map(|p| p.netns.inode() == netns.inode()));
        if same == Some(true) {
            return Ok(true);
        }
        // The same pod in a new sandbox: the old one goes first.
        remove(agent, &uid).await?;
    }
    let record = PodRecord {
        uid: entry.uid.clone(),
        name: entry.name.clone(),
        namespace: entry.namespace.clone(),
        service_account: entry.service_account.clone(),
        container_id: req.container_id.clone(),
        netns_path: req.netns.clone().into(),
        netns_inode: netns.inode(),
        cookie: netns.cookie(),
        ips: req.ips.clone(),
    };
    let state = &agent.cfg.state_dir;
    records::save(state, &record)?;
    let opts = EnrolOptions {
        name: Some(format!("{}/{}", entry.namespace, entry.name)),
        capture_outbound: true,
        capture_inbound: true,
        capture_dns: true,
        probe_bypass: true,
        counters: false,
        pod_ips: req.ips.clone(),
        ..EnrolOptions::default()
    };
    if let Err(e) = agent.with_datapath(|dp| Ok(pods::enrol(dp, &netns, &opts)?)) {
        records::delete(state, &record.uid)?;
        return Err(e.context("enrolling the pod in the datapath"));
    }
    let pod = LivePod { record, netns: Arc::new(netns) };
    if let Err(e) = agent.zds.add(&pod).await {
        let cookie = pod.record.cookie;
        agent.with_datapath(|dp| Ok(pods::unenrol(dp, cookie)?))?;
        records::delete(state, &pod.record.uid)?;
        anyhow::bail!("the node proxy did not take the pod: {e}");
    }
    info!(pod = %pod.record.uid, cookie = pod.record.cookie, "pod added to the mesh");
    agent
        .pods
        .lock()
        .map_err(|_| anyhow::anyhow!("pods lock"))?
        .insert(pod.record.uid.clone(), pod);
    Ok(true)
}

/// Takes the pod out: proxy first (best effort: a proxy not connected gets the next snapshot
/// without it), then the datapath, then the record.
async fn remove(agent: &Arc<Agent>, uid: &str) -> anyhow::Result<()> {
    if let Err(e) = agent.zds.del(uid).await {
        warn!(pod = %uid, error = %e, "the proxy was not told of the removal");
    }
    let pod = agent.pods.lock().map_err(|_| anyhow::anyhow!("pods lock"))?.remove(uid);
    if let Some(p) = pod {
        let cookie = p.record.cookie;
        agent.with_datapath(|dp| {
            if pods::is_enrolled(dp, cookie)? {
                pods::unenrol(dp, cookie)?;
            }
            Ok(())
        })?;
    }
    records::delete(&agent.cfg.state_dir, uid)?;
    info!(pod = %uid, "pod removed from the mesh");
    Ok(())
}

async fn del(agent: &Arc<Agent>, req: &Request) -> anyhow::Result<()> {
    match find(agent, req) {
        Some(uid) => remove(agent, &uid).await,
        None => Ok(()),
    }
}

fn check(agent: &Arc<Agent>, req: &Request) -> anyhow::Result<()> {
    let Some(uid) = find(agent, req) else {
        let entry = directory::lookup(
            &agent.cfg.workloads,
            &req.pod_uid,
            &req.pod_namespace,
            &req.pod_name,
        )?;
        anyhow::ensure!(
            !entry.is_some_and(|e| e.meshed()),
            "pod {}/{} should be in the mesh but is not",
            req.pod_namespace,
            req.pod_name
        );
        return Ok(());
    };
    let cookie = agent
        .pods
        .lock()
        .map_err(|_| anyhow::anyhow!("pods lock"))?
        .get(&uid)
        .map(|p| p.record.cookie)
        .ok_or_else(|| anyhow::anyhow!("pod {uid} vanished"))?;
    agent.with_datapath(|dp| {
        anyhow::ensure!(
            pods::is_enrolled(dp, cookie)?,
            "pod {uid} is not enrolled in the datapath"
        );
        anyhow::ensure!(pods::netns_alive(dp, cookie)?, "pod {uid}'s network namespace is gone");
        Ok(())
    })
}
