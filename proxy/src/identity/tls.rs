//! TLS as HBONE uses it: TLS 1.3, ALPN `h2`, both sides authenticated. The client accepts the
//! server only if its chain verifies to the roots *and* a URI SAN equals one of the identities
//! expected for the destination (DNS names are ignored, no SNI is sent). The server requires a
//! client certificate that verifies to the roots; which identities may connect is policy's job.

use std::sync::Arc;

use rustls::{
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{CryptoProvider, WebPkiSupportedAlgorithms},
    pki_types::{CertificateDer, ServerName, TrustAnchor, UnixTime},
    server::WebPkiClientVerifier,
    ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme,
};

use crate::identity::{Identity, WorkloadCert};

/// ALPN protocol of HBONE.
pub const ALPN_H2: &[u8] = b"h2";

/// One crypto provider for every configuration: ring's, with AES-128-GCM offered first (ring's
/// default order puts AES-256-GCM first). All three TLS 1.3 suites stay offered and accepted,
/// so any peer (ztunnel included) still agrees on one; between meshpath proxies each record
/// costs AES-128's 10 rounds instead of 14.
fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: std::sync::OnceLock<Arc<CryptoProvider>> = std::sync::OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            use rustls::crypto::ring::cipher_suite::{
                TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
            };
            let mut p = rustls::crypto::ring::default_provider();
            p.cipher_suites = vec![
                TLS13_AES_128_GCM_SHA256,
                TLS13_AES_256_GCM_SHA384,
                TLS13_CHACHA20_POLY1305_SHA256,
            ];
            Arc::new(p)
        })
        .clone()
}

/// The identity of a peer's certificate: its one URI SAN, a SPIFFE id. A certificate with no
/// URI SAN, several, or one that is not a SPIFFE id names no identity (ztunnel's rule), so one
/// certificate can never stand for two workloads. Inbound (client certificates) and outbound
/// (server certificates) both check with this.
pub fn peer_identity(cert: &CertificateDer<'_>) -> Result<Identity, String> {
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(cert) else {
        return Err("the certificate does not parse".into());
    };
    let uris: Vec<&str> = match parsed.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                x509_parser::extensions::GeneralName::URI(u) => Some(*u),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    match uris.as_slice() {
        [one] => Identity::parse(one).map_err(|e| format!("URI SAN {one}: {e}")),
        [] => Err("no URI SAN".into()),
        many => Err(format!("{} URI SANs, exactly one is allowed: {many:?}", many.len())),
    }
}

/// The URI SANs that are SPIFFE identities in a DER certificate.
pub fn spiffe_ids(cert: &CertificateDer<'_>) -> Vec<Identity> {
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(cert) else {
        return Vec::new();
    };
    let Ok(Some(san)) = parsed.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) => Identity::parse(u).ok(),
            _ => None,
        })
        .collect()
}

/// Server side of HBONE for one workload: its certificate, client certificates required.
pub fn server_config(
    cert: &WorkloadCert,
    roots: &[CertificateDer<'static>],
) -> anyhow::Result<Arc<ServerConfig>> {
    let mut store = RootCertStore::empty();
    for r in roots {
        store.add(r.clone())?;
    }
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(store), provider()).build()?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(cert.chain.clone(), cert.key.clone_key())?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(config))
}

/// Client side of HBONE from one workload to a destination expected to be one of `expected`.
pub fn client_config(
    cert: &WorkloadCert,
    roots: &[CertificateDer<'static>],
    expected: Vec<Identity>,
) -> anyhow::Result<Arc<ClientConfig>> {
    let anchors = roots
        .iter()
        .map(|r| webpki::anchor_from_trusted_cert(r).map(|a| a.to_owned()))
        .collect::<Result<Vec<_>, _>>()?;
    let provider = provider();
    let verifier = Arc::new(SpiffeServerVerifier {
        anchors,
        expected,
        algs: provider.signature_verification_algorithms,
    });
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(cert.chain.clone(), cert.key.clone_key())?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    config.enable_sni = false;
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

/// Verifies the server's chain to the roots, then its SPIFFE identity.
#[derive(Debug)]
struct SpiffeServerVerifier {
    anchors: Vec<TrustAnchor<'static>>,
    expected: Vec<Identity>,
    algs: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ee = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|e| rustls::Error::General(format!("server certificate: {e}")))?;
        ee.verify_for_usage(
            self.algs.all,
            &self.anchors,
            intermediates,
            now,
            webpki::KeyUsage::server_auth(),
            None,
            None,
        )
        .map_err(|e| rustls::Error::InvalidCertificate(webpki_error(e)))?;
        let wrong = |why: String| {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::Other(
                rustls::OtherError(Arc::new(WrongIdentity(why))),
            )))
        };
        match peer_identity(end_entity) {
            Ok(id) if self.expected.contains(&id) => Ok(ServerCertVerified::assertion()),
            Ok(id) => {
                let want: Vec<String> = self.expected.iter().map(ToString::to_string).collect();
                wrong(format!("server is {id}, expected one of {want:?}"))
            }
            Err(why) => wrong(format!("server certificate names no identity: {why}")),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

/// The server's certificate verified but names another workload.
#[derive(Debug)]
struct WrongIdentity(String);

impl std::fmt::Display for WrongIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WrongIdentity {}

fn webpki_error(e: webpki::Error) -> rustls::CertificateError {
    use rustls::CertificateError as C;
    match e {
        webpki::Error::CertExpired { .. } => C::Expired,
        webpki::Error::CertNotValidYet { .. } => C::NotValidYet,
        webpki::Error::UnknownIssuer => C::UnknownIssuer,
        webpki::Error::InvalidSignatureForPublicKey => C::BadSignature,
        other => C::Other(rustls::OtherError(Arc::new(other))),
    }
}

#[cfg(test)]
mod tests {
    use std::{process::Command, time::Duration};

    use rustls::{ClientConnection, ServerConnection};

    use super::*;
    use crate::identity::LocalCa;

    /// Drives a client and a server connection to the end of the handshake in memory.
    fn handshake(
        client: Arc<ClientConfig>,
        server: Arc<ServerConfig>,
    ) -> Result<rustls::CipherSuite, rustls::Error> {
        let name = ServerName::IpAddress(std::net::Ipv4Addr::new(10, 0, 0, 2).into());
        let mut c = ClientConnection::new(client, name)?;
        let mut s = ServerConnection::new(server)?;
        for _ in 0..10 {
            let mut buf = Vec::new();
            c.write_tls(&mut buf).map_err(|e| rustls::Error::General(e.to_string()))?;
            s.read_tls(&mut buf.as_slice()).map_err(|e| rustls::Error::General(e.to_string()))?;
            s.process_new_packets()?;
            let mut buf = Vec::new();
            s.write_tls(&mut buf).map_err(|e| rustls::Error::General(e.to_string()))?;
            c.read_tls(&mut buf.as_slice()).map_err(|e| rustls::Error::General(e.to_string()))?;
            c.process_new_packets()?;
            if !c.is_handshaking() && !s.is_handshaking() {
                let suite = c.negotiated_cipher_suite().map(|s| s.suite());
                return suite.ok_or_else(|| rustls::Error::General("no cipher suite".into()));
            }
        }
        Err(rustls::Error::General("handshake did not finish".into()))
    }

    #[test]
    fn a_ca_with_an_rsa_key_made_by_openssl_issues_certificates_both_sides_accept() {
        let dir = std::env::temp_dir().join(format!("meshpath-rsa-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (key, cert) = (dir.join("ca-key.pem"), dir.join("ca.pem"));
        let ok = Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/O=rsa test CA",
            ])
            .args([
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("openssl");
        assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
        let read = |p: &std::path::Path| std::fs::read_to_string(p).expect("read");
        let ca = LocalCa::from_pem(&read(&cert), &read(&key)).expect("RSA CA");
        let _ = std::fs::remove_dir_all(&dir);
        let (a, b) = (Identity::new("td", "ns", "a"), Identity::new("td", "ns", "b"));
        let ca_a = ca.issue(&a, Duration::from_secs(60)).expect("a");
        let ca_b = ca.issue(&b, Duration::from_secs(60)).expect("b");
        let roots = [ca.cert_der.clone()];
        let server = server_config(&ca_b, &roots).expect("server");
        handshake(client_config(&ca_a, &roots, vec![b.clone()]).expect("client"), server.clone())
            .expect("handshake with the expected identity");
        // And the identity check still bites.
        let wrong = handshake(client_config(&ca_a, &roots, vec![a]).expect("client"), server);
        assert!(wrong.is_err(), "a server with another identity was accepted");
    }

    #[test]
    fn proxies_agree_on_aes_128_gcm_and_still_offer_the_other_tls13_suites() {
        let ca = LocalCa::generate("test CA").expect("CA");
        let roots = [ca.cert_der.clone()];
        let (a, b) = (Identity::new("td", "ns", "a"), Identity::new("td", "ns", "b"));
        let ca_a = ca.issue(&a, Duration::from_secs(60)).expect("a");
        let ca_b = ca.issue(&b, Duration::from_secs(60)).expect("b");
        let server = server_config(&ca_b, &roots).expect("server");
        let client = client_config(&ca_a, &roots, vec![b]).expect("client");
        assert_eq!(handshake(client, server), Ok(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256));
        let offered: Vec<_> = provider().cipher_suites.iter().map(|s| s.suite()).collect();
        for suite in [
            rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
            rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256,
        ] {
            assert!(offered.contains(&suite), "{suite:?} is no longer offered");
        }
    }

    fn uris_cert(ca: &LocalCa, uris: &[&str]) -> crate::identity::WorkloadCert {
        let now = time::OffsetDateTime::now_utc();
        let uris: Vec<String> = uris.iter().map(|u| (*u).to_owned()).collect();
        ca.issue_with_uris(&uris, now - time::Duration::minutes(1), now + time::Duration::hours(1))
            .expect("cert")
    }

    #[test]
    fn a_peer_certificate_names_an_identity_only_with_exactly_one_spiffe_uri() {
        let ca = LocalCa::generate("test CA").expect("CA");
        let (b, c) = ("spiffe://td/ns/ns/sa/b", "spiffe://td/ns/ns/sa/c");
        let leaf = |uris: &[&str]| uris_cert(&ca, uris).chain[0].clone();
        assert_eq!(peer_identity(&leaf(&[b])), Ok(Identity::parse(b).expect("id")));
        for uris in [&[b, c][..], &[], &[b, "https://example.invalid/x"], &["spiffe://td/ns/x"]] {
            assert!(peer_identity(&leaf(uris)).is_err(), "{uris:?} named an identity");
        }
    }

    #[test]
    fn a_server_certificate_with_two_identities_is_refused_even_if_one_is_expected() {
        let ca = LocalCa::generate("test CA").expect("CA");
        let roots = [ca.cert_der.clone()];
        let a = ca.issue(&Identity::new("td", "ns", "a"), Duration::from_secs(60)).expect("a");
        let two = uris_cert(&ca, &["spiffe://td/ns/ns/sa/b", "spiffe://td/ns/ns/sa/c"]);
        let server = server_config(&two, &roots).expect("server");
        let b = Identity::new("td", "ns", "b");
        let client = client_config(&a, &roots, vec![b]).expect("client");
        assert!(handshake(client, server).is_err(), "a two-identity server was accepted");
    }
}
