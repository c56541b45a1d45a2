//! A STAND-IN for istiod (istiod itself cannot be built here), speaking its two APIs from the
//! real protos (the meshpath-xds crate): the delta xDS stream with `Address` and
//! `Authorization` resources, and the certificate service. It serves what the test puts in it
//! (prost messages the test builds), pushes each change as a delta to every open stream,
//! records what the proxies send (ACKs and NACKs, the versions they hold when they reconnect,
//! the node, the metadata) and signs CSRs with a CA of its own. Never shipped: tests only.
//!
//! It listens on loopback inside each network namespace it is given (the test's node
//! namespaces), over TLS with a serving certificate for `istiod.istio-system.svc` and
//! 127.0.0.1 from its CA; the CA's certificate is the root the proxies are given. It can be
//! stopped and started again on the same addresses.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::SocketAddr,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Result;
use meshpath_proxy::identity::LocalCa;
use meshpath_xds::{
    ca::{
        istio_certificate_service_server::{
            IstioCertificateService, IstioCertificateServiceServer,
        },
        IstioCertificateRequest, IstioCertificateResponse,
    },
    discovery::{
        aggregated_discovery_service_server::{
            AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
        },
        DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
    },
    ADDRESS_TYPE, AUTHORIZATION_TYPE, IMPERSONATED_IDENTITY,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::{wrappers::ReceiverStream, Stream};
use tonic::{Request, Response, Status, Streaming};

/// One request a proxy sent on a stream.
#[derive(Debug, Clone)]
pub struct Received {
    pub type_url: String,
    pub nonce: String,
    /// A NACK's message.
    pub error: Option<String>,
    pub initial_versions: BTreeMap<String, String>,
    pub node_id: Option<String>,
    pub node_metadata: Vec<String>,
    pub authorization: Option<String>,
    pub cluster_id: Option<String>,
}

/// One certificate request.
#[derive(Debug, Clone)]
pub struct CsrSeen {
    pub impersonated: Option<String>,
    pub validity_seconds: i64,
    /// The CSR's URI SANs.
    pub sans: Vec<String>,
    /// Where the request came from (a node proxy's address).
    pub peer: Option<SocketAddr>,
}

/// A step of a CA root rotation: the CA signing (`None`: the stand-in's own) and the root
/// bundle every answer carries instead of the stand-in's root alone (PEM).
#[derive(Debug, Clone)]
struct Rotation {
    signer: Option<Arc<LocalCa>>,
    bundle: String,
}

#[derive(Debug, Default)]
struct Shared {
    /// (type, name) → (version, encoded resource).
    resources: BTreeMap<(String, String), (String, Vec<u8>)>,
    received: Vec<Received>,
    csrs: Vec<CsrSeen>,
    /// Bearer tokens accepted (none: any).
    tokens: Option<HashSet<String>>,
    /// Types whose responses are held back (readiness tests).
    withheld: HashSet<String>,
    /// Certificates signed for this identity instead of the one asked for.
    wrong_san: Option<String>,
    /// Validity given to certificates (none: what was asked).
    ttl: Option<Duration>,
    /// A CSR for this identity is never answered (a CA that hangs).
    stalled: Option<String>,
    /// Every CSR is answered UNAVAILABLE (istiod's CA away).
    ca_away: bool,
    /// A CA root rotation under way (`Istiod::rotate_ca`).
    rotation: Option<Rotation>,
    version: u64,
}

/// The stand-in: its addresses, its CA's root, its state.
pub struct Istiod {
    shared: Arc<Mutex<Shared>>,
    changed: watch::Sender<u64>,
    ca: Arc<LocalCa>,
    pub root_pem: PathBuf,
    /// Where it listens, in each namespace given.
    pub addrs: Vec<SocketAddr>,
    netns: Vec<PathBuf>,
    /// The address it binds in each namespace (its port: 0, any, until first bound).
    bind: SocketAddr,
    rt: tokio::runtime::Runtime,
    stop: Option<watch::Sender<bool>>,
    dir: PathBuf,
    /// The DNS name its serving certificate is for (istiod's Service name unless a test that
    /// the proxy checks it gives it another).
    serving_name: String,
}

impl std::fmt::Debug for Istiod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Istiod").field("addrs", &self.addrs).finish_non_exhaustive()
    }
}

impl Drop for Istiod {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn encode<M: prost::Message>(m: &M) -> Vec<u8> {
    m.encode_to_vec()
}

impl Istiod {
    /// Starts listening on 127.0.0.1 (port chosen once, kept across restarts) inside each of
    /// `netns` (paths of network namespaces).
    pub fn start(netns: &[PathBuf]) -> Result<Self> {
        Self::start_on(netns, SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// [`Self::start`] on `bind` (its IP in the serving certificate too).
    pub fn start_on(netns: &[PathBuf], bind: SocketAddr) -> Result<Self> {
        Self::start_in(std::env::temp_dir().join(crate::unique("meshpath-istiod-")), netns, bind)
    }

    /// [`Self::start_on`] with its files (CA, tokens) in `dir`, created.
    pub fn start_in(dir: PathBuf, netns: &[PathBuf], bind: SocketAddr) -> Result<Self> {
        std::fs::create_dir_all(&dir)?;
        let ca = Arc::new(LocalCa::generate("istiod stand-in CA")?);
        let (root, _) = ca.to_pem();
        let root_pem = dir.join("root-cert.pem");
        std::fs::write(&root_pem, root)?;
        let rt =
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let (changed, _) = watch::channel(0);
        let mut me = Self {
            shared: Arc::new(Mutex::new(Shared::default())),
            changed,
            ca,
            root_pem,
            addrs: Vec::new(),
            netns: netns.to_vec(),
            bind,
            rt,
            stop: None,
            dir,
            serving_name: "istiod.istio-system.svc".to_owned(),
        };
        me.listen(None)?;
        Ok(me)
    }

    /// The address the proxy in namespace `i` is given (`https://127.0.0.1:PORT`).
    pub fn url(&self, i: usize) -> String {
        format!("https://{}", self.addrs[i])
    }

    fn listen(&mut self, ports: Option<Vec<u16>>) -> Result<()> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut addrs = Vec::new();
        let serving = self.ca.issue_serving(&self.serving_name, &self.bind.ip().to_string())?;
        let mut tls = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(serving.chain.clone(), serving.key.clone_key())?;
        tls.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        for (i, ns) in self.netns.iter().enumerate() {
            let port = ports.as_ref().map_or(self.bind.port(), |p| p[i]);
            let ns = meshpath_podnet::netns::Netns::open(ns)?;
            let addr = SocketAddr::new(self.bind.ip(), port);
            let l = ns.run(|| {
                let s = socket2::Socket::new(
                    socket2::Domain::for_address(addr),
                    socket2::Type::STREAM,
                    None,
                )?;
                // Restarted on the same port while the old connections wind down, and once
                // the stopped listener's task has dropped it (it sees the stop when it runs).
                s.set_reuse_address(true)?;
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                loop {
                    match s.bind(&addr.into()) {
                        Err(e)
                            if e.kind() == std::io::ErrorKind::AddrInUse
                                && std::time::Instant::now() < deadline =>
                        {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        r => break r?,
                    }
                }
                s.listen(128)?;
                std::io::Result::Ok(std::net::TcpListener::from(s))
            })??;
            l.set_nonblocking(true)?;
            addrs.push(l.local_addr()?);
            let (conn_tx, conn_rx) = mpsc::channel::<std::io::Result<Tls>>(16);
            let acceptor = acceptor.clone();
            let mut stop = stop_rx.clone();
            let _guard = self.rt.enter();
            let listener = tokio::net::TcpListener::from_std(l)?;
            self.rt.spawn(async move {
                loop {
                    tokio::select! {
                        _ = stop.changed() => return,
                        a = listener.accept() => {
                            let Ok((tcp, _)) = a else { continue };
                            let (acceptor, tx) = (acceptor.clone(), conn_tx.clone());
                            tokio::spawn(async move {
                                if let Ok(s) = acceptor.accept(tcp).await {
                                    let _ = tx.send(Ok(Tls(s))).await;
                                }
                            });
                        }
                    }
                }
            });
            let svc = Service {
                shared: self.shared.clone(),
                changed: self.changed.subscribe(),
                ca: self.ca.clone(),
                stop: stop_rx.clone(),
            };
            let mut stop = stop_rx.clone();
            self.rt.spawn(async move {
                let _ = tonic::transport::Server::builder()
                    .add_service(AggregatedDiscoveryServiceServer::new(svc.clone()))
                    .add_service(IstioCertificateServiceServer::new(svc))
                    .serve_with_incoming_shutdown(ReceiverStream::new(conn_rx), async move {
                        let _ = stop.changed().await;
                    })
                    .await;
            });
        }
        self.addrs = addrs;
        self.stop = Some(stop_tx);
        Ok(())
    }

    /// Stops listening and ends every stream (istiod down).
    pub fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(true);
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    /// Listens again on the same addresses (istiod back).
    /// Serves from now on with a certificate for `name` (its own CA's, its address too), as an
    /// impostor with a certificate for another name would.
    pub fn serve_as(&mut self, name: &str) -> Result<()> {
        self.serving_name = name.to_owned();
        self.restart()
    }

    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        let ports = self.addrs.iter().map(SocketAddr::port).collect();
        self.listen(Some(ports))
    }

    fn put(&self, type_url: &str, name: &str, bytes: Option<Vec<u8>>) {
        {
            let mut s = self.shared.lock().expect("stand-in state");
            s.version += 1;
            let v = format!("v{}", s.version);
            match bytes {
                Some(b) => {
                    s.resources.insert((type_url.to_owned(), name.to_owned()), (v, b));
                }
                None => {
                    s.resources.remove(&(type_url.to_owned(), name.to_owned()));
                }
            }
        }
        self.changed.send_modify(|v| *v += 1);
    }

    /// Serves (or replaces) a workload, under its uid.
    pub fn set_workload(&self, w: meshpath_xds::workload::Workload) {
        let name = w.uid.clone();
        let a = meshpath_xds::workload::Address {
            r#type: Some(meshpath_xds::workload::address::Type::Workload(w)),
        };
        self.put(ADDRESS_TYPE, &name, Some(encode(&a)));
    }

    /// Serves a pod's workload as istiod does once the pod is scheduled: the workloads of pods
    /// gone before it that had one of its addresses (a pod's address is given again only once
    /// its pod is gone) are removed, in the same push.
    pub fn set_pod_workload(&self, w: meshpath_xds::workload::Workload) {
        use prost::Message as _;
        {
            let mut s = self.shared.lock().expect("stand-in state");
            let stale: Vec<(String, String)> = s
                .resources
                .iter()
                .filter(|((t, name), _)| t == ADDRESS_TYPE && *name != w.uid)
                .filter(|(_, (_, bytes))| {
                    matches!(
                        meshpath_xds::workload::Address::decode(bytes.as_slice()),
                        Ok(meshpath_xds::workload::Address {
                            r#type: Some(meshpath_xds::workload::address::Type::Workload(old)),
                        }) if old.addresses.iter().any(|a| w.addresses.contains(a))
                    )
                })
                .map(|(k, _)| k.clone())
                .collect();
            for k in stale {
                s.resources.remove(&k);
            }
            s.version += 1;
        }
        self.set_workload(w);
    }

    /// Stops serving the workloads of namespace `ns`, as istiod does once its pods are deleted.
    pub fn remove_namespace_workloads(&self, ns: &str) {
        use prost::Message as _;
        let gone: Vec<String> = {
            let s = self.shared.lock().expect("stand-in state");
            s.resources
                .iter()
                .filter(|((t, _), _)| t == ADDRESS_TYPE)
                .filter(|(_, (_, bytes))| {
                    matches!(
                        meshpath_xds::workload::Address::decode(bytes.as_slice()),
                        Ok(meshpath_xds::workload::Address {
                            r#type: Some(meshpath_xds::workload::address::Type::Workload(w)),
                        }) if w.namespace == ns
                    )
                })
                .map(|((_, name), _)| name.clone())
                .collect()
        };
        for name in gone {
            self.remove_address(&name);
        }
    }

    /// Serves (or replaces) a service, under NAMESPACE/HOSTNAME.
    pub fn set_service(&self, s: meshpath_xds::workload::Service) {
        let name = format!("{}/{}", s.namespace, s.hostname);
        let a = meshpath_xds::workload::Address {
            r#type: Some(meshpath_xds::workload::address::Type::Service(s)),
        };
        self.put(ADDRESS_TYPE, &name, Some(encode(&a)));
    }

    /// Serves an Address resource under any name, as given (bad input tests).
    pub fn set_address_raw(&self, name: &str, bytes: Vec<u8>) {
        self.put(ADDRESS_TYPE, name, Some(bytes));
    }

    /// Serves several Address resources at once (one response carries them all).
    pub fn set_addresses_raw(&self, batch: Vec<(String, Vec<u8>)>) {
        {
            let mut s = self.shared.lock().expect("stand-in state");
            for (name, bytes) in batch {
                s.version += 1;
                let v = format!("v{}", s.version);
                s.resources.insert((ADDRESS_TYPE.to_owned(), name), (v, bytes));
            }
        }
        self.changed.send_modify(|v| *v += 1);
    }

    /// Removes an Address resource.
    pub fn remove_address(&self, name: &str) {
        self.put(ADDRESS_TYPE, name, None);
    }

    /// Serves (or replaces) a policy, under NAMESPACE/NAME.
    pub fn set_policy(&self, p: meshpath_xds::security::Authorization) {
        let name = format!("{}/{}", p.namespace, p.name);
        self.put(AUTHORIZATION_TYPE, &name, Some(encode(&p)));
    }

    pub fn remove_policy(&self, name: &str) {
        self.put(AUTHORIZATION_TYPE, name, None);
    }

    /// Accepts only these bearer tokens from now on.
    pub fn require_tokens(&self, tokens: &[&str]) {
        self.shared.lock().expect("state").tokens =
            Some(tokens.iter().map(|t| (*t).to_owned()).collect());
    }

    /// Holds back (or releases) every response of `type_url`.
    pub fn withhold(&self, type_url: &str, held: bool) {
        {
            let mut s = self.shared.lock().expect("state");
            if held {
                s.withheld.insert(type_url.to_owned());
            } else {
                s.withheld.remove(type_url);
            }
        }
        self.changed.send_modify(|v| *v += 1);
    }

    /// Signs every certificate for `identity` instead of the one asked for.
    pub fn sign_wrong_san(&self, identity: Option<&str>) {
        self.shared.lock().expect("state").wrong_san = identity.map(str::to_owned);
    }

    /// Never answers a CSR for `identity` (a SPIFFE id), as a CA that hangs.
    pub fn stall_identity(&self, identity: Option<&str>) {
        self.shared.lock().expect("state").stalled = identity.map(str::to_owned);
    }

    /// Answers every CSR UNAVAILABLE (true) as an istiod whose CA is away, or signs again.
    pub fn ca_away(&self, away: bool) {
        self.shared.lock().expect("state").ca_away = away;
    }

    /// A step of a CA root rotation, as an operator rolls one out with istiod's plugged CA:
    /// certificates signed from now on by `signer` (`None`: the stand-in's own CA), and every
    /// answer's root bundle `roots` (in the chain's last element, as istiod sends it). The
    /// stand-in's serving certificate stays on its own CA.
    pub fn rotate_ca(&self, signer: Option<Arc<LocalCa>>, roots: &[&LocalCa]) {
        let bundle = roots.iter().map(|ca| ca.to_pem().0).collect();
        self.shared.lock().expect("state").rotation = Some(Rotation { signer, bundle });
    }

    /// Gives every certificate this validity.
    pub fn set_ttl(&self, ttl: Option<Duration>) {
        self.shared.lock().expect("state").ttl = ttl;
    }

    /// What the proxies have sent so far.
    pub fn received(&self) -> Vec<Received> {
        self.shared.lock().expect("state").received.clone()
    }

    /// The certificate requests so far.
    pub fn csrs(&self) -> Vec<CsrSeen> {
        self.shared.lock().expect("state").csrs.clone()
    }

    /// Waits until some received request satisfies `f`.
    pub fn wait_received(
        &self,
        limit: Duration,
        f: impl Fn(&Received) -> bool,
    ) -> Option<Received> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(r) = self.received().into_iter().find(|r| f(r)) {
                return Some(r);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Writes a token file for a proxy (`name` in the stand-in's directory); a test rewrites
    /// it to rotate the token.
    pub fn token_file(&self, name: &str, token: &str) -> Result<PathBuf> {
        let p = self.dir.join(name);
        std::fs::write(&p, token)?;
        Ok(p)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its own CA: the one it signs with unless a rotation names another (`rotate_ca`), and
    /// the one its serving certificate is from (a test's other parties, a waypoint stand-in,
    /// get certificates from it too).
    pub fn ca(&self) -> &LocalCa {
        &self.ca
    }
}

/// A TLS connection tonic can serve.
struct Tls(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

/// The client's address, for a request's handler (which node's proxy asked).
#[derive(Debug, Clone, Copy)]
struct Peer(Option<SocketAddr>);

impl tonic::transport::server::Connected for Tls {
    type ConnectInfo = Peer;
    fn connect_info(&self) -> Self::ConnectInfo {
        Peer(self.0.get_ref().0.peer_addr().ok())
    }
}

impl tokio::io::AsyncRead for Tls {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Tls {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[derive(Clone)]
struct Service {
    shared: Arc<Mutex<Shared>>,
    changed: watch::Receiver<u64>,
    ca: Arc<LocalCa>,
    /// Stopping ends the open streams too (a server's graceful shutdown would wait for them).
    stop: watch::Receiver<bool>,
}

fn header(req_meta: &tonic::metadata::MetadataMap, key: &str) -> Option<String> {
    req_meta.get(key).and_then(|v| v.to_str().ok()).map(str::to_owned)
}

impl Service {
    // tonic's own error type, returned as its handlers return it.
    #[allow(clippy::result_large_err)]
    fn authorize(&self, meta: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        let s = self.shared.lock().map_err(|_| Status::internal("state"))?;
        let Some(tokens) = &s.tokens else { return Ok(()) };
        let token = header(meta, "authorization")
            .and_then(|h| h.strip_prefix("Bearer ").map(str::to_owned))
            .ok_or_else(|| Status::unauthenticated("no bearer token"))?;
        if tokens.contains(&token) {
            Ok(())
        } else {
            Err(Status::unauthenticated("authentication failure: the token is not valid"))
        }
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Service {
    type DeltaAggregatedResourcesStream = ResponseStream;

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        self.authorize(request.metadata())?;
        let authorization = header(request.metadata(), "authorization");
        let cluster_id = header(request.metadata(), "clusterid");
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let shared = self.shared.clone();
        let mut changed = self.changed.clone();
        let mut stop = self.stop.clone();
        tokio::spawn(async move {
            // What this stream's client holds: type → name → version.
            let mut sent: HashMap<String, HashMap<String, String>> = HashMap::new();
            // Types the client subscribed to, and those whose first response went out.
            let mut subscribed: Vec<String> = Vec::new();
            let mut answered: HashSet<String> = HashSet::new();
            let mut nonce = 0u64;
            loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    r = inbound.message() => {
                        let Ok(Some(req)) = r else { return };
                        let first = !subscribed.contains(&req.type_url) && req.response_nonce.is_empty();
                        if let Ok(mut s) = shared.lock() {
                            s.received.push(Received {
                                type_url: req.type_url.clone(),
                                nonce: req.response_nonce.clone(),
                                error: req.error_detail.as_ref().map(|e| e.message.clone()),
                                initial_versions: req.initial_resource_versions.clone().into_iter().collect(),
                                node_id: req.node.as_ref().map(|n| n.id.clone()),
                                node_metadata: req.node.as_ref().and_then(|n| n.metadata.as_ref()).map(|m| m.fields.keys().cloned().collect()).unwrap_or_default(),
                                authorization: authorization.clone(),
                                cluster_id: cluster_id.clone(),
                            });
                        }
                        if first {
                            subscribed.push(req.type_url.clone());
                            sent.insert(req.type_url.clone(), req.initial_resource_versions.clone().into_iter().collect());
                            match push(&shared, &req.type_url, &mut sent, &mut nonce, &tx, true).await {
                                Pushed::Gone => return,
                                Pushed::Sent => { answered.insert(req.type_url.clone()); }
                                Pushed::Nothing => {}
                            }
                        }
                    }
                    c = changed.changed() => {
                        if c.is_err() { return }
                        for t in subscribed.clone() {
                            // A first response held back is sent once released, empty or not.
                            let initial = !answered.contains(&t);
                            match push(&shared, &t, &mut sent, &mut nonce, &tx, initial).await {
                                Pushed::Gone => return,
                                Pushed::Sent => { answered.insert(t); }
                                Pushed::Nothing => {}
                            }
                        }
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// What a push did.
enum Pushed {
    Sent,
    Nothing,
    Gone,
}

/// Sends what changed for `type_url` since the client's view `sent` (an initial response is
/// sent even when empty, as istiod does).
async fn push(
    shared: &Arc<Mutex<Shared>>,
    type_url: &str,
    sent: &mut HashMap<String, HashMap<String, String>>,
    nonce: &mut u64,
    tx: &mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>,
    initial: bool,
) -> Pushed {
    let resp = {
        let Ok(s) = shared.lock() else { return Pushed::Gone };
        if s.withheld.contains(type_url) {
            return Pushed::Nothing;
        }
        let held = sent.entry(type_url.to_owned()).or_default();
        let mut resources = Vec::new();
        let mut current = HashSet::new();
        for ((t, name), (version, bytes)) in &s.resources {
            if t != type_url {
                continue;
            }
            current.insert(name.clone());
            if held.get(name) != Some(version) {
                resources.push(Resource {
                    version: version.clone(),
                    resource: Some(prost_types::Any {
                        type_url: type_url.to_owned(),
                        value: bytes.clone(),
                    }),
                    name: name.clone(),
                    aliases: vec![],
                    ttl: None,
                });
                held.insert(name.clone(), version.clone());
            }
        }
        let removed: Vec<String> = held.keys().filter(|n| !current.contains(*n)).cloned().collect();
        for n in &removed {
            held.remove(n);
        }
        if resources.is_empty() && removed.is_empty() && !initial {
            return Pushed::Nothing;
        }
        *nonce += 1;
        DeltaDiscoveryResponse {
            system_version_info: String::new(),
            resources,
            type_url: type_url.to_owned(),
            nonce: format!("n{nonce}"),
            removed_resources: removed,
        }
    };
    if tx.send(Ok(resp)).await.is_ok() {
        Pushed::Sent
    } else {
        Pushed::Gone
    }
}

#[tonic::async_trait]
impl IstioCertificateService for Service {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        self.authorize(request.metadata())?;
        let peer = request.extensions().get::<Peer>().and_then(|p| p.0);
        let req = request.into_inner();
        let impersonated =
            req.metadata.as_ref().and_then(|m| m.fields.get(IMPERSONATED_IDENTITY)).and_then(|v| {
                match &v.kind {
                    Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                }
            });
        let params = rcgen::CertificateSigningRequestParams::from_pem(&req.csr)
            .map_err(|e| Status::invalid_argument(format!("CSR: {e}")))?;
        let sans: Vec<String> = params
            .params
            .subject_alt_names
            .iter()
            .filter_map(|s| match s {
                rcgen::SanType::URI(u) => Some(u.as_str().to_owned()),
                _ => None,
            })
            .collect();
        let (wrong, ttl, stalled, rotation) = {
            let mut s = self.shared.lock().map_err(|_| Status::internal("state"))?;
            s.csrs.push(CsrSeen {
                impersonated: impersonated.clone(),
                validity_seconds: req.validity_duration,
                sans: sans.clone(),
                peer,
            });
            if s.ca_away {
                return Err(Status::unavailable("istiod's CA is away (stand-in)"));
            }
            (s.wrong_san.clone(), s.ttl, s.stalled.clone(), s.rotation.clone())
        };
        if stalled.is_some() && stalled == impersonated {
            std::future::pending::<()>().await;
        }
        let identity = wrong
            .or(impersonated)
            .or_else(|| sans.first().cloned())
            .ok_or_else(|| Status::invalid_argument("no identity asked for"))?;
        let validity = ttl.unwrap_or(Duration::from_secs(req.validity_duration.max(1) as u64));
        let (signer, roots) = match rotation {
            Some(Rotation { signer, bundle }) => {
                (signer.unwrap_or_else(|| self.ca.clone()), bundle)
            }
            None => (self.ca.clone(), self.ca.to_pem().0),
        };
        let leaf = signer
            .sign_request(&req.csr, &identity, validity)
            .map_err(|e| Status::internal(format!("signing: {e}")))?;
        Ok(Response::new(IstioCertificateResponse { cert_chain: vec![leaf, roots] }))
    }
}

/// A namespace-wide DENY, named `name` in `namespace`, of everything from service account
/// `sa` of that namespace (its SPIFFE principal), as istiod sends an AuthorizationPolicy.
pub fn deny_from(name: &str, namespace: &str, sa: &str) -> meshpath_xds::security::Authorization {
    use meshpath_xds::security as sec;
    let principal = format!("cluster.local/ns/{namespace}/sa/{sa}");
    sec::Authorization {
        name: name.into(),
        namespace: namespace.into(),
        scope: sec::Scope::Namespace as i32,
        action: sec::Action::Deny as i32,
        rules: vec![sec::Rule {
            clauses: vec![sec::Clause {
                matches: vec![sec::Match {
                    principals: vec![sec::StringMatch {
                        match_type: Some(sec::string_match::MatchType::Exact(principal)),
                    }],
                    ..Default::default()
                }],
            }],
        }],
        ..Default::default()
    }
}
