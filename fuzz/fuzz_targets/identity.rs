//! Identities from a peer: SPIFFE ids (a parsed one prints as it parses), the `forwarded`
//! header's `for=` (an address it yields, written back, parses to itself) and a peer
//! certificate's URI SANs (any DER: an error or exactly one identity, never a panic).
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshpath_proxy::{identity::tls, identity::Identity, proxy::inbound::parse_forwarded_for};
use rustls_pki_types::CertificateDer;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(id) = Identity::parse(text) {
            assert_eq!(Identity::parse(&id.to_string()).ok(), Some(id));
        }
        if let Some(addr) = parse_forwarded_for(text) {
            assert_eq!(parse_forwarded_for(&format!("for=\"{addr}\"")), Some(addr));
        }
    }
    let cert = CertificateDer::from(data);
    if let Ok(id) = tls::peer_identity(&cert) {
        assert!(tls::spiffe_ids(&cert).contains(&id));
    }
});
