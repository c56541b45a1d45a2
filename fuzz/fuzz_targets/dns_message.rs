//! DNS as the proxy's 15053 sees it: any bytes a pod sends. A query the store answers gets a
//! reply that encodes and decodes again, with the query's id and question; resolv.conf text
//! gives port-53 upstreams only.
#![no_main]

use std::sync::LazyLock;

use hickory_proto::{
    op::{Message, MessageType},
    serialize::binary::BinDecodable as _,
};
use libfuzzer_sys::fuzz_target;
use meshpath_proxy::{proxy::dns, state::store::WorkloadStore};

static STORE: LazyLock<WorkloadStore> = LazyLock::new(|| {
    WorkloadStore::parse(
        "services:\n\
         - {name: web, namespace: prod, hostname: web.prod.svc.cluster.local, vips: [\"/10.96.0.10\", \"fd00::10\"], ports: {80: 8080}}\n\
         - {name: db, namespace: prod, hostname: db.prod.svc.cluster.local, vips: [10.96.0.11], ports: {5432: 5432}}\n",
    )
    .expect("the fuzz store parses")
});

fuzz_target!(|data: &[u8]| {
    if let Ok(query) = Message::from_bytes(data) {
        if query.message_type() == MessageType::Query {
            if let Some(reply) = dns::from_store(&STORE, &query) {
                let bytes = reply.to_vec().expect("a reply built from a parsed query encodes");
                let back = Message::from_bytes(&bytes).expect("and decodes");
                assert_eq!(back.id(), query.id());
                assert_eq!(back.queries(), query.queries());
                assert!(back.answers().len() <= 2, "more answers than the service has VIPs");
            }
        }
    }
    if let Ok(text) = std::str::from_utf8(data) {
        assert!(dns::resolv_conf_upstreams(text).iter().all(|a| a.port() == 53));
    }
});
