//! istiod's delta xDS responses, any bytes: decoded as a `DeltaDiscoveryResponse` of either
//! type, applied to what the proxy holds. Properties: no panic; the reply acknowledges the
//! response's nonce; a NACK names only resources of the response; what is held makes a store
//! whose every workload is found again by its uid; and applying the same response again
//! changes nothing more.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshpath_proxy::xds::Held;
use meshpath_xds::{discovery::DeltaDiscoveryResponse, ADDRESS_TYPE, AUTHORIZATION_TYPE};
use prost::Message as _;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else { return };
    let Ok(mut resp) = DeltaDiscoveryResponse::decode(rest) else { return };
    resp.type_url = if which & 1 == 0 { ADDRESS_TYPE } else { AUTHORIZATION_TYPE }.to_owned();
    // Mostly resources of the response's type, so their decoders are reached; sometimes as
    // sent (another type is refused).
    if which & 2 == 0 {
        for r in &mut resp.resources {
            if let Some(any) = &mut r.resource {
                any.type_url.clone_from(&resp.type_url);
            }
        }
    }
    let mut held = Held::default();
    let applied = held.apply(&resp);
    assert_eq!(applied.reply.response_nonce, resp.nonce);
    assert_eq!(applied.reply.type_url, resp.type_url);
    if let Some(e) = &applied.reply.error_detail {
        assert!(applied.refused > 0, "a NACK with nothing refused: {}", e.message);
    }
    let store = held.store();
    for w in store.workloads() {
        assert!(store.by_uid(&w.uid).is_some(), "workload {} not found by its uid", w.uid);
    }
    let counts = held.counts();
    let again = held.apply(&resp);
    assert_eq!(held.counts(), counts, "applying the same response twice changed what is held");
    assert_eq!(again.refused, applied.refused);
});
