//! Two "nodes", each a `meshpath-proxy` process in its own node netns (both in one cgroup
//! registered as the proxy's): pod a on node 1 with outbound capture, pod b on node 2. Every
//! certificate comes from a CA made now. Each node's workload file can be rewritten while it
//! runs.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    thread::JoinHandle,
    time::Duration,
};

use meshpath_loader::pods::{self, EnrolOptions};
use meshpath_proxy::identity::{Identity, LocalCa};

use super::{require_root, unique, CgroupGuard, NodeProxy, PinRoot, PodPair};

/// How node 1 sees pod b.
#[derive(Debug, Clone, Copy)]
pub struct View {
    pub b_protocol: &'static str,
    pub b_service_account: &'static str,
    /// Whether pod b's inbound plaintext is captured (to node 2's proxy on 15006).
    pub b_inbound_captured: bool,
    /// Pod b's waypoint, as the workloads file writes one (`{destination: …}`).
    pub b_waypoint: Option<&'static str>,
}

/// Pod b meshed, as it is.
pub const MESHED: View = View {
    b_protocol: "HBONE",
    b_service_account: "sa-b",
    b_inbound_captured: false,
    b_waypoint: None,
};

/// Where [`TwoNodes::waypoint`] puts the waypoint stand-in.
pub const WAYPOINT_IP: &str = "10.198.0.2";

/// The waypoint stand-in (tests/waypoint-standin) in a netns of its own, joined to
/// pod a by one veth (10.198.0.0/24) and to pod b by another (10.197.0.0/24); its identity is
/// `sa-waypoint`. Field order: the process dies before its netns goes.
#[derive(Debug)]
pub struct WaypointStandIn {
    pub process: crate::TestProxy,
    _cgroup: CgroupGuard,
    pub netns: crate::NetnsGuard,
}

impl WaypointStandIn {
    /// The stand-in in `netns` (its network set up by the caller) on `WAYPOINT_IP`:15008, as
    /// `sa-waypoint` with a certificate from `ca` (written into `dir`), its onward HBONE peers
    /// verified as `upstream_sa`, with `routes` (`FROM=TO`).
    pub fn spawn(
        netns: crate::NetnsGuard,
        dir: &std::path::Path,
        ca: &meshpath_proxy::identity::LocalCa,
        upstream_sa: &str,
        routes: &[String],
    ) -> Self {
        let dir = |f: &str| dir.join(f).display().to_string();
        let (cert, key) = ca.to_pem();
        std::fs::write(dir("waypoint-ca.pem"), cert).expect("waypoint CA");
        std::fs::write(dir("waypoint-ca-key.pem"), key).expect("waypoint CA key");
        let mut cmd = std::process::Command::new("ip");
        cmd.args(["netns", "exec", netns.name()])
            .arg(crate::sibling_bin("waypoint-standin"))
            .arg(format!("{WAYPOINT_IP}:15008"))
            .args([dir("waypoint-ca.pem"), dir("waypoint-ca-key.pem")])
            .args(["sa-waypoint", upstream_sa])
            .args(routes);
        let cgroup = CgroupGuard::new().expect("waypoint cgroup");
        let process =
            crate::TestProxy::spawn_as("waypoint", cmd, &cgroup).expect("the waypoint stand-in");
        WaypointStandIn { process, _cgroup: cgroup, netns }
    }
}

/// What a test changes.
#[derive(Debug, Clone)]
pub struct Setup {
    pub view: View,
    /// Arguments given to both proxies.
    pub args: Vec<String>,
    /// Arguments given to node 1's proxy only (after `args`; name no flag of `args` again).
    pub node1_args: Vec<String>,
    /// YAML appended to both nodes' workload files (services, policies).
    pub yaml: String,
    /// Certificates from files (`--cert-dir`) rather than the local CA.
    pub cert_files: bool,
    /// Whether pod a's DNS is captured.
    pub capture_dns: bool,
    /// Destination ports pod a's outbound capture leaves alone: pod a then plays a client
    /// outside the mesh for them.
    pub a_exclude_outbound_ports: Vec<u16>,
    /// Environment given to both proxies (allocator settings, for instance).
    pub proxy_env: Vec<(&'static str, &'static str)>,
    /// Workloads, policies and certificates from the istiod stand-in (`TwoNodes::istiod`)
    /// rather than from files and a local CA: both proxies in xDS mode.
    pub istiod: bool,
    /// Run on the stand-in before the proxies start (what it refuses, holds back, signs).
    pub istiod_before: Option<fn(&crate::istiod::Istiod)>,
    /// Node 1's proxy runs under this memory limit (bytes), in a memory cgroup of its own.
    pub memory_limit: Option<u64>,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            view: MESHED,
            args: Vec::new(),
            node1_args: Vec::new(),
            yaml: String::new(),
            cert_files: false,
            capture_dns: false,
            a_exclude_outbound_ports: Vec::new(),
            proxy_env: Vec::new(),
            istiod: false,
            istiod_before: None,
            memory_limit: None,
        }
    }
}

/// The two nodes. Dropping it stops the proxies and removes namespaces, pins and files.
#[derive(Debug)]
pub struct TwoNodes {
    pub proxies: Vec<NodeProxy>,
    /// The proxies' cgroup, registered as the proxy's.
    pub cgroup: CgroupGuard,
    pub pods: PodPair,
    _root: PinRoot,
    pub ca: LocalCa,
    pub dir: PathBuf,
    /// The istiod stand-in both proxies follow, with `Setup::istiod`.
    pub istiod: Option<crate::istiod::Istiod>,
    /// The proxies' memory cgroups (`Setup::memory_limit`), removed after them.
    _memory: Vec<crate::MemoryCgroup>,
}

impl Drop for TwoNodes {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The identity of pod a and of pod b as node 2 knows it.
pub fn sa(name: &str) -> Identity {
    Identity::new("cluster.local", "default", name)
}

impl TwoNodes {
    pub fn new(view: View) -> Self {
        Self::start(Setup { view, ..Setup::default() })
    }

    /// The workload file of a node that sees pod b as `view`, plus `extra`.
    pub fn workloads(&self, view: &View, extra: &str) -> String {
        let p = &self.pods;
        format!(
            "workloads:\n\
             - uid: pod-a\n  name: app-a\n  namespace: default\n  serviceAccount: sa-a\n  protocol: HBONE\n  workloadIps: [\"{}\", \"{}\"]\n\
             - uid: pod-b\n  name: app-b\n  namespace: default\n  serviceAccount: {}\n  protocol: {}\n  workloadIps: [\"{}\", \"{}\"]\n  services: {{\"default/b.default.svc.cluster.local\": {{80: 8090}}}}\n{}{extra}",
            p.a_ip,
            p.a_ip6,
            view.b_service_account,
            view.b_protocol,
            p.b_ip,
            p.b_ip6,
            view.b_waypoint.map(|w| format!("  waypoint: {w}\n")).unwrap_or_default()
        )
    }

    /// Pod a and pod b as istiod describes them (pod b as `view`), for the stand-in.
    pub fn xds_workloads(&self, view: &View) -> Vec<meshpath_xds::workload::Workload> {
        let p = &self.pods;
        let w = |uid: &str, name: &str, sa: &str, hbone: bool, ips: [std::net::IpAddr; 2]| {
            meshpath_xds::workload::Workload {
                uid: uid.into(),
                name: name.into(),
                namespace: "default".into(),
                service_account: sa.into(),
                addresses: ips
                    .iter()
                    .map(|ip| match ip {
                        std::net::IpAddr::V4(v4) => v4.octets().to_vec().into(),
                        std::net::IpAddr::V6(v6) => v6.octets().to_vec().into(),
                    })
                    .collect(),
                tunnel_protocol: if hbone {
                    meshpath_xds::workload::TunnelProtocol::Hbone as i32
                } else {
                    meshpath_xds::workload::TunnelProtocol::None as i32
                },
                workload_name: name.into(),
                ..Default::default()
            }
        };
        vec![
            w("pod-a", "app-a", "sa-a", true, [p.a_ip.into(), p.a_ip6.into()]),
            w(
                "pod-b",
                "app-b",
                view.b_service_account,
                view.b_protocol == "HBONE",
                [p.b_ip.into(), p.b_ip6.into()],
            ),
        ]
    }

    /// Starts the waypoint stand-in ([`WaypointStandIn`]): what it is sent it carries on to
    /// pod b over HBONE (`routes`, `FROM=TO`: a VIP to pod b's address and port).
    pub fn waypoint(&self, routes: &[String]) -> WaypointStandIn {
        let netns = crate::NetnsGuard::new("mpw").expect("waypoint netns");
        let (a, b, w) = (&self.pods.a, &self.pods.b, &netns);
        let b_ip = format!("{}/32", self.pods.b_ip);
        let steps: [(&crate::NetnsGuard, &[&str]); 13] = [
            (a, &["link", "add", "wpa", "type", "veth", "peer", "name", "wp0", "netns", w.name()]),
            (a, &["addr", "add", "10.198.0.1/24", "dev", "wpa"]),
            (a, &["link", "set", "wpa", "up"]),
            (w, &["addr", "add", "10.198.0.2/24", "dev", "wp0"]),
            (w, &["link", "set", "wp0", "up"]),
            (w, &["link", "set", "lo", "up"]),
            (w, &["link", "add", "wp1", "type", "veth", "peer", "name", "wpb", "netns", b.name()]),
            (w, &["addr", "add", "10.197.0.1/24", "dev", "wp1"]),
            (w, &["link", "set", "wp1", "up"]),
            (b, &["addr", "add", "10.197.0.2/24", "dev", "wpb"]),
            (b, &["link", "set", "wpb", "up"]),
            // Onward connections leave from the waypoint's own address, as from a pod.
            (w, &["route", "add", &b_ip, "via", "10.197.0.2", "src", WAYPOINT_IP]),
            (b, &["route", "add", "10.198.0.2/32", "via", "10.197.0.1"]),
        ];
        for (ns, args) in steps {
            ns.ip(args).expect("waypoint network");
        }
        // Its certificate from the CA the proxies trust: the istiod stand-in's, or the local one.
        let ca = self.istiod.as_ref().map_or(&self.ca, |i| i.ca());
        WaypointStandIn::spawn(netns, &self.dir, ca, "sa-b", routes)
    }

    /// Whether proxy `i` (0 or 1) answers its readiness probe with 200. Configured by istiod,
    /// a proxy says `READY` before it serves its pods (that waits for istiod's first answers);
    /// ready, it serves them.
    pub fn ready(&self, i: usize) -> bool {
        self.proxies[i].http("READINESS", "GET", "/healthz/ready").is_ok_and(|(s, _)| s == 200)
    }

    /// Waits up to `within` until both proxies are ready ([`TwoNodes::ready`]).
    pub fn wait_ready(&self, within: Duration) -> bool {
        crate::wait_until(within, || self.ready(0) && self.ready(1))
    }

    /// The istiod stand-in (`Setup::istiod`).
    pub fn istiod(&self) -> &crate::istiod::Istiod {
        self.istiod.as_ref().expect("started with Setup::istiod")
    }

    /// Rewrites node `n`'s (1 or 2) workload file.
    pub fn write_workloads(&self, n: usize, text: &str) {
        // Written aside and renamed: the proxy never reads half a file.
        let tmp = self.dir.join(format!("node{n}.yaml.tmp"));
        std::fs::write(&tmp, text).expect("write workloads");
        std::fs::rename(&tmp, self.dir.join(format!("node{n}.yaml"))).expect("rename workloads");
    }

    /// Writes the trust bundle both proxies read (files mode): `roots`, aside and renamed.
    pub fn write_trust_bundle(&self, roots: &[&LocalCa]) {
        let pem: String = roots.iter().map(|ca| ca.to_pem().0).collect();
        let tmp = self.dir.join("ca.pem.tmp");
        std::fs::write(&tmp, pem).expect("bundle");
        std::fs::rename(&tmp, self.dir.join("ca.pem")).expect("bundle");
    }

    /// Writes `id`'s certificate files (files mode), valid for `validity`.
    pub fn write_cert_files(&self, id: &Identity, validity: Duration) {
        self.write_cert(id, &self.ca.issue(id, validity).expect("cert"));
    }

    /// Writes `cert` as `id`'s certificate files (files mode).
    pub fn write_cert(&self, id: &Identity, cert: &meshpath_proxy::identity::WorkloadCert) {
        let d = self.dir.join("certs").join(&id.namespace).join(&id.service_account);
        std::fs::create_dir_all(&d).expect("cert dir");
        let (chain, key) = cert.to_pem();
        std::fs::write(d.join("cert-chain.pem.tmp"), chain).expect("chain");
        std::fs::write(d.join("key.pem.tmp"), key).expect("key");
        std::fs::rename(d.join("key.pem.tmp"), d.join("key.pem")).expect("key");
        std::fs::rename(d.join("cert-chain.pem.tmp"), d.join("cert-chain.pem")).expect("chain");
    }

    pub fn start(setup: Setup) -> Self {
        require_root();
        let (pods, root, cgroup) =
            (PodPair::new().expect("pods"), PinRoot::new(), CgroupGuard::new().expect("cgroup"));
        {
            let dp = root.datapath().expect("datapath");
            dp.register_proxy_cgroup(cgroup.path()).expect("proxy cgroup");
            let no_counters = EnrolOptions { counters: false, ..EnrolOptions::default() };
            pods::enrol(
                &dp,
                &pods.a.open().expect("a"),
                &EnrolOptions {
                    capture_outbound: true,
                    capture_dns: setup.capture_dns,
                    exclude_outbound_ports: setup.a_exclude_outbound_ports.clone(),
                    ..no_counters.clone()
                },
            )
            .expect("enrol a");
            let b = EnrolOptions { capture_inbound: setup.view.b_inbound_captured, ..no_counters };
            pods::enrol(&dp, &pods.b.open().expect("b"), &b).expect("enrol b");
        }
        let dir = std::env::temp_dir().join(unique("meshpath-hbone-"));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let ca = LocalCa::generate("meshpath test CA").expect("CA");
        let mut nodes = Self {
            proxies: Vec::new(),
            cgroup,
            pods,
            _root: root,
            ca,
            dir,
            istiod: None,
            _memory: Vec::new(),
        };
        let (cert_pem, key_pem) = nodes.ca.to_pem();
        std::fs::write(nodes.dir.join("ca.pem"), cert_pem).expect("ca.pem");
        std::fs::write(nodes.dir.join("ca-key.pem"), key_pem).expect("ca-key.pem");
        nodes.write_workloads(1, &nodes.workloads(&setup.view, &setup.yaml));
        nodes.write_workloads(2, &nodes.workloads(&MESHED, &setup.yaml));
        if setup.cert_files {
            nodes.write_cert_files(&sa("sa-a"), Duration::from_secs(3600));
            nodes.write_cert_files(&sa("sa-b"), Duration::from_secs(3600));
        }
        let node_ns: Vec<super::NetnsGuard> =
            (0..2).map(|_| super::NetnsGuard::new("mp-node").expect("node netns")).collect();
        if setup.istiod {
            let paths: Vec<PathBuf> = node_ns.iter().map(super::NetnsGuard::path).collect();
            let istiod = crate::istiod::Istiod::start(&paths).expect("istiod stand-in");
            for w in nodes.xds_workloads(&setup.view) {
                istiod.set_workload(w);
            }
            if let Some(before) = setup.istiod_before {
                before(&istiod);
            }
            nodes.istiod = Some(istiod);
        }
        for ((node, pod), node_netns) in
            [("node1", "pod-a"), ("node2", "pod-b")].into_iter().zip(node_ns)
        {
            let ns = if pod == "pod-a" { &nodes.pods.a } else { &nodes.pods.b };
            let p = |p: PathBuf| p.display().to_string();
            let mut args: Vec<String> = Vec::new();
            if let Some(istiod) = &nodes.istiod {
                let i = usize::from(node == "node2");
                let token =
                    istiod.token_file(&format!("{node}-token"), "node-token").expect("token");
                args.extend([
                    "--xds-address".into(),
                    istiod.url(i),
                    "--ca-address".into(),
                    istiod.url(i),
                    "--xds-root-ca".into(),
                    p(istiod.root_pem.clone()),
                    "--ca-root-ca".into(),
                    p(istiod.root_pem.clone()),
                    "--alt-xds-hostname".into(),
                    "istiod.istio-system.svc".into(),
                    "--alt-ca-hostname".into(),
                    "istiod.istio-system.svc".into(),
                    "--auth-token".into(),
                    p(token),
                    "--cluster-id".into(),
                    "Kubernetes".into(),
                ]);
            } else {
                args.extend(["--workloads".into(), p(nodes.dir.join(format!("{node}.yaml")))]);
            }
            if setup.cert_files && !setup.istiod {
                args.extend([
                    "--cert-dir".into(),
                    p(nodes.dir.join("certs")),
                    "--trust-bundle".into(),
                    p(nodes.dir.join("ca.pem")),
                ]);
            } else if !setup.istiod {
                args.extend([
                    "--ca-cert".into(),
                    p(nodes.dir.join("ca.pem")),
                    "--ca-key".into(),
                    p(nodes.dir.join("ca-key.pem")),
                ]);
            }
            args.extend([
                "--pod".into(),
                format!("{pod}={}", ns.path().display()),
                "--refresh-ms".into(),
                "100".into(),
            ]);
            args.extend(setup.args.iter().cloned());
            if node == "node1" {
                args.extend(setup.node1_args.iter().cloned());
            }
            let memory = setup
                .memory_limit
                .filter(|_| node == "node1")
                .map(|l| crate::MemoryCgroup::new(l).expect("memory cgroup"));
            nodes.proxies.push(
                NodeProxy::start_limited(
                    node_netns,
                    &args,
                    &setup.proxy_env,
                    &nodes.cgroup,
                    "info",
                    memory.as_ref().map(crate::MemoryCgroup::path),
                )
                .expect("meshpath-proxy"),
            );
            nodes._memory.extend(memory);
        }
        nodes
    }

    pub fn a(&self, v6: bool, port: u16) -> SocketAddr {
        SocketAddr::new(if v6 { self.pods.a_ip6.into() } else { self.pods.a_ip.into() }, port)
    }

    pub fn b(&self, v6: bool, port: u16) -> SocketAddr {
        SocketAddr::new(if v6 { self.pods.b_ip6.into() } else { self.pods.b_ip.into() }, port)
    }

    /// An HBONE connection to pod b, as another node's proxy would open one: from pod b's netns
    /// (not captured), presenting `cert`, expecting pod b to be `sa-b`.
    pub async fn hbone_conn_to_b(
        &self,
        cert: &meshpath_proxy::identity::WorkloadCert,
    ) -> Result<meshpath_proxy::proxy::hbone::Connection, meshpath_proxy::proxy::hbone::HboneError>
    {
        self.hbone_conn_to_b_trusting(cert, std::slice::from_ref(&self.ca.cert_der)).await
    }

    /// [`Self::hbone_conn_to_b`], checking node 2's certificate against `roots` (a CA root
    /// rotation's), not the test's CA alone.
    async fn hbone_conn_to_b_trusting(
        &self,
        cert: &meshpath_proxy::identity::WorkloadCert,
        roots: &[rustls::pki_types::CertificateDer<'static>],
    ) -> Result<meshpath_proxy::proxy::hbone::Connection, meshpath_proxy::proxy::hbone::HboneError>
    {
        let gateway = self.b(false, 15008);
        let std = self
            .pods
            .b
            .open()
            .expect("b")
            .run(|| TcpStream::connect(gateway))
            .expect("netns")
            .expect("tcp");
        self.hbone_handshake_to_b(std, cert, roots).await
    }

    /// [`Self::hbone_to_b`] with [`Self::hbone_conn_to_b_trusting`]'s `roots`.
    pub async fn hbone_to_b_trusting(
        &self,
        cert: &meshpath_proxy::identity::WorkloadCert,
        roots: &[rustls::pki_types::CertificateDer<'static>],
        dst: SocketAddr,
    ) -> Result<(), meshpath_proxy::proxy::hbone::HboneError> {
        let conn = self.hbone_conn_to_b_trusting(cert, roots).await?;
        let gateway = self.b(false, 15008);
        meshpath_proxy::proxy::hbone::open_stream(conn, gateway, dst, &Default::default())
            .await
            .map(drop)
    }

    /// An HBONE connection to pod b's 15008 from pod a's address, made as node 1's proxy
    /// makes it (from the proxies' cgroup, so not captured), with `cert`.
    pub async fn hbone_conn_from_a(
        &self,
        cert: &meshpath_proxy::identity::WorkloadCert,
    ) -> Result<meshpath_proxy::proxy::hbone::Connection, meshpath_proxy::proxy::hbone::HboneError>
    {
        let std = self
            .pods
            .a
            .connect_in_cgroup(self.b(false, 15008), &self.cgroup)
            .expect("TCP from pod a to pod b's 15008");
        let roots = std::slice::from_ref(&self.ca.cert_der);
        self.hbone_handshake_to_b(std, cert, roots).await
    }

    /// TLS and HTTP/2 over `std`, a TCP connection to pod b's 15008, as a client with `cert`
    /// that trusts `roots`.
    async fn hbone_handshake_to_b(
        &self,
        std: TcpStream,
        cert: &meshpath_proxy::identity::WorkloadCert,
        roots: &[rustls::pki_types::CertificateDer<'static>],
    ) -> Result<meshpath_proxy::proxy::hbone::Connection, meshpath_proxy::proxy::hbone::HboneError>
    {
        let gateway = self.b(false, 15008);
        let config = meshpath_proxy::identity::tls::client_config(cert, roots, vec![sa("sa-b")])
            .expect("client config");
        std.set_nonblocking(true).expect("nonblocking");
        let tcp = tokio::net::TcpStream::from_std(std).expect("tokio");
        meshpath_proxy::proxy::hbone::handshake(tcp, gateway, config).await
    }

    /// One HBONE CONNECT to `dst` on a new connection (see [`Self::hbone_conn_to_b`]).
    pub async fn hbone_to_b(
        &self,
        cert: &meshpath_proxy::identity::WorkloadCert,
        dst: SocketAddr,
    ) -> Result<(), meshpath_proxy::proxy::hbone::HboneError> {
        self.hbone_to_b_trusting(cert, std::slice::from_ref(&self.ca.cert_der), dst).await
    }

    /// An echo server in pod b for one connection; returns the address it was connected from.
    pub fn echo_in_b(&self, addr: SocketAddr) -> JoinHandle<std::io::Result<SocketAddr>> {
        let l = self.pods.b.listen(addr).expect("bind");
        std::thread::spawn(move || {
            let (c, peer) = l.accept()?;
            echo(c)?;
            Ok(peer)
        })
    }

    /// An echo server in pod b for any number of connections, until the test ends.
    pub fn echo_server_in_b(&self, addr: SocketAddr) {
        let l: TcpListener = self.pods.b.listen(addr).expect("bind");
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                std::thread::spawn(move || echo(c));
            }
        });
    }

    /// An echo server in pod b for any number of connections, counting those it accepted: a
    /// check that a connection must not reach the app reads it.
    pub fn counting_echo_server_in_b(
        &self,
        addr: SocketAddr,
    ) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
        let l: TcpListener = self.pods.b.listen(addr).expect("bind");
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c = count.clone();
        std::thread::spawn(move || {
            for conn in l.incoming().flatten() {
                c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                std::thread::spawn(move || echo(conn));
            }
        });
        count
    }

    /// A connection from the app in pod a to `dst` (captured).
    pub fn connect_from_a(&self, dst: SocketAddr) -> std::io::Result<TcpStream> {
        let c = self
            .pods
            .a
            .open()
            .expect("a")
            .run(|| TcpStream::connect_timeout(&dst, Duration::from_secs(5)))
            .expect("netns")?;
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(c)
    }

    /// The app in pod a: sends `payload` to `dst`, returns what came back.
    pub fn app_round_trip(&self, dst: SocketAddr, payload: &[u8]) -> std::io::Result<Vec<u8>> {
        let mut conn = self.connect_from_a(dst)?;
        let mut w = conn.try_clone()?;
        let p = payload.to_vec();
        let writer = std::thread::spawn(move || -> std::io::Result<()> {
            w.write_all(&p)?;
            w.shutdown(std::net::Shutdown::Write)
        });
        let mut back = Vec::new();
        conn.read_to_end(&mut back)?;
        let _ = writer.join();
        Ok(back)
    }
}

fn echo(mut c: TcpStream) -> std::io::Result<()> {
    let mut buf = [0u8; 65536];
    loop {
        match c.read(&mut buf)? {
            0 => return Ok(()),
            n => c.write_all(&buf[..n])?,
        }
    }
}
