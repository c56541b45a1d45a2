//! meshpath's HBONE node proxy, as a library. Laid out as ztunnel is:
//!
//! - `proxy/` — the traffic: `outbound` (a pod's captured connections on 15001 → HBONE or
//!   passthrough, services resolved), `inbound` (HBONE on 15008 → the pod's app),
//!   `inbound_plaintext` (15006 → the app), `dns` (15053), `transparent` (connecting to the app
//!   with the client's address), `hbone` (the protocol), `pool` (shared HTTP/2 connections),
//!   `copy` (moving the bytes: buffers, idle timeout), `drain` (accept loops, connection caps,
//!   graceful shutdown);
//! - `state/` — what the proxy knows: the node-wide state (`mod.rs`), the workload store
//!   (`workloads`), L4 policy (`authorization`), what is re-read while running (`reload`);
//! - `identity/` — SPIFFE identities and the local CA (`mod.rs`), where certificates come from
//!   (`certs`), istiod's CA (`ca_client`), mTLS with SPIFFE checks (`tls`);
//! - `xds/` — istiod's xDS stream (`mod.rs`), its resources made into the store's (`convert`),
//!   the gRPC channel to istiod (`channel`);
//! - `inpod/` — the pods served: add and remove (`mod.rs`), the ZDS session with the node agent
//!   (`zds`), sockets inside a pod's network namespace (`netns`);
//! - `admin` — 15000 / 15020 / 15021; `metrics` — telemetry.
//!
//! `meshpath-proxy` (src/main.rs) is a thin CLI over it.

pub mod admin;
pub mod identity;
pub mod inpod;
pub mod metrics;
pub mod proxy;
pub mod state;
pub mod xds;
