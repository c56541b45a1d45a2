//! Where workload certificates come from, and when they are renewed.
//!
//! Two sources:
//! - **local CA**: a CA certificate and key on disk (RSA or ECDSA); the proxy mints a short-lived
//!   certificate per identity and renews it at half its lifetime. The CA is the trust root.
//! - **files**: `DIR/NAMESPACE/SERVICE_ACCOUNT/cert-chain.pem` and `key.pem` per identity plus a
//!   trust bundle, as a secret-mounting agent writes them; re-read when they change.
//!
//! Renewing only swaps what new handshakes present: open connections keep their session.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::{Duration, SystemTime},
};

use rustls::pki_types::{pem::PemObject as _, CertificateDer, PrivateKeyDer};

use crate::{
    identity::tls,
    identity::{Identity, IdentityError, LocalCa, WorkloadCert},
};

/// A file's modification time (what a change is detected by: certificates and the workloads
/// file).
pub fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// Why a certificate could not be had.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("reading {0}: {1}")]
    Read(PathBuf, String),
    #[error("{0}: no certificate in it")]
    Empty(PathBuf),
    #[error("{path}: the certificate is for {found}, not {wanted}")]
    WrongIdentity { path: PathBuf, found: String, wanted: Identity },
    #[error("{path}: the certificate expired at {not_after}")]
    Expired { path: PathBuf, not_after: time::OffsetDateTime },
    #[error("minting: {0}")]
    Mint(#[from] IdentityError),
}

enum Source {
    LocalCa { ca: Box<LocalCa>, lifetime: Duration },
    Files { dir: PathBuf, bundle: PathBuf },
}

/// The certificate source and the trust roots.
pub struct Certs {
    source: Source,
    roots: RwLock<(Arc<Vec<CertificateDer<'static>>>, Option<SystemTime>)>,
}

impl std::fmt::Debug for Certs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.mode())
    }
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(|e| CertError::Read(path.into(), e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError::Read(path.into(), e.to_string()))?;
    if chain.is_empty() {
        return Err(CertError::Empty(path.into()));
    }
    Ok(chain)
}

impl Certs {
    /// Mints from `ca`, certificates living `lifetime`.
    pub fn local_ca(ca: LocalCa, lifetime: Duration) -> Self {
        let roots = vec![ca.cert_der.clone()];
        Self {
            source: Source::LocalCa { ca: Box::new(ca), lifetime },
            roots: RwLock::new((Arc::new(roots), None)),
        }
    }

    /// Reads per-identity files under `dir`, trusting `bundle`.
    pub fn files(dir: PathBuf, bundle: PathBuf) -> Result<Self, CertError> {
        let roots = read_chain(&bundle)?;
        let stamp = mtime(&bundle);
        Ok(Self {
            source: Source::Files { dir, bundle },
            roots: RwLock::new((Arc::new(roots), stamp)),
        })
    }

    /// `local-ca` or `files`.
    pub fn mode(&self) -> &'static str {
        match self.source {
            Source::LocalCa { .. } => "local-ca",
            Source::Files { .. } => "files",
        }
    }

    /// The trust roots now.
    pub fn roots(&self) -> Arc<Vec<CertificateDer<'static>>> {
        self.roots.read().map(|r| r.0.clone()).unwrap_or_default()
    }

    /// Re-reads the trust bundle if it changed (files mode). Returns whether it did.
    pub fn reload_roots(&self) -> Result<bool, CertError> {
        let Source::Files { bundle, .. } = &self.source else { return Ok(false) };
        let stamp = mtime(bundle);
        if self.roots.read().map(|r| r.1 == stamp).unwrap_or(false) {
            return Ok(false);
        }
        let roots = read_chain(bundle)?;
        if let Ok(mut r) = self.roots.write() {
            *r = (Arc::new(roots), stamp);
        }
        Ok(true)
    }

    fn files_of(dir: &Path, id: &Identity) -> (PathBuf, PathBuf) {
        let d = dir.join(&id.namespace).join(&id.service_account);
        (d.join("cert-chain.pem"), d.join("key.pem"))
    }

    /// A certificate for `id`, now.
    pub fn fetch(&self, id: &Identity) -> Result<WorkloadCert, CertError> {
        match &self.source {
            Source::LocalCa { ca, lifetime } => Ok(ca.issue(id, *lifetime)?),
            Source::Files { dir, .. } => {
                let (cert_path, key_path) = Self::files_of(dir, id);
                let chain = read_chain(&cert_path)?;
                let key = PrivateKeyDer::from_pem_file(&key_path)
                    .map_err(|e| CertError::Read(key_path.clone(), e.to_string()))?;
                // Our own certificate must name exactly the identity peers will check.
                let found = tls::peer_identity(&chain[0]);
                if found.as_ref() != Ok(id) {
                    let found = found.map_or_else(|why| why, |f| f.to_string());
                    return Err(CertError::WrongIdentity {
                        path: cert_path,
                        found,
                        wanted: id.clone(),
                    });
                }
                let (not_before, not_after) = x509_parser::parse_x509_certificate(&chain[0])
                    .map(|(_, c)| {
                        (
                            c.validity().not_before.to_datetime(),
                            c.validity().not_after.to_datetime(),
                        )
                    })
                    .map_err(|e| CertError::Read(cert_path.clone(), e.to_string()))?;
                // An expired file is refused: the certificate in use is kept (and, if it has
                // expired too, readiness says so) rather than replaced by one no peer accepts.
                if not_after <= time::OffsetDateTime::now_utc() {
                    return Err(CertError::Expired { path: cert_path, not_after });
                }
                Ok(WorkloadCert { chain, key, not_before, not_after })
            }
        }
    }

    /// What identifies the version of `id`'s files (their modification times; nothing in
    /// local-CA mode). Taken before a fetch, compared by `stale`: a clock comparison would miss
    /// a file written within the same coarse timestamp tick as the fetch.
    pub fn stamp(&self, id: &Identity) -> Vec<Option<SystemTime>> {
        match &self.source {
            Source::LocalCa { .. } => Vec::new(),
            Source::Files { dir, .. } => {
                let (c, k) = Self::files_of(dir, id);
                vec![mtime(&c), mtime(&k)]
            }
        }
    }

    /// Whether `cert` (fetched at `fetched`, its files then at `stamp`) should be replaced now:
    /// half its remaining lifetime gone (local CA), or its files changed since (files).
    pub fn stale(
        &self,
        id: &Identity,
        cert: &WorkloadCert,
        fetched: SystemTime,
        stamp: &[Option<SystemTime>],
    ) -> bool {
        match &self.source {
            Source::LocalCa { .. } => {
                let fetched = time::OffsetDateTime::from(fetched);
                time::OffsetDateTime::now_utc() >= fetched + (cert.not_after - fetched) / 2
            }
            Source::Files { .. } => self.stamp(id) != stamp,
        }
    }
}
