//! The CNI plugin's requests, one JSON line each way over a unix stream socket (types in
//! `meshpath_cni::agent`).
//!
//! ADD: a pod the directory marks meshed joins the mesh (`membership`: record, datapath with
//! the capture its options say, proxy, annotation); the answer waits for the proxy's ack. If any
//! step fails the earlier ones are undone and the error returned: nothing half-done. A repeated ADD for the
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
    directory::{Decision, Member},
    membership::{self, Sandbox},
    Agent,
};
use crate::{netns::Netns, pods};

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
        Command::Check => check(agent, &req).await.map(|()| true),
    }
}

/// The pod whose sandbox a request names: by the sandbox's container id. A pod the reconcile
/// loop found (its container id unknown) is matched by uid only when the request names its
/// netns: the runtime's late DEL of a pod's old sandbox must not take out its new one.
fn find(agent: &Agent, req: &Request) -> Option<String> {
    let pods = agent.pods.lock().ok()?;
    let by_container = pods
        .values()
        .find(|p| !req.container_id.is_empty() && p.record.container_id == req.container_id);
    if let Some(p) = by_container {
        return Some(p.record.uid.clone());
    }
    let found = pods.get(&req.pod_uid).filter(|p| p.record.container_id.is_empty())?;
    let netns = Netns::open(Path::new(&req.netns)).ok()?;
    (netns.inode() == found.netns.inode()).then(|| found.record.uid.clone())
}

async fn add(agent: &Arc<Agent>, req: Request) -> anyhow::Result<bool> {
    let pod = format!("{}/{}", req.pod_namespace, req.pod_name);
    let member =
        match agent.directory.lookup(&req.pod_uid, &req.pod_namespace, &req.pod_name).await? {
            Decision::Meshed(m) => m,
            Decision::NotMeshed(why) => {
                info!(%pod, why, "not in the mesh: left alone");
                return Ok(false);
            }
            Decision::Invalid(why) => {
                // Left out rather than half in; the reconcile loop writes the Event.
                warn!(%pod, %why, "not added to the mesh");
                return Ok(false);
            }
        };
    let netns = Netns::open(Path::new(&req.netns))?;
    // A repeated ADD for the same sandbox, or a pod the reconcile loop found first: done. The
    // same pod (by uid) in another sandbox: the old one goes first.
    let known = find(agent, &req).or_else(|| {
        agent.pods.lock().ok().filter(|p| p.contains_key(&member.uid)).map(|_| member.uid.clone())
    });
    if let Some(uid) = known {
        let same = agent
            .pods
            .lock()
            .ok()
            .and_then(|p| p.get(&uid).map(|p| p.netns.inode() == netns.inode()));
        if same == Some(true) {
            return Ok(true);
        }
        // The same pod in a new sandbox: the old one goes first.
        membership::leave(agent, &uid).await?;
    }
    // The runtime's addresses (the API does not have them yet at ADD).
    let member = Member { ips: req.ips.clone(), ..member };
    let sandbox = Sandbox {
        netns,
        netns_path: req.netns.clone().into(),
        container_id: req.container_id.clone(),
    };
    membership::join(agent, &member, sandbox).await?;
    Ok(true)
}

async fn del(agent: &Arc<Agent>, req: &Request) -> anyhow::Result<()> {
    match find(agent, req) {
        Some(uid) => membership::leave(agent, &uid).await,
        None => Ok(()),
    }
}

async fn check(agent: &Arc<Agent>, req: &Request) -> anyhow::Result<()> {
    let Some(uid) = find(agent, req) else {
        let decision =
            agent.directory.lookup(&req.pod_uid, &req.pod_namespace, &req.pod_name).await?;
        anyhow::ensure!(
            !matches!(decision, Decision::Meshed(_)),
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
