//! The workloads file (ztunnel's local configuration format), any text: an error or a store
//! that, written back as YAML, reads back the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshpath_proxy::state::store::WorkloadStore;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(store) = WorkloadStore::parse(text) else { return };
    let yaml = serde_yaml::to_string(&store).expect("a store serialises");
    let again = WorkloadStore::parse(&yaml)
        .unwrap_or_else(|e| panic!("written back, it does not parse: {e}\n{yaml}"));
    let json = |s: &WorkloadStore| serde_json::to_value(s).expect("json");
    assert_eq!(json(&again), json(&store), "written back, it reads differently:\n{yaml}");
});
