//! Where workload certificates come from, and when they are renewed (`ca_client`: istiod's CA).
//!
//! Three sources:
//! - **istiod**: istiod's CA, as ztunnel asks it (certs/ca_client.rs); the trust bundle is
//!   the one its answers carry (the configured root file until the first answer).
//! - **local CA**: a CA certificate and key on disk (RSA or ECDSA); the proxy mints a short-lived
//!   certificate per identity and renews it at half its lifetime. The CA is the trust root.
//! - **files**: `DIR/NAMESPACE/SERVICE_ACCOUNT/cert-chain.pem` and `key.pem` per identity plus a
//!   trust bundle, as a secret-mounting agent writes them; re-read when they change.
//!
//! Renewing only swaps what new handshakes present: open connections keep their session.

pub mod ca_client;

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::{Duration, SystemTime},
};

use rustls::pki_types::{pem::PemObject as _, CertificateDer, PrivateKeyDer};

use self::ca_client::CaClient;
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
    #[error("{0}")]
    Ca(#[from] ca_client::CaError),
}

enum Source {
    Istiod { client: Arc<CaClient>, roots_seen: std::sync::atomic::AtomicU64 },
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

    /// From istiod's CA; `bundle` (istiod's root, `CA_ROOT_CA`) is trusted until the CA's first
    /// answer brings its own.
    pub fn istiod(client: Arc<CaClient>, bundle: &Path) -> Result<Self, CertError> {
        let roots = read_chain(bundle)?;
        Ok(Self {
            source: Source::Istiod { client, roots_seen: Default::default() },
            roots: RwLock::new((Arc::new(roots), None)),
        })
    }

    /// `istiod`, `local-ca` or `files`.
    pub fn mode(&self) -> &'static str {
        match self.source {
            Source::Istiod { .. } => "istiod",
            Source::LocalCa { .. } => "local-ca",
            Source::Files { .. } => "files",
        }
    }

    /// The CA client, in istiod mode.
    pub fn ca_client(&self) -> Option<&Arc<CaClient>> {
        match &self.source {
            Source::Istiod { client, .. } => Some(client),
            _ => None,
        }
    }

    /// The trust roots now.
    pub fn roots(&self) -> Arc<Vec<CertificateDer<'static>>> {
        self.roots.read().map(|r| r.0.clone()).unwrap_or_default()
    }

    /// Re-reads the trust bundle if it changed (files mode), or takes the one the CA's last
    /// answer carried (istiod). Returns whether it did.
    pub fn reload_roots(&self) -> Result<bool, CertError> {
        if let Source::Istiod { client, roots_seen } = &self.source {
            let (roots, changes) = client.roots();
            let seen = roots_seen.swap(changes, std::sync::atomic::Ordering::Relaxed);
            if changes == seen || roots.is_empty() {
                return Ok(false);
            }
            if let Ok(mut r) = self.roots.write() {
                *r = (Arc::new(roots), None);
            }
            return Ok(true);
        }
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
            Source::Istiod { client, .. } => {
                if let Some(c) = client.cached(id) {
                    return Ok(c);
                }
                // Not held yet (a pod whose workload was not prefetched): asked for now, on a
                // runtime thread that may block (a ZDS add runs on a blocking thread).
                let handle = tokio::runtime::Handle::current();
                Ok(tokio::task::block_in_place(|| handle.block_on(client.get(id)))?)
            }
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
            Source::Istiod { .. } | Source::LocalCa { .. } => Vec::new(),
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
            // The CA client renews on its own schedule; a pod takes the new one once it is held.
            Source::Istiod { client, .. } => {
                client.cached(id).is_some_and(|held| held.chain.first() != cert.chain.first())
            }
            Source::LocalCa { .. } => {
                let fetched = time::OffsetDateTime::from(fetched);
                time::OffsetDateTime::now_utc() >= fetched + (cert.not_after - fetched) / 2
            }
            Source::Files { .. } => self.stamp(id) != stamp,
        }
    }
}
