//! The traffic paths: a pod's outbound (15001, where it goes decided by `resolve`: services,
//! waypoints), inbound HBONE (15008) and plaintext (15006), DNS (15053), and what they share: the node proxy (`node`: the store, certificates, pool,
//! telemetry, the pods served) and its tunables (`settings`, with `memory` for the default
//! connection cap), a pod as the paths see it (`pod`, its sockets made inside its netns by
//! `netns`, its listeners held across restarts by the node agent: `held_listeners`), the HBONE protocol, the connection pool, the byte copy, accept loops with their
//! caps and draining, the per-source cap on unauthenticated inbound, the large reads under TLS,
//! the allowed connections a policy change re-checks, the open ones the admin dump lists
//! (`open_connections`), the plain connections handed to the next proxy at shutdown
//! (`handover`, watched cheaply by every copy loop: `stop`), and the HBONE streams paused and
//! resumed across a proxy upgrade (`resume`).

pub mod authorized;
pub mod copy;
pub mod dns;
pub mod drain;
pub mod handover;
pub mod hbone;
pub mod held_listeners;
pub mod inbound;
pub mod inbound_plaintext;
pub mod memory;
pub mod netns;
pub mod node;
pub mod node_local;
pub mod open_connections;
pub mod outbound;
pub mod per_source;
pub mod pod;
pub mod pool;
pub mod read_ahead;
pub mod resolve;
pub mod resume;
pub mod settings;
pub mod stop;
pub mod transparent;

pub use node::Proxy;
pub use settings::Settings;
