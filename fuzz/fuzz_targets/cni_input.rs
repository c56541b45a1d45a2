//! What a container runtime hands meshpath-cni: its configuration on stdin (JSON, with the
//! previous plugin's result), CNI_ARGS, and the request the plugin then sends the agent (which
//! the agent reads from its socket). Any input: an error, never a panic; a request round-trips.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshpath_cni::{agent::Request, spec};

fuzz_target!(|data: &[u8]| {
    if let Ok(conf) = serde_json::from_slice::<spec::NetConf>(data) {
        let _ = conf.pod_ips();
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(pairs) = spec::parse_args(text) {
            assert!(pairs.iter().all(|(k, v)| !k.contains(';') && !v.contains(';')));
        }
    }
    if let Ok(req) = serde_json::from_slice::<Request>(data) {
        let line = serde_json::to_string(&req).expect("serialises");
        assert_eq!(serde_json::from_str::<Request>(&line).ok(), Some(req));
    }
});
