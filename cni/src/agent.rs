//! What the CNI plugin asks the node agent, and what it answers: one JSON object per line over
//! the agent's unix stream socket. Both sides use these types; nothing else crosses.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// Where the agent listens by default.
pub const DEFAULT_SOCKET: &str = "/var/run/meshpath/cni.sock";

/// The CNI operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Command {
    Add,
    Del,
    Check,
}

/// One pod event, as the runtime described it to the plugin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Request {
    pub command: Command,
    pub container_id: String,
    /// The pod's netns path; empty on a repeated DEL.
    pub netns: String,
    pub pod_name: String,
    pub pod_namespace: String,
    /// `K8S_POD_UID` when the runtime passes it.
    pub pod_uid: String,
    /// The pod's addresses, from the main plugin's result.
    pub ips: Vec<IpAddr>,
}

/// The agent's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Response {
    /// Empty on success.
    pub error: String,
    /// For ADD: whether the pod was put in the mesh (false: not a meshed pod, left alone).
    pub enrolled: bool,
}
