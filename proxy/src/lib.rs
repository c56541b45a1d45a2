//! meshpath's HBONE node proxy, as a library. Laid out as ztunnel is, each group using only
//! those listed after it:
//!
//! - `admin` — 15000 / 15020 / 15021;
//! - `xds/` — istiod's xDS stream (`mod.rs`), its resources made into the store's (`convert`);
//!   `reload` — the offline mode's workloads file and the certificates re-read while running;
//! - `inpod/` — the pods served, their lifecycle: add and remove (`mod.rs`), the ZDS session
//!   with the node agent (`zds`);
//! - `proxy/` — the traffic: `outbound` (a pod's captured connections on 15001 → HBONE or
//!   passthrough, services resolved), `inbound` (HBONE on 15008 → the pod's app),
//!   `inbound_plaintext` (15006 → the app), `dns` (15053), `transparent` (connecting to the app
//!   with the client's address), `hbone` (the protocol), `pool` (shared HTTP/2 connections),
//!   `copy` (moving the bytes: buffers, idle timeout), `drain` (accept loops, connection caps,
//!   graceful shutdown), `held_listeners` (a pod's listeners that outlive the proxy: taken over
//!   from the node agent, given to it to hold); and what they share: `node` (the node proxy: store, certificates,
//!   pool, telemetry, the pods served), `pod` (one pod: its netns sockets, certificate, caps),
//!   `settings` and `memory` (tunables, the connection cap the memory limit holds);
//! - `certs/` — where certificates come from (`mod.rs`: istiod, a local CA or files) and
//!   istiod's CA client (`ca_client`); `istiod` — the gRPC channel to istiod (xDS and CA);
//! - `metrics` — telemetry;
//! - `state/` — what the proxy knows, as data: the workload store (`workloads`), L4 policy
//!   (`authorization`);
//! - `identity/` — SPIFFE identities, certificates and the local CA (`mod.rs`), mTLS with SPIFFE
//!   checks (`tls`).
//!
//! `meshpath-proxy` (src/main.rs) is a thin CLI over it.

pub mod admin;
pub mod certs;
pub mod identity;
pub mod inpod;
pub mod istiod;
pub mod metrics;
pub mod proxy;
pub mod reload;
pub mod state;
pub mod xds;
