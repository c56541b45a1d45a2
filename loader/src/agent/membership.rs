//! A pod joins or leaves the mesh, whoever asks (a CNI ADD or DEL, or the Kubernetes reconcile
//! loop): its record first (so a crash leaves a trace that start-up finds), the datapath, the
//! node proxy over ZDS (joining waits for its ack), then the pod's redirection annotation. If
//! any step of joining fails, the earlier ones are undone: nothing half-done.

use std::{path::PathBuf, sync::Arc};

use tracing::{info, warn};

use super::{
    directory::Member,
    records::{self, PodRecord},
    Agent, LivePod,
};
use crate::{
    netns::Netns,
    pods::{self, EnrolOptions},
};

/// Where a joining pod's network namespace came from.
#[derive(Debug)]
pub struct Sandbox {
    pub netns: Netns,
    pub netns_path: PathBuf,
    /// The runtime's container id (empty when the pod was found on the node, not added by CNI).
    pub container_id: String,
}

/// Adds `member` to the mesh in `sandbox`.
pub async fn join(agent: &Arc<Agent>, member: &Member, sandbox: Sandbox) -> anyhow::Result<()> {
    let Sandbox { netns, netns_path, container_id } = sandbox;
    let record = PodRecord {
        uid: member.uid.clone(),
        name: member.name.clone(),
        namespace: member.namespace.clone(),
        service_account: member.service_account.clone(),
        container_id,
        netns_path,
        netns_inode: netns.inode(),
        cookie: netns.cookie(),
        ips: member.ips.clone(),
    };
    let state = &agent.cfg.state_dir;
    records::save(state, &record)?;
    let o = &member.options;
    let opts = EnrolOptions {
        name: Some(format!("{}/{}", member.namespace, member.name)),
        capture_outbound: true,
        capture_inbound: o.capture_inbound,
        capture_dns: o.capture_dns,
        probe_bypass: true,
        counters: false,
        pod_ips: member.ips.clone(),
        exclude_outbound_ports: o.exclude_outbound_ports.clone(),
        exclude_inbound_ports: o.exclude_inbound_ports.clone(),
        exclude_outbound_cidrs: o.exclude_outbound_cidrs.clone(),
        exclude_inbound_cidrs: o.exclude_inbound_cidrs.clone(),
        ..EnrolOptions::default()
    };
    // Before enrolment, which guards every interface the pod has: one added from now on is
    // announced to the watch.
    let events = match super::interfaces::subscribe(&netns) {
        Ok(e) => e,
        Err(e) => {
            records::delete(state, &record.uid)?;
            return Err(e.context("subscribing to the pod's link announcements"));
        }
    };
    if let Err(e) = agent.with_datapath(|dp| Ok(pods::enrol(dp, &netns, &opts)?)) {
        records::delete(state, &record.uid)?;
        return Err(e.context("enrolling the pod in the datapath"));
    }
    let netns = Arc::new(netns);
    let interfaces = match super::interfaces::watch(agent, &record.uid, &netns, events, false) {
        Ok(w) => w,
        Err(e) => {
            agent.with_datapath(|dp| Ok(pods::unenrol_netns(dp, &netns)?))?;
            records::delete(state, &record.uid)?;
            return Err(e.context("watching the pod's interfaces"));
        }
    };
    let pod = LivePod { record, netns, interfaces: Some(interfaces) };
    if let Err(e) = agent.zds.add(&pod).await {
        agent.with_datapath(|dp| Ok(pods::unenrol_netns(dp, &pod.netns)?))?;
        records::delete(state, &pod.record.uid)?;
        anyhow::bail!("the node proxy did not take the pod: {e}");
    }
    info!(pod = %pod.record.uid, cookie = pod.record.cookie, "pod added to the mesh");
    let (ns, name) = (pod.record.namespace.clone(), pod.record.name.clone());
    agent
        .pods
        .lock()
        .map_err(|_| anyhow::anyhow!("pods lock"))?
        .insert(pod.record.uid.clone(), pod);
    agent.directory.set_redirected(&ns, &name, true).await;
    Ok(())
}

/// Takes the pod out: proxy first (best effort: a proxy not connected gets the next snapshot
/// without it), then the datapath, the record, and the annotation (if the pod still exists).
pub async fn leave(agent: &Arc<Agent>, uid: &str) -> anyhow::Result<()> {
    if let Err(e) = agent.zds.del(uid).await {
        warn!(pod = %uid, error = %e, "the proxy was not told of the removal");
    }
    let pod = agent.pods.lock().map_err(|_| anyhow::anyhow!("pods lock"))?.remove(uid);
    if let Some(p) = &pod {
        // Through the netns: below 6.6 the egress guard is a netlink filter only the netns can
        // take off.
        agent.with_datapath(|dp| match pods::unenrol_netns(dp, &p.netns) {
            Ok(()) | Err(crate::Error::NotEnrolled { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        })?;
    }
    records::delete(&agent.cfg.state_dir, uid)?;
    info!(pod = %uid, "pod removed from the mesh");
    if let Some(p) = pod {
        agent.directory.set_redirected(&p.record.namespace, &p.record.name, false).await;
    }
    Ok(())
}
