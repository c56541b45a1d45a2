//! Inbound plaintext: TCP that the datapath steered to the pod's `[::]:15006` (sk_lookup, any
//! port but 15008) is forwarded to the app it was addressed to, connecting from inside the pod.
//! The listener is registered in the datapath's `INBOUND_LISTENERS`, as the datapath requires;
//! while no proxy has it registered, the pod refuses such connections (fail closed).

use std::{net::SocketAddr, path::Path, sync::Arc};

use anyhow::Context as _;
use datapath_common::consts::ports;
use meshpath_loader::datapath::Datapath;
use tokio::net::TcpStream;
use tracing::info;

use crate::{inbound::Pod, outbound::original_dst};

/// Opens the pod's 15006 listener, registers it with the datapath under `pin_root`, serves it.
pub fn start(pod: Arc<Pod>, pin_root: &Path) -> anyhow::Result<()> {
    let listener = pod.sockets.listen(SocketAddr::from(([0u16; 8], ports::INBOUND_PLAINTEXT)))?;
    Datapath::open_or_load(pin_root)?.register_inbound_listener(pod.netns.cookie(), &listener)?;
    let proxy = pod.proxy.clone();
    proxy.drain.serve(listener, pod, "inbound plaintext", |conn, peer, pod: Arc<Pod>| async move {
        handle(conn, peer, &pod).await.with_context(|| format!("pod {}", pod.uid))
    });
    Ok(())
}

async fn handle(mut conn: TcpStream, peer: SocketAddr, pod: &Pod) -> anyhow::Result<()> {
    // sk_lookup does not rewrite: the original destination is the accepted socket's address
    // (SO_ORIGINAL_DST, answered by the datapath, agrees).
    let dst = original_dst(&conn)?;
    conn.set_nodelay(true)?;
    let mut app = pod.sockets.socket(dst)?.connect(dst).await?;
    let (up, down) = tokio::io::copy_bidirectional(&mut conn, &mut app).await?;
    info!(pod = %pod.uid, src = %peer, %dst, up, down, "inbound plaintext connection closed");
    Ok(())
}
