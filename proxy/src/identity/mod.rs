//! SPIFFE identities (`spiffe://TD/ns/NS/sa/SA`), workload certificates, the local CA that
//! mints short-lived ones, and mTLS with SPIFFE checks (`tls`). Where a proxy gets its
//! certificates from is `crate::certs`.

pub mod tls;

use std::{fmt, time::Duration};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("not a SPIFFE identity of the form spiffe://TD/ns/NS/sa/SA: {0}")]
    Malformed(String),
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
}

/// A workload identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
}

impl Identity {
    pub fn new(td: &str, ns: &str, sa: &str) -> Self {
        Self { trust_domain: td.into(), namespace: ns.into(), service_account: sa.into() }
    }

    /// Parses `spiffe://TD/ns/NS/sa/SA`.
    pub fn parse(uri: &str) -> Result<Self, IdentityError> {
        let bad = || IdentityError::Malformed(uri.to_owned());
        let rest = uri.strip_prefix("spiffe://").ok_or_else(bad)?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            [td, "ns", ns, "sa", sa] if !td.is_empty() && !ns.is_empty() && !sa.is_empty() => {
                Ok(Self::new(td, ns, sa))
            }
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

/// A workload certificate and its key.
#[derive(Debug)]
pub struct WorkloadCert {
    /// Leaf first, then the CA.
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    /// When it became valid.
    pub not_before: time::OffsetDateTime,
    /// When it stops being valid.
    pub not_after: time::OffsetDateTime,
}

impl WorkloadCert {
    /// The chain and the key as PEM (`cert-chain.pem`, `key.pem` of the files mode).
    pub fn to_pem(&self) -> (String, String) {
        let chain: Vec<pem::Pem> =
            self.chain.iter().map(|c| pem::Pem::new("CERTIFICATE", c.to_vec())).collect();
        let key = pem::Pem::new("PRIVATE KEY", self.key.secret_der().to_vec());
        (pem::encode_many(&chain), pem::encode(&key))
    }

    /// The leaf's serial number, hex, for logs and the admin dump.
    pub fn serial(&self) -> String {
        self.chain
            .first()
            .and_then(|c| x509_parser::parse_x509_certificate(c).ok())
            .map(|(_, c)| c.raw_serial_as_string())
            .unwrap_or_default()
    }
}

/// A CA certificate and key, from which workload certificates are minted.
pub struct LocalCa {
    cert: rcgen::Certificate,
    key: KeyPair,
    /// The CA certificate as given (what peers trust).
    pub cert_der: CertificateDer<'static>,
}

impl fmt::Debug for LocalCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalCa").finish_non_exhaustive()
    }
}

impl LocalCa {
    /// A new self-signed CA (ECDSA P-256), for tests and the demo.
    pub fn generate(name: &str) -> Result<Self, IdentityError> {
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, name);
        params.distinguished_name = dn;
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        let cert_der = cert.der().clone();
        Ok(Self { cert, key, cert_der })
    }

    /// A CA from its PEM certificate and PKCS#8 PEM key (RSA or ECDSA).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, IdentityError> {
        let key = KeyPair::from_pem(key_pem)?;
        let params = CertificateParams::from_ca_cert_pem(cert_pem)?;
        let cert_der = rustls::pki_types::pem::PemObject::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| IdentityError::Malformed(format!("CA certificate PEM: {e}")))?;
        // Re-signing the same subject and key yields an issuer that verifies as the original.
        let cert = params.self_signed(&key)?;
        Ok(Self { cert, key, cert_der })
    }

    /// The CA as PEM (certificate, key), to write for other processes.
    pub fn to_pem(&self) -> (String, String) {
        (self.cert.pem(), self.key.serialize_pem())
    }

    /// Mints a certificate for `id`, valid from a minute ago for `validity`.
    pub fn issue(&self, id: &Identity, validity: Duration) -> Result<WorkloadCert, IdentityError> {
        let now = time::OffsetDateTime::now_utc();
        self.issue_between(id, now - time::Duration::minutes(1), now + validity)
    }

    /// Mints a certificate for `id` valid from `not_before` to `not_after` (tests make expired
    /// and not-yet-valid ones with it).
    pub fn issue_between(
        &self,
        id: &Identity,
        not_before: time::OffsetDateTime,
        not_after: time::OffsetDateTime,
    ) -> Result<WorkloadCert, IdentityError> {
        self.issue_with_uris(&[id.to_string()], not_before, not_after)
    }

    /// Mints a certificate whose URI SANs are `uris`, as given (tests make certificates with
    /// several identities, or none, with it).
    pub fn issue_with_uris(
        &self,
        uris: &[String],
        not_before: time::OffsetDateTime,
        not_after: time::OffsetDateTime,
    ) -> Result<WorkloadCert, IdentityError> {
        let mut params = CertificateParams::default();
        params.subject_alt_names = uris
            .iter()
            .map(|u| rcgen::Ia5String::try_from(u.clone()).map(SanType::URI))
            .collect::<Result<_, _>>()?;
        params.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.not_before = not_before;
        params.not_after = not_after;
        // Unique serials, so a rotated certificate is told apart from the one it replaced.
        let mut serial = [0u8; 16];
        ring_rand(&mut serial)?;
        serial[0] &= 0x7f;
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok(WorkloadCert {
            chain: vec![cert.der().clone(), self.cert_der.clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            not_before,
            not_after,
        })
    }
}

impl LocalCa {
    /// Signs a CSR (PEM) as a CA answering it does: the certificate names `identity` (a SPIFFE
    /// URI, which a CA that checks the caller may differ from what the CSR asks), is valid for
    /// `validity`, and certifies the CSR's key. PEM.
    pub fn sign_request(
        &self,
        csr_pem: &str,
        identity: &str,
        validity: Duration,
    ) -> Result<String, IdentityError> {
        let mut csr = rcgen::CertificateSigningRequestParams::from_pem(csr_pem)?;
        let now = time::OffsetDateTime::now_utc();
        csr.params.subject_alt_names = vec![SanType::URI(rcgen::Ia5String::try_from(identity)?)];
        csr.params.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        csr.params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        csr.params.not_before = now - time::Duration::minutes(1);
        csr.params.not_after = now + validity;
        let mut serial = [0u8; 16];
        ring_rand(&mut serial)?;
        serial[0] &= 0x7f;
        csr.params.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
        Ok(csr.signed_by(&self.cert, &self.key)?.pem())
    }

    /// A TLS serving certificate for `dns` and `ip` (a control plane's, in tests).
    pub fn issue_serving(&self, dns: &str, ip: &str) -> Result<WorkloadCert, IdentityError> {
        let mut params = CertificateParams::new(vec![dns.to_owned()])?;
        let ip: std::net::IpAddr =
            ip.parse().map_err(|_| IdentityError::Malformed(format!("{ip} is not an IP")))?;
        params.subject_alt_names.push(SanType::IpAddress(ip));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let now = time::OffsetDateTime::now_utc();
        let (not_before, not_after) =
            (now - time::Duration::minutes(1), now + time::Duration::days(1));
        params.not_before = not_before;
        params.not_after = not_after;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok(WorkloadCert {
            chain: vec![cert.der().clone(), self.cert_der.clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            not_before,
            not_after,
        })
    }
}

fn ring_rand(buf: &mut [u8]) -> Result<(), IdentityError> {
    use ring::rand::SecureRandom as _;
    ring::rand::SystemRandom::new()
        .fill(buf)
        .map_err(|_| IdentityError::Malformed("no randomness for a serial number".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spiffe_identities_round_trip() {
        let id = Identity::new("cluster.local", "default", "web");
        assert_eq!(id.to_string(), "spiffe://cluster.local/ns/default/sa/web");
        assert_eq!(Identity::parse(&id.to_string()).expect("parse"), id);
    }

    #[test]
    fn malformed_identities_are_refused() {
        for bad in [
            "spiffe://td/ns/default",
            "https://td/ns/a/sa/b",
            "spiffe:///ns/a/sa/b",
            "spiffe://td/ns/a/sa/b/c",
        ] {
            assert!(Identity::parse(bad).is_err(), "{bad} accepted");
        }
    }
}
