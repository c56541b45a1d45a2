//! A meshed pod's interfaces that appear after it joined (Multus adds a secondary network's
//! after the pod's main network's chain, where meshpath-cni runs; an interface can be added by
//! hand at any time) get the guard (`raw_tcp_guard.rs`) as they appear: each pod's netns is
//! watched for new links (an rtnetlink socket of its own, bound to `RTMGRP_LINK`) for as long
//! as the pod is in the mesh, and every announcement puts the guard on the interfaces without
//! it. The subscription comes first, then the look that guards what is there (a new pod's
//! enrolment, or the first look at a pod found at start-up, whose interfaces may have changed
//! while no agent ran): no interface falls between the two, and a new pod's join (the CNI
//! ADD) does no look of its own.
//!
//! One socket and one task per meshed pod; announcements read in one go are one look. A frame
//! sent in the instant between a link's creation and its guard is not judged: Multus adds its
//! interfaces before the pod's containers start, so only an interface hot-added later has that
//! window (docs/datapath.md, "Known limits").

use std::{os::fd::OwnedFd, sync::Arc};

use tokio::io::unix::AsyncFd;
use tracing::{info, warn, Instrument as _};

use super::Agent;
use crate::{netns::Netns, pods};

/// Stops its pod's watch when dropped (the pod left the mesh, or the agent is stopping).
#[derive(Debug)]
pub struct Watch(tokio::task::AbortHandle);

impl Drop for Watch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The announcements of a pod's links, subscribed to: those made from now on wait in it until
/// a [`watch`] reads them.
#[derive(Debug)]
pub struct Events(AsyncFd<OwnedFd>);

/// Subscribes to the announcements of the links of `netns`.
pub fn subscribe(netns: &Netns) -> anyhow::Result<Events> {
    let events = netns.run(meshpath_podnet::rtnetlink::link_events)??;
    // SAFETY: `events` is an OwnedFd the AsyncFd owns: its descriptor stays open, and the
    // same, until the AsyncFd is dropped.
    let events = unsafe { AsyncFd::register_with_interest(events, tokio::io::Interest::READABLE) }
        .map_err(|e| e.into_parts().1)?;
    Ok(Events(events))
}

/// Watches the netns of pod `uid` through `events`, subscribed before the pod's interfaces
/// were last guarded (its enrolment, which guards every interface it has: nothing to look at
/// now), or not (`look_now`: a pod found at start-up, whose interfaces may have changed while
/// no agent ran, gets one look first).
pub fn watch(
    agent: &Arc<Agent>,
    uid: &str,
    netns: &Arc<Netns>,
    Events(events): Events,
    look_now: bool,
) -> anyhow::Result<Watch> {
    if look_now {
        guard(agent, uid, netns)?;
    }
    let (agent, uid, netns) = (agent.clone(), uid.to_owned(), netns.clone());
    let span = tracing::info_span!("interfaces", pod = %uid);
    let task = tokio::spawn(
        async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let announced = match read_all(&events, &mut buf).await {
                    Ok(a) => a,
                    Err(e) => {
                        warn!(error = %e, "reading the pod's link events; its new interfaces are no longer guarded");
                        return;
                    }
                };
                if announced {
                    let (agent, uid, netns) = (agent.clone(), uid.clone(), netns.clone());
                    let looked =
                        tokio::task::spawn_blocking(move || guard(&agent, &uid, &netns)).await;
                    match looked {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => warn!(error = %format!("{e:#}"), "guarding a new interface"),
                        Err(e) => warn!(error = %e, "guarding a new interface"),
                    }
                }
            }
        }
        .instrument(span),
    );
    Ok(Watch(task.abort_handle()))
}

/// Reads every datagram waiting on `events`; whether any announced a link. An overrun (the
/// kernel dropped announcements: ENOBUFS) counts as one.
async fn read_all(events: &AsyncFd<OwnedFd>, buf: &mut [u8]) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd as _;
    let mut ready = events.readable().await?;
    let mut announced = false;
    loop {
        // SAFETY: recv(2) into a buffer of the length given, on a descriptor we own.
        let n = unsafe {
            libc::recv(events.get_ref().as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0)
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) => {
                    ready.clear_ready();
                    return Ok(announced);
                }
                Some(libc::ENOBUFS) => announced = true,
                Some(libc::EINTR) => {}
                _ => return Err(e),
            }
            continue;
        }
        let n = usize::try_from(n).unwrap_or(0).min(buf.len());
        announced |= meshpath_podnet::rtnetlink::announces_a_link(&buf[..n]);
    }
}

/// One look: the guard on each of the pod's interfaces without it.
fn guard(agent: &Agent, uid: &str, netns: &Netns) -> anyhow::Result<()> {
    let guarded = agent.with_datapath(|dp| Ok(pods::guard_unguarded_interfaces(dp, netns)?))?;
    if !guarded.is_empty() {
        info!(pod = %uid, interfaces = ?guarded, "guard attached to interfaces the pod got after joining");
    }
    Ok(())
}
