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

/// What a change to a file is detected by (certificates and the workloads file): its
/// modification time, size and inode. The time alone misses a file truncated and written again
/// within one tick of the file system's coarse clock: a reader in between saw it empty (a
/// workloads file read so emptied the store and kept it empty), and the finished write has the
/// same time. The inode catches a file replaced by rename within that tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    modified: SystemTime,
    len: u64,
    inode: u64,
}

/// `p`'s stamp; `None` if it cannot be read.
pub fn file_stamp(p: &Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::metadata(p).ok()?;
    Some(FileStamp { modified: m.modified().ok()?, len: m.len(), inode: m.ino() })
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
    roots: RwLock<(Arc<Vec<CertificateDer<'static>>>, Option<FileStamp>)>,
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
        let stamp = file_stamp(&bundle);
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
        let stamp = file_stamp(bundle);
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

    /// What identifies the version of `id`'s files (their stamps; nothing in
    /// local-CA mode). Taken before a fetch, compared by `stale`: a clock comparison would miss
    /// a file written within the same coarse timestamp tick as the fetch.
    pub fn stamp(&self, id: &Identity) -> Vec<Option<FileStamp>> {
        match &self.source {
            Source::Istiod { .. } | Source::LocalCa { .. } => Vec::new(),
            Source::Files { dir, .. } => {
                let (c, k) = Self::files_of(dir, id);
                vec![file_stamp(&c), file_stamp(&k)]
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
        stamp: &[Option<FileStamp>],
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

#[cfg(test)]
mod tests {
    //! The files source: what it refuses, and when a certificate it gave is replaced.

    use super::*;

    /// A file emptied and written again within one tick of the file system's clock (its
    /// modification time the same) has another stamp: a reader that saw it empty reads it again.
    #[test]
    fn a_file_rewritten_within_one_clock_tick_changes_its_stamp() {
        let dir = Dir::new("stamp");
        let path = dir.0.join("workloads.yaml");
        std::fs::write(&path, "").expect("write");
        let empty = file_stamp(&path).expect("stamp");
        let modified = std::fs::metadata(&path).and_then(|m| m.modified()).expect("mtime");
        std::fs::write(&path, "workloads: []\n").expect("write");
        std::fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_modified(modified))
            .expect("set the time back");
        assert_eq!(std::fs::metadata(&path).and_then(|m| m.modified()).ok(), Some(modified));
        assert_ne!(file_stamp(&path), Some(empty), "the rewrite went unseen");
    }

    /// A directory of its own under the system's temporary one, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Self {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let d = std::env::temp_dir()
                .join(format!("meshpath-certs-{name}-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&d).expect("temporary directory");
            Self(d)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn id() -> Identity {
        Identity::new("cluster.local", "default", "sa")
    }

    /// Files mode over `dir` with `ca`'s root as the bundle; `cert` written as `id()`'s files.
    fn files(dir: &Dir, ca: &LocalCa, cert: &WorkloadCert) -> Certs {
        let bundle = dir.0.join("root-cert.pem");
        std::fs::write(&bundle, ca.to_pem().0).expect("bundle");
        write(dir, cert);
        Certs::files(dir.0.join("certs"), bundle).expect("files mode")
    }

    fn write(dir: &Dir, cert: &WorkloadCert) {
        let d = dir.0.join("certs/default/sa");
        std::fs::create_dir_all(&d).expect("identity directory");
        let (chain, key) = cert.to_pem();
        std::fs::write(d.join("cert-chain.pem"), chain).expect("chain");
        std::fs::write(d.join("key.pem"), key).expect("key");
    }

    #[test]
    fn a_certificate_file_for_the_identity_is_taken() {
        let (dir, ca) = (Dir::new("taken"), LocalCa::generate("ca").expect("ca"));
        let certs = files(&dir, &ca, &ca.issue(&id(), Duration::from_secs(3600)).expect("issue"));
        let got = certs.fetch(&id()).expect("taken");
        assert_eq!(got.chain.len(), 2);
        assert_eq!(*certs.roots(), vec![ca.cert_der.clone()]);
    }

    #[test]
    fn a_certificate_file_naming_another_identity_is_refused() {
        let (dir, ca) = (Dir::new("other"), LocalCa::generate("ca").expect("ca"));
        let mallory = Identity::new("cluster.local", "default", "mallory");
        let certs =
            files(&dir, &ca, &ca.issue(&mallory, Duration::from_secs(3600)).expect("issue"));
        let err = certs.fetch(&id()).expect_err("taken");
        assert!(matches!(err, CertError::WrongIdentity { .. }), "{err}");
        assert!(err.to_string().contains("mallory"), "{err}");
    }

    #[test]
    fn an_expired_certificate_file_is_refused() {
        let (dir, ca) = (Dir::new("expired"), LocalCa::generate("ca").expect("ca"));
        let now = time::OffsetDateTime::now_utc();
        let old = ca
            .issue_between(&id(), now - time::Duration::hours(2), now - time::Duration::hours(1))
            .expect("issue");
        let err = files(&dir, &ca, &old).fetch(&id()).expect_err("taken");
        assert!(matches!(err, CertError::Expired { .. }), "{err}");
    }

    #[test]
    fn a_missing_or_empty_file_says_which() {
        let (dir, ca) = (Dir::new("missing"), LocalCa::generate("ca").expect("ca"));
        let certs = files(&dir, &ca, &ca.issue(&id(), Duration::from_secs(3600)).expect("issue"));
        let nobody = Identity::new("cluster.local", "default", "nobody");
        let err = certs.fetch(&nobody).expect_err("taken");
        assert!(err.to_string().contains("nobody/cert-chain.pem"), "{err}");
        std::fs::write(dir.0.join("certs/default/sa/cert-chain.pem"), "").expect("emptied");
        assert!(matches!(certs.fetch(&id()), Err(CertError::Empty(_))));
    }

    #[test]
    fn a_certificate_is_stale_once_its_files_change_and_not_before() {
        let (dir, ca) = (Dir::new("stale"), LocalCa::generate("ca").expect("ca"));
        let certs = files(&dir, &ca, &ca.issue(&id(), Duration::from_secs(3600)).expect("issue"));
        let stamp = certs.stamp(&id());
        let got = certs.fetch(&id()).expect("taken");
        assert!(!certs.stale(&id(), &got, SystemTime::now(), &stamp));
        // A rewrite within the file system's timestamp tick would keep the stamp: step past it.
        std::thread::sleep(Duration::from_millis(20));
        write(&dir, &ca.issue(&id(), Duration::from_secs(3600)).expect("issue"));
        let key = dir.0.join("certs/default/sa/key.pem");
        let later = SystemTime::now() + Duration::from_secs(1);
        std::fs::File::options()
            .write(true)
            .open(&key)
            .and_then(|f| f.set_modified(later))
            .expect("touch");
        assert!(certs.stale(&id(), &got, SystemTime::now(), &stamp));
    }

    #[test]
    fn the_trust_bundle_is_read_again_only_when_it_changed() {
        let (dir, ca) = (Dir::new("bundle"), LocalCa::generate("ca").expect("ca"));
        let certs = files(&dir, &ca, &ca.issue(&id(), Duration::from_secs(3600)).expect("issue"));
        assert!(!certs.reload_roots().expect("reload"), "reloaded an unchanged bundle");
        let next = LocalCa::generate("next").expect("ca");
        let bundle = dir.0.join("root-cert.pem");
        std::fs::write(&bundle, format!("{}{}", ca.to_pem().0, next.to_pem().0)).expect("bundle");
        std::fs::File::options()
            .write(true)
            .open(&bundle)
            .and_then(|f| f.set_modified(SystemTime::now() + Duration::from_secs(1)))
            .expect("touch");
        assert!(certs.reload_roots().expect("reload"), "the new bundle was not read");
        assert_eq!(*certs.roots(), vec![ca.cert_der.clone(), next.cert_der.clone()]);
    }

    #[test]
    fn a_minted_certificate_is_stale_past_half_its_life() {
        let ca = LocalCa::generate("ca").expect("ca");
        let certs = Certs::local_ca(ca, Duration::from_secs(100));
        let cert = certs.fetch(&id()).expect("minted");
        assert!(!certs.stale(&id(), &cert, SystemTime::now(), &[]));
        // Half the life it had left when fetched: fetched 40 s ago with 140 s left, it is not
        // stale (30 s to go); fetched 110 s ago with 210 s left, it is (5 s past).
        let ago = |s| SystemTime::now() - Duration::from_secs(s);
        assert!(!certs.stale(&id(), &cert, ago(40), &[]), "stale before half its life");
        assert!(certs.stale(&id(), &cert, ago(110), &[]), "not stale past half its life");
    }
}
