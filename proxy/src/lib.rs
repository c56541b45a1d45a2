//! meshpath's HBONE node proxy, as a library. By file:
//!
//! - `state` — the node-wide state; `inpod` — the pods served (add, remove, certificates);
//! - `outbound` — a pod's captured connections (15001) → HBONE or passthrough, services resolved;
//! - `inbound` — HBONE (15008) → the pod's app; `inbound_plaintext` — 15006 → the app;
//!   `transparent` — connecting to the app with the client's address;
//! - `dns` — 15053; `admin` — 15000 / 15020 / 15021;
//! - `hbone` — the protocol; `copy` — moving the bytes (buffers, idle timeout); `tls` — mTLS with SPIFFE checks; `pool` — shared HTTP/2 connections;
//! - `identity`, `certs` — identities and where certificates come from;
//! - `config` — the workload store; `authorization` — L4 policy; `metrics` — telemetry;
//! - `reload` — what is re-read while running; `drain` — graceful shutdown;
//! - `netns` — sockets inside a pod's network namespace.
//!
//! `meshpath-proxy` (src/main.rs) is a thin CLI over it.

pub mod admin;
pub mod authorization;
pub mod certs;
pub mod config;
pub mod copy;
pub mod dns;
pub mod drain;
pub mod hbone;
pub mod identity;
pub mod inbound;
pub mod inbound_plaintext;
pub mod inpod;
pub mod metrics;
pub mod netns;
pub mod outbound;
pub mod pool;
pub mod reload;
pub mod state;
pub mod tls;
pub mod transparent;
