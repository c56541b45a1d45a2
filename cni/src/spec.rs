//! The CNI specification as this plugin needs it: its configuration (with the previous
//! plugin's result), the runtime's environment, and the error result.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// Versions this plugin speaks.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// CNI error codes (spec "Error" section).
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const INVALID_CONFIG: u32 = 4;
    pub const INVALID_ENV: u32 = 7;
    pub const IO_FAILURE: u32 = 5;
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// meshpath's own: the agent refused the pod.
    pub const AGENT_REFUSED: u32 = 100;
}

/// The plugin's network configuration (stdin).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetConf {
    pub cni_version: String,
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
    /// The main plugin's result (required for ADD and CHECK: this plugin is chained).
    #[serde(default)]
    pub prev_result: Option<serde_json::Value>,
    /// The agent's socket.
    #[serde(default)]
    pub agent_socket: Option<String>,
}

impl NetConf {
    /// The pod's addresses from `prevResult.ips[].address` (CIDR notation).
    pub fn pod_ips(&self) -> Result<Vec<IpAddr>, String> {
        let prev = self.prev_result.as_ref().ok_or(
            "prevResult is missing: meshpath-cni must be chained after the main network plugin",
        )?;
        let ips = prev.get("ips").and_then(|v| v.as_array()).ok_or("prevResult has no ips")?;
        ips.iter()
            .map(|ip| {
                let a = ip
                    .get("address")
                    .and_then(|a| a.as_str())
                    .ok_or("prevResult.ips[] has no address")?;
                let bare = a.split_once('/').map_or(a, |(ip, _)| ip);
                bare.parse::<IpAddr>()
                    .map_err(|_| format!("prevResult address {a:?} is not IP/LEN"))
            })
            .collect()
    }
}

/// `CNI_ARGS` (`K=V;K=V`) as pairs.
pub fn parse_args(args: &str) -> Result<Vec<(String, String)>, String> {
    args.split(';')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| format!("CNI_ARGS entry {kv:?} is not KEY=VALUE"))
        })
        .collect()
}

/// The error result the spec defines, printed on stdout with a non-zero exit.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ErrorResult {
    pub cni_version: String,
    pub code: u32,
    pub msg: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub details: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_addresses_come_from_the_previous_result() {
        let conf: NetConf = serde_json::from_str(
            r#"{"cniVersion":"1.0.0","name":"n","type":"meshpath-cni","prevResult":{"ips":[{"address":"10.1.0.5/24"},{"address":"fd00::5/64"}]}}"#,
        )
        .expect("config");
        assert_eq!(
            conf.pod_ips().expect("ips"),
            vec!["10.1.0.5".parse::<IpAddr>().expect("ip"), "fd00::5".parse().expect("ip")]
        );
    }

    #[test]
    fn a_missing_previous_result_is_named() {
        let conf: NetConf =
            serde_json::from_str(r#"{"cniVersion":"1.0.0","name":"n","type":"meshpath-cni"}"#)
                .expect("config");
        assert!(conf.pod_ips().expect_err("accepted").contains("prevResult is missing"));
    }

    #[test]
    fn cni_args_split_into_pairs() {
        let a =
            parse_args("IgnoreUnknown=1;K8S_POD_NAME=web-0;K8S_POD_NAMESPACE=prod").expect("args");
        assert_eq!(a[1], ("K8S_POD_NAME".into(), "web-0".into()));
        assert!(parse_args("K8S_POD_NAME").is_err());
    }
}
