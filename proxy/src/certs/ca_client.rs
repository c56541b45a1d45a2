//! Workload certificates from istiod's CA (`IstioCertificateService/CreateCertificate`), as
//! ztunnel gets them in its shared (node) mode:
//!
//! - a fresh ECDSA P-256 key per request, made here and never sent; a CSR with an empty subject
//!   and one URI SAN, the SPIFFE id; `validity_duration` the configured TTL (`SECRET_TTL`);
//! - `ImpersonatedIdentity` in the request's metadata: the node proxy asks on behalf of the
//!   pods of its node (istiod checks the node's token and that a pod with that identity runs
//!   on it);
//! - the answer is refused unless its leaf names exactly the identity asked for; the chain's
//!   last entry is the trust bundle;
//! - one certificate per identity, shared by the pods that have it, renewed at half its life
//!   (with jitter), retried with a backoff when the CA fails (a certificate still valid is kept
//!   meanwhile); fetched ahead for this node's HBONE workloads the xDS stream lists;
//! - failing safe: every request has a deadline ([`CA_DEADLINE`]); one request per identity at
//!   a time, and identities apart (a CSR istiod never answers holds up no other identity's);
//!   one connection to istiod, reused by every request, made again only after one failed.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use meshpath_xds::{
    ca::{
        istio_certificate_service_client::IstioCertificateServiceClient, IstioCertificateRequest,
    },
    IMPERSONATED_IDENTITY,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tracing::{info, warn};

use crate::{
    identity::{tls, Identity, WorkloadCert},
    istiod::{Channel, ChannelConfig},
    metrics::{ErrorLabels, Metrics},
};

/// How long one certificate request (connecting included) may take: below the node agent's
/// ZDS ack timeout (10 s by default), since adding a pod whose certificate is not held waits for
/// it.
pub const CA_DEADLINE: Duration = Duration::from_secs(5);

/// Why a certificate could not be had.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("making the CSR: {0}")]
    Csr(String),
    #[error("the CA at {address}: {message}")]
    Call { address: String, message: String },
    #[error("the CA's answer for {id}: {why}")]
    Answer { id: Identity, why: String },
}

/// How to reach the CA and what to ask for.
#[derive(Debug, Clone)]
pub struct CaConfig {
    pub channel: ChannelConfig,
    /// Validity asked for (`SECRET_TTL`).
    pub ttl: Duration,
}

#[derive(Debug)]
struct Held {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    not_before: time::OffsetDateTime,
    not_after: time::OffsetDateTime,
    /// When to renew it (half its life, jittered).
    renew_at: Instant,
}

impl Held {
    fn cert(&self) -> WorkloadCert {
        WorkloadCert {
            chain: self.chain.clone(),
            key: self.key.clone_key(),
            not_before: self.not_before,
            not_after: self.not_after,
        }
    }
}

/// The client and the certificates it holds.
#[derive(Debug)]
pub struct CaClient {
    cfg: CaConfig,
    held: Mutex<HashMap<Identity, Held>>,
    /// The trust bundle of the last answer (PEM certificates), with a counter of changes.
    roots: Mutex<(Vec<CertificateDer<'static>>, u64)>,
    /// One request per identity at a time: a lock per identity with a request under way or
    /// waiting (an entry goes with its last user).
    inflight: Mutex<HashMap<Identity, Arc<tokio::sync::Mutex<()>>>>,
    /// The connection to istiod every request shares, once made; dropped after a failed call.
    channel: tokio::sync::Mutex<Option<Channel>>,
    metrics: Arc<Metrics>,
}

/// An identity's turn to ask the CA: held while its request runs; its entry in `inflight` goes
/// with the last turn.
struct Turn<'a> {
    client: &'a CaClient,
    id: Identity,
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Ok(mut m) = self.client.inflight.lock() {
            // Ours and the map's: nobody else waits for this identity.
            if Arc::strong_count(&self.lock) <= 2 {
                m.remove(&self.id);
            }
        }
    }
}

/// Renewal at half life, ±10 % of that half.
fn renew_at(not_before: time::OffsetDateTime, not_after: time::OffsetDateTime) -> Instant {
    let life = (not_after - not_before).max(time::Duration::ZERO);
    let half = Duration::try_from(life / 2).unwrap_or_default();
    let mut b = [0u8; 2];
    // SAFETY: getrandom writes at most the buffer's length.
    unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let r = f64::from(u16::from_ne_bytes(b)) / f64::from(u16::MAX);
    let elapsed =
        Duration::try_from(time::OffsetDateTime::now_utc() - not_before).unwrap_or_default();
    let wait = half.mul_f64(0.9 + 0.2 * r).saturating_sub(elapsed);
    Instant::now() + wait
}

fn first_pem(text: &str) -> Result<CertificateDer<'static>, String> {
    rustls::pki_types::pem::PemObject::from_pem_slice(text.as_bytes())
        .map_err(|e| format!("not a PEM certificate: {e}"))
}

fn all_pem(text: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    rustls::pki_types::pem::PemObject::pem_slice_iter(text.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not PEM certificates: {e}"))
}

impl CaClient {
    pub fn new(cfg: CaConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            cfg,
            held: Mutex::new(HashMap::new()),
            roots: Mutex::new((Vec::new(), 0)),
            inflight: Mutex::new(HashMap::new()),
            channel: tokio::sync::Mutex::new(None),
            metrics,
        }
    }

    /// The trust bundle of the last answer (empty before any), and how many times it changed.
    pub fn roots(&self) -> (Vec<CertificateDer<'static>>, u64) {
        self.roots.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// The certificate held for `id`, if one is and it is still valid.
    pub fn cached(&self, id: &Identity) -> Option<WorkloadCert> {
        let held = self.held.lock().ok()?;
        let h = held.get(id)?;
        (h.not_after > time::OffsetDateTime::now_utc()).then(|| h.cert())
    }

    /// A certificate for `id`: the one held while it is fresh, else a new one from the CA.
    pub async fn get(&self, id: &Identity) -> Result<WorkloadCert, CaError> {
        if let Some(c) = self.fresh(id) {
            return Ok(c);
        }
        let turn = self.turn(id);
        let _one = turn.lock.lock().await;
        // Another caller may have fetched it while this one waited.
        if let Some(c) = self.fresh(id) {
            return Ok(c);
        }
        self.renew(id).await
    }

    /// `id`'s lock (other identities have their own).
    fn turn(&self, id: &Identity) -> Turn<'_> {
        let lock = self
            .inflight
            .lock()
            .map(|mut m| m.entry(id.clone()).or_default().clone())
            .unwrap_or_default();
        Turn { client: self, id: id.clone(), lock }
    }

    fn fresh(&self, id: &Identity) -> Option<WorkloadCert> {
        let held = self.held.lock().ok()?;
        let h = held.get(id)?;
        (Instant::now() < h.renew_at).then(|| h.cert())
    }

    /// Asks the CA for a certificate for `id` and holds it; gives up after [`CA_DEADLINE`].
    pub async fn renew(&self, id: &Identity) -> Result<WorkloadCert, CaError> {
        let result = match tokio::time::timeout(CA_DEADLINE, self.request(id)).await {
            Ok(r) => r,
            Err(_) => Err(CaError::Call {
                address: self.cfg.channel.address.clone(),
                message: format!("no answer within {CA_DEADLINE:?}"),
            }),
        };
        let label = ErrorLabels {
            direction: "-".into(),
            reason: if result.is_ok() { "ok" } else { "error" }.into(),
        };
        self.metrics.ca_requests.get_or_create(&label).inc();
        let (held, roots) = result?;
        let cert = held.cert();
        if let Ok(mut r) = self.roots.lock() {
            if r.0 != roots {
                r.0 = roots;
                r.1 += 1;
            }
        }
        if let Ok(mut h) = self.held.lock() {
            h.insert(id.clone(), held);
        }
        Ok(cert)
    }

    async fn request(
        &self,
        id: &Identity,
    ) -> Result<(Held, Vec<CertificateDer<'static>>), CaError> {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| CaError::Csr(e.to_string()))?;
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        let uri =
            rcgen::Ia5String::try_from(id.to_string()).map_err(|e| CaError::Csr(e.to_string()))?;
        params.subject_alt_names = vec![rcgen::SanType::URI(uri)];
        let csr = params
            .serialize_request(&key)
            .and_then(|c| c.pem())
            .map_err(|e| CaError::Csr(e.to_string()))?;
        let metadata = prost_types::Struct {
            fields: [(
                IMPERSONATED_IDENTITY.to_owned(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(id.to_string())),
                },
            )]
            .into(),
        };
        let call =
            |message: String| CaError::Call { address: self.cfg.channel.address.clone(), message };
        let channel = self.channel().await.map_err(|e| call(format!("{e:#}")))?;
        let mut client = IstioCertificateServiceClient::with_interceptor(
            channel.inner.clone(),
            channel.interceptor(),
        );
        let resp = match client
            .create_certificate(IstioCertificateRequest {
                csr,
                validity_duration: i64::try_from(self.cfg.ttl.as_secs()).unwrap_or(86_400),
                metadata: Some(metadata),
            })
            .await
        {
            Ok(r) => r.into_inner(),
            Err(s) => {
                if s.code() == tonic::Code::Unavailable || s.code() == tonic::Code::Unknown {
                    // The connection may be what failed: the next request makes a new one.
                    *self.channel.lock().await = None;
                }
                return Err(call(format!("{}: {}", s.code(), s.message())));
            }
        };
        let bad = |why: String| CaError::Answer { id: id.clone(), why };
        let chain = resp.cert_chain;
        if chain.len() < 2 {
            return Err(bad(format!(
                "{} certificate(s): a leaf and the root bundle are needed",
                chain.len()
            )));
        }
        let leaf = first_pem(&chain[0]).map_err(bad)?;
        let found = tls::spiffe_ids(&leaf);
        if found.len() != 1 || &found[0] != id {
            let found: Vec<String> = found.iter().map(ToString::to_string).collect();
            return Err(bad(format!("the leaf names {found:?}, not {id}: refused")));
        }
        let mut certs = vec![leaf];
        for mid in &chain[1..chain.len() - 1] {
            certs.push(first_pem(mid).map_err(bad)?);
        }
        let roots = all_pem(&chain[chain.len() - 1]).map_err(bad)?;
        if roots.is_empty() {
            return Err(bad("no root certificate in its last entry".into()));
        }
        let (not_before, not_after) = x509_parser::parse_x509_certificate(&certs[0])
            .map(|(_, c)| {
                (c.validity().not_before.to_datetime(), c.validity().not_after.to_datetime())
            })
            .map_err(|e| bad(format!("the leaf does not parse: {e}")))?;
        let key = PrivateKeyDer::Pkcs8(key.serialize_der().into());
        info!(identity = %id, %not_after, "certificate from the CA");
        Ok((
            Held {
                chain: certs,
                key,
                not_before,
                not_after,
                renew_at: renew_at(not_before, not_after),
            },
            roots,
        ))
    }

    /// The shared connection to istiod, made now if there is none.
    async fn channel(&self) -> anyhow::Result<Channel> {
        let mut held = self.channel.lock().await;
        if let Some(c) = held.as_ref() {
            return Ok(c.clone());
        }
        let c = Channel::connect(&self.cfg.channel).await?;
        *held = Some(c.clone());
        Ok(c)
    }

    /// Keeps the certificates of `wanted()` identities fresh: renews each at its time, retries a
    /// failure with a backoff (1 s doubling to 150 s), forgets identities no longer wanted.
    pub fn spawn_renewal(self: &Arc<Self>, wanted: impl Fn() -> Vec<Identity> + Send + 'static) {
        let me = self.clone();
        tokio::spawn(async move {
            let mut retry: HashMap<Identity, (Instant, Duration)> = HashMap::new();
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                // A set: kept and retried identities are looked up in it, each in one step.
                let want: std::collections::HashSet<Identity> = wanted().into_iter().collect();
                if let Ok(mut held) = me.held.lock() {
                    held.retain(|id, _| want.contains(id));
                }
                retry.retain(|id, _| want.contains(id));
                for id in want {
                    let due = me
                        .held
                        .lock()
                        .map(|h| h.get(&id).is_none_or(|c| Instant::now() >= c.renew_at))
                        .unwrap_or(false);
                    let waiting = retry.get(&id).is_some_and(|(at, _)| Instant::now() < *at);
                    if !due || waiting {
                        continue;
                    }
                    let turn = me.turn(&id);
                    let _one = turn.lock.lock().await;
                    match me.renew(&id).await {
                        Ok(_) => {
                            retry.remove(&id);
                        }
                        Err(e) => {
                            let wait = retry.get(&id).map_or(Duration::from_secs(1), |(_, w)| {
                                (*w * 2).min(Duration::from_secs(150))
                            });
                            warn!(identity = %id, error = %e, retry_in = ?wait, "certificate not renewed; keeping the current one");
                            retry.insert(id, (Instant::now() + wait, wait));
                        }
                    }
                }
            }
        });
    }
}
