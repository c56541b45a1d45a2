//! meshpath's HBONE node proxy, as a library: identities and certificates (`identity`), TLS
//! with SPIFFE verification (`tls`), the HBONE protocol (`hbone`), the workload store (`config`),
//! and the two data paths, `outbound` (captured app traffic → HBONE or passthrough) and
//! `inbound` (HBONE on 15008 → the app). `meshpath-proxy` is a thin CLI over it.
//!
//! Built so far: the outbound and inbound HBONE paths with connection pooling (`pool`), inbound
//! plaintext (15006) and graceful shutdown (`drain`), for pods given on the command line. Not
//! yet: DNS, idle release, policy, metrics and admin, certificate rotation, ZDS (see the proxy
//! issue).

pub mod config;
pub mod drain;
pub mod hbone;
pub mod identity;
pub mod inbound;
pub mod inbound_plaintext;
pub mod netns;
pub mod outbound;
pub mod pool;
pub mod tls;
