//! meshpath's CNI plugin, `meshpath-cni`: a chained plugin (CNI spec 1.0.0) that runs after the
//! main network plugin and hands the pod to the node agent, returning only once the pod is
//! enrolled in the datapath and the node proxy has acknowledged it.
//!
//! - `spec`: the parts of the CNI specification the plugin reads and writes;
//! - `agent`: the one request/response exchanged with the agent over its unix socket (one JSON
//!   line each way), shared by both sides.

pub mod agent;
pub mod spec;
