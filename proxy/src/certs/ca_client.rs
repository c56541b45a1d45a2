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
    /// Why the last request for an identity failed (gone once one succeeds, or once the
    /// identity is no longer wanted): what the admin dump shows as `Unavailable: …`.
    failed: Mutex<HashMap<Identity, String>>,
    metrics: Arc<Metrics>,
}

/// Where an identity's certificate stands, as the admin dump shows it (ztunnel's states).
#[derive(Debug)]
pub enum CertState {
    /// Held, with its chain (leaf first).
    Available(WorkloadCert),
    /// Being asked for, none held yet.
    Initializing,
    /// The last request failed, none held: why.
    Unavailable(String),
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

/// A CA's answer, checked: its leaf names exactly the identity asked for, every entry is PEM,
/// the last one holds the trust bundle.
#[derive(Debug)]
struct Answer {
    /// The leaf and any intermediates.
    chain: Vec<CertificateDer<'static>>,
    roots: Vec<CertificateDer<'static>>,
    not_before: time::OffsetDateTime,
    not_after: time::OffsetDateTime,
}

impl Answer {
    /// Checks `entries` (`cert_chain` of the answer, PEM each) for `id`; why not, if refused.
    fn parse(id: &Identity, entries: &[String]) -> Result<Self, String> {
        let [first, middle @ .., last] = entries else {
            return Err(format!(
                "{} certificate(s): a leaf and the root bundle are needed",
                entries.len()
            ));
        };
        let leaf = first_pem(first)?;
        let found = tls::spiffe_ids(&leaf);
        if found.len() != 1 || &found[0] != id {
            let found: Vec<String> = found.iter().map(ToString::to_string).collect();
            return Err(format!("the leaf names {found:?}, not {id}: refused"));
        }
        let mut chain = vec![leaf];
        for mid in middle {
            chain.push(first_pem(mid)?);
        }
        let roots = all_pem(last)?;
        if roots.is_empty() {
            return Err("no root certificate in its last entry".into());
        }
        let (not_before, not_after) = x509_parser::parse_x509_certificate(&chain[0])
            .map(|(_, c)| {
                (c.validity().not_before.to_datetime(), c.validity().not_after.to_datetime())
            })
            .map_err(|e| format!("the leaf does not parse: {e}"))?;
        Ok(Self { chain, roots, not_before, not_after })
    }
}

impl CaClient {
    pub fn new(cfg: CaConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            cfg,
            held: Mutex::new(HashMap::new()),
            roots: Mutex::new((Vec::new(), 0)),
            inflight: Mutex::new(HashMap::new()),
            channel: tokio::sync::Mutex::new(None),
            failed: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// The trust bundle of the last answer (empty before any), and how many times it changed.
    pub fn roots(&self) -> (Vec<CertificateDer<'static>>, u64) {
        self.roots.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Every identity the client holds a certificate for, is asking for, or last failed to
    /// get one for, with where it stands; sorted by identity.
    pub fn states(&self) -> Vec<(Identity, CertState)> {
        let mut states: std::collections::BTreeMap<String, (Identity, CertState)> =
            Default::default();
        if let Ok(inflight) = self.inflight.lock() {
            for id in inflight.keys() {
                states.insert(id.to_string(), (id.clone(), CertState::Initializing));
            }
        }
        if let Ok(failed) = self.failed.lock() {
            for (id, why) in failed.iter() {
                states.insert(id.to_string(), (id.clone(), CertState::Unavailable(why.clone())));
            }
        }
        if let Ok(held) = self.held.lock() {
            for (id, h) in held.iter() {
                states.insert(id.to_string(), (id.clone(), CertState::Available(h.cert())));
            }
        }
        states.into_values().collect()
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
        if let Ok(mut failed) = self.failed.lock() {
            match &result {
                Ok(_) => failed.remove(id),
                Err(e) => failed.insert(id.clone(), e.to_string()),
            };
        }
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
        let answer = Answer::parse(id, &resp.cert_chain)
            .map_err(|why| CaError::Answer { id: id.clone(), why })?;
        let (certs, roots, not_before, not_after) =
            (answer.chain, answer.roots, answer.not_before, answer.not_after);
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
                if let Ok(mut failed) = me.failed.lock() {
                    failed.retain(|id, _| want.contains(id));
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

#[cfg(test)]
mod tests {
    //! What the CA client takes from an answer, and when it renews.

    use super::*;
    use crate::identity::LocalCa;

    fn id(sa: &str) -> Identity {
        Identity::new("cluster.local", "default", sa)
    }

    /// An answer as istiod's CA gives it: the leaf for `uris`, then the root, PEM each.
    fn answer(ca: &LocalCa, uris: &[String]) -> Vec<String> {
        let now = time::OffsetDateTime::now_utc();
        let cert = ca
            .issue_with_uris(uris, now - time::Duration::minutes(1), now + time::Duration::hours(1))
            .expect("issue");
        let (leaf, _) = cert.to_pem();
        let (root, _) = ca.to_pem();
        // `to_pem` gives the leaf and the CA: keep only the leaf's block for the first entry.
        let leaf = leaf.split_inclusive("-----END CERTIFICATE-----").next().expect("a block");
        vec![leaf.to_owned(), root]
    }

    #[test]
    fn an_answer_naming_the_identity_asked_for_is_taken_with_its_validity_and_bundle() {
        let ca = LocalCa::generate("ca").expect("ca");
        let a = Answer::parse(&id("sa"), &answer(&ca, &[id("sa").to_string()])).expect("taken");
        assert_eq!(a.chain.len(), 1);
        assert_eq!(a.roots, vec![ca.cert_der.clone()]);
        assert!(a.not_after - a.not_before > time::Duration::minutes(59));
    }

    #[test]
    fn a_leaf_for_another_identity_is_refused() {
        let ca = LocalCa::generate("ca").expect("ca");
        let why = Answer::parse(&id("sa"), &answer(&ca, &[id("mallory").to_string()]))
            .expect_err("taken");
        assert!(why.contains("mallory") && why.contains("refused"), "{why}");
    }

    #[test]
    fn a_leaf_naming_the_identity_and_another_is_refused() {
        let ca = LocalCa::generate("ca").expect("ca");
        let both = [id("sa").to_string(), id("other").to_string()];
        assert!(Answer::parse(&id("sa"), &answer(&ca, &both)).is_err());
    }

    #[test]
    fn an_answer_without_the_root_bundle_is_refused() {
        let ca = LocalCa::generate("ca").expect("ca");
        let mut entries = answer(&ca, &[id("sa").to_string()]);
        entries.truncate(1);
        let why = Answer::parse(&id("sa"), &entries).expect_err("taken");
        assert!(why.contains("1 certificate(s)"), "{why}");
        assert!(Answer::parse(&id("sa"), &[]).is_err());
    }

    #[test]
    fn an_entry_that_is_not_pem_is_refused() {
        let ca = LocalCa::generate("ca").expect("ca");
        let mut entries = answer(&ca, &[id("sa").to_string()]);
        entries[1] = "not a certificate".into();
        assert!(Answer::parse(&id("sa"), &entries).is_err(), "a bundle that is not PEM");
        entries[0] = "not a certificate".into();
        assert!(Answer::parse(&id("sa"), &entries).is_err(), "a leaf that is not PEM");
    }

    #[test]
    fn a_bundle_of_several_roots_is_taken_whole() {
        let (ca, other) =
            (LocalCa::generate("ca").expect("ca"), LocalCa::generate("b").expect("b"));
        let mut entries = answer(&ca, &[id("sa").to_string()]);
        entries[1].push_str(&other.to_pem().0);
        let a = Answer::parse(&id("sa"), &entries).expect("taken");
        assert_eq!(a.roots, vec![ca.cert_der.clone(), other.cert_der.clone()]);
    }

    #[test]
    fn renewal_falls_at_half_life_within_ten_percent() {
        let now = time::OffsetDateTime::now_utc();
        for _ in 0..50 {
            let at = renew_at(now, now + time::Duration::seconds(1000));
            let wait = at.saturating_duration_since(Instant::now()).as_secs_f64();
            assert!((448.0..=551.0).contains(&wait), "renewal in {wait} s of a 1000 s life");
        }
        // Past half life already (a certificate held long): due now.
        let at = renew_at(now - time::Duration::seconds(900), now + time::Duration::seconds(100));
        assert!(at <= Instant::now() + Duration::from_millis(10));
    }
}
