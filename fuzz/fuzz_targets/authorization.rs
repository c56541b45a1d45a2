//! Authorization policies from the workloads file, evaluated for any connection. Properties:
//! the store's index gives each workload exactly the policies `Policy::selects` picks, in file
//! order; dry-run policies never change what is enforced; a verdict only exists for dry-run
//! policies when one applies; and a policy set written in ztunnel's serialisation and read back
//! decides every connection the same way.
#![no_main]

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use libfuzzer_sys::fuzz_target;
use meshpath_proxy::{
    identity::Identity,
    state::authorization::{decide, Connection, Policy},
    state::{store::WorkloadStore, workloads::Workload},
};

const WORKLOADS: &str = "workloads:\n\
- {uid: b, namespace: prod, serviceAccount: b, authorizationPolicies: [prod/p, other/q]}\n\
- {uid: d, namespace: other, serviceAccount: d}\n";

/// The policies `Policy::selects` picks for `w`, in file order.
fn selected<'p>(policies: impl IntoIterator<Item = &'p Policy>, w: &Workload) -> Vec<&'p Policy> {
    policies.into_iter().filter(|p| p.selects(w)).collect()
}

fuzz_target!(|data: &[u8]| {
    // 36 bytes of connection, the rest policies.
    let Some((conn, text)) = data.split_at_checked(36) else { return };
    let Ok(text) = std::str::from_utf8(text) else { return };
    let Ok(store) = WorkloadStore::parse(&format!("{WORKLOADS}policies:\n{text}")) else { return };
    let ip = |b: &[u8]| -> IpAddr {
        let a: [u8; 16] = b.try_into().expect("16 bytes");
        let v6 = Ipv6Addr::from(a);
        v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
    };
    let port = u16::from_be_bytes([conn[32], conn[33]]);
    let names = ["dev", "prod", "other", ""];
    let who = conn[34];
    let id = (who & 4 != 0).then(|| {
        Identity::new(
            "cluster.local",
            names[usize::from(who & 3)],
            names[usize::from(who >> 4 & 3)],
        )
    });
    let c = Connection {
        src_identity: id.as_ref(),
        src: ip(&conn[..16]),
        dst: SocketAddr::new(ip(&conn[16..32]), port),
    };
    let enforced_only: Vec<Policy> =
        store.policies().iter().filter(|p| !p.dry_run).map(|p| (**p).clone()).collect();
    let json = serde_json::to_string(store.policies()).expect("policies serialise");
    let again: Vec<Policy> = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{json}: {e}"));
    for w in store.workloads() {
        let applicable = store.policies_for(w);
        let by_rule = selected(store.policies().iter().map(|p| &**p), w);
        assert!(
            applicable.len() == by_rule.len()
                && applicable.iter().zip(&by_rule).all(|(a, b)| std::ptr::eq(*a, *b)),
            "the index gave {} other than the {} policies `selects` picks",
            applicable.len(),
            by_rule.len()
        );
        let d = decide(&applicable, &c);
        assert_eq!(
            d.enforced,
            decide(&selected(&enforced_only, w), &c).enforced,
            "a dry-run policy was enforced"
        );
        let dry_applies = store.policies().iter().any(|p| p.dry_run && p.selects(w));
        assert_eq!(d.dry_run.is_some(), dry_applies);
        assert_eq!(
            decide(&selected(&again, w), &c),
            d,
            "ztunnel's serialisation decides differently: {json}"
        );
    }
});
