//! A real Kubernetes API server for the agent's tests: etcd (Debian's) and kube-apiserver (built
//! once from Debian's source by `cargo xtask setup`), on loopback ports of their own, with a
//! token for an administrator, a kubeconfig for the agent, and a kube-rs client for the test,
//! which creates Namespaces and Pods as a user would with kubectl. There is no kubelet or
//! scheduler: tests set `spec.nodeName` and write `status.podIPs` themselves. Dropping it stops
//! both and removes their files.

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::unique;

/// Where `cargo xtask setup` keeps the kube-apiserver it built (MESHPATH_KUBE_APISERVER
/// overrides).
pub fn kube_apiserver_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("MESHPATH_KUBE_APISERVER") {
        return p.into();
    }
    let base = std::env::var_os("MESHPATH_TOOL_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from("/var/cache"))
            .join("meshpath")
    });
    base.join("kubernetes").join("kube-apiserver")
}

/// Loopback ports for etcd and the API server, `N` different ones, each free when asked. Not
/// ones the kernel hands out (`bind` to port 0, or a `connect`): between this answer and the
/// server's `bind`, any connection a parallel test makes could be given one. Below the
/// ephemeral range (`net.ipv4.ip_local_port_range`) instead, drawn at random so that tests
/// starting servers at once rarely draw the same; `KubeApi::start` starts again on others if
/// they did. A range that leaves no room below it: ports the kernel hands out, as before.
fn free_ports<const N: usize>() -> Result<[u16; N]> {
    const LOWEST: u16 = 10_000;
    const RANGE: &str = "/proc/sys/net/ipv4/ip_local_port_range";
    let range = std::fs::read_to_string(RANGE).with_context(|| format!("reading {RANGE}"))?;
    let ephemeral: u16 = range
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("{RANGE}: {range:?}"))?;
    let mut ports = [0u16; N];
    for i in 0..N {
        ports[i] = if ephemeral > LOWEST + 1_000 {
            draw_below(LOWEST, ephemeral, &ports[..i])?
        } else {
            TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()
        };
    }
    Ok(ports)
}

/// A port in `low..high`, not in `taken`, that nothing listens on now.
fn draw_below(low: u16, high: u16, taken: &[u16]) -> Result<u16> {
    for _ in 0..100 {
        let mut b = [0u8; 2];
        // SAFETY: getrandom writes at most the buffer's length into it.
        unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
        let port = low + u16::from_ne_bytes(b) % (high - low);
        if !taken.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port in {low}..{high} after 100 draws")
}

/// etcd or the API server exited while the API was awaited (most often: its port was taken).
#[derive(Debug)]
pub struct Exited {
    what: &'static str,
    status: std::process::ExitStatus,
    tail: String,
}

impl std::fmt::Display for Exited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} exited ({}) while starting:\n{}", self.what, self.status, self.tail)
    }
}

impl std::error::Error for Exited {}

/// How many times `KubeApi::start` starts etcd and the API server on new ports when they exit
/// at once (a port another test's server took first).
const START_ATTEMPTS: usize = 3;

/// The API server and its etcd.
#[derive(Debug)]
pub struct KubeApi {
    etcd: Child,
    apiserver: Option<Child>,
    pub dir: PathBuf,
    pub port: u16,
    etcd_url: String,
    token: String,
    /// A kubeconfig with the administrator's token (what the agent is given).
    pub kubeconfig: PathBuf,
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        if let Some(mut a) = self.apiserver.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
        let _ = self.etcd.kill();
        let _ = self.etcd.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl KubeApi {
    /// Starts etcd and the API server; returns once the API answers.
    pub fn start() -> Result<Self> {
        let mut attempt = 1;
        loop {
            match Self::start_once() {
                Err(e) if attempt < START_ATTEMPTS && e.is::<Exited>() => {
                    eprintln!("kube_api: {e:#}; on other ports again");
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    fn start_once() -> Result<Self> {
        let dir = std::env::temp_dir().join(unique("meshpath-kube-"));
        std::fs::create_dir_all(&dir)?;
        let [client_port, peer_port, port] = free_ports()?;
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd = Command::new("etcd")
            .args(["--name", "default", "--data-dir"])
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", &etcd_url, "--advertise-client-urls", &etcd_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("default={peer_url}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("etcd.log"))?)
            .spawn()
            .context("starting etcd (Debian's etcd-server; `cargo xtask setup` installs it)")?;
        let token = format!("meshpath-test-{}", unique("t"));
        std::fs::write(
            dir.join("tokens.csv"),
            format!("{token},admin,admin-uid,system:masters\n"),
        )?;
        let key = dir.join("sa.key");
        let out =
            Command::new("openssl").args(["genrsa", "-out"]).arg(&key).arg("2048").output()?;
        if !out.status.success() {
            bail!("openssl genrsa: {}", String::from_utf8_lossy(&out.stderr));
        }
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: https://127.0.0.1:{port}\n    insecure-skip-tls-verify: true\nusers:\n- name: admin\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: admin\ncurrent-context: test\n"
            ),
        )?;
        let mut api = Self { etcd, apiserver: None, dir, port, etcd_url, token, kubeconfig };
        api.start_apiserver()?;
        Ok(api)
    }

    /// (Re)starts the API server on the same port and etcd; waits until it answers.
    pub fn start_apiserver(&mut self) -> Result<()> {
        let bin = kube_apiserver_bin();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("apiserver.log"))?;
        let key = self.dir.join("sa.key");
        let child = Command::new(&bin)
            .args(["--etcd-servers", &self.etcd_url, "--bind-address", "127.0.0.1"])
            .args(["--secure-port", &self.port.to_string(), "--insecure-port", "0"])
            .arg("--cert-dir")
            .arg(self.dir.join("certs"))
            .arg("--token-auth-file")
            .arg(self.dir.join("tokens.csv"))
            .arg("--service-account-key-file")
            .arg(&key)
            .arg("--service-account-signing-key-file")
            .arg(&key)
            .args(["--service-account-issuer", "https://kubernetes.default.svc"])
            .args(["--authorization-mode", "RBAC", "--service-cluster-ip-range", "10.96.0.0/16"])
            .args(["--disable-admission-plugins", "ServiceAccount"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| {
                format!("starting {} (`cargo xtask setup` builds it)", bin.display())
            })?;
        self.apiserver = Some(child);
        self.wait_ready(Duration::from_secs(60))
    }

    /// Stops the API server (SIGSTOP): the kernel still accepts its connections, nothing is
    /// answered, as a server that hangs. [`KubeApi::resume_apiserver`] lets it go on.
    pub fn pause_apiserver(&self) -> Result<()> {
        self.signal_apiserver(libc::SIGSTOP)
    }

    pub fn resume_apiserver(&self) -> Result<()> {
        self.signal_apiserver(libc::SIGCONT)
    }

    fn signal_apiserver(&self, sig: libc::c_int) -> Result<()> {
        let a = self.apiserver.as_ref().context("the API server is not running")?;
        let pid = libc::pid_t::try_from(a.id())?;
        // SAFETY: kill(2) on our own child, which has not been waited for.
        if unsafe { libc::kill(pid, sig) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(())
    }

    /// Kills the API server (etcd keeps the state).
    pub fn stop_apiserver(&mut self) {
        if let Some(mut a) = self.apiserver.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
    }

    /// Waits until the API answers; fails at once, with [`Exited`], if etcd or the API server
    /// has exited meanwhile.
    fn wait_ready(&mut self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let out = Command::new("curl")
                .args(["-sk", "-o", "/dev/null", "-w", "%{http_code}", "-H"])
                .arg(format!("Authorization: Bearer {}", self.token))
                .arg(format!("https://127.0.0.1:{}/readyz", self.port))
                .output();
            let answered = out.is_ok_and(|o| o.stdout == b"200");
            // Checked even after a 200: an API server whose etcd exited (its port another
            // test's etcd held) could be answering from that other etcd.
            let apiserver = self.apiserver.as_mut().and_then(|a| a.try_wait().ok().flatten());
            for (what, status, log) in [
                ("etcd", self.etcd.try_wait().ok().flatten(), "etcd.log"),
                ("the API server", apiserver, "apiserver.log"),
            ] {
                if let Some(status) = status {
                    let tail = self.log_tail(log);
                    return Err(Exited { what, status, tail }.into());
                }
            }
            if answered {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the API server did not become ready:\n{}", self.log_tail("apiserver.log"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The last 20 lines of one of the servers' logs.
    fn log_tail(&self, log: &str) -> String {
        let log = std::fs::read_to_string(self.dir.join(log)).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// A GET as a plain `curl` makes it (curl's own user agent, for which the API server
    /// pretty-prints its JSON); the HTTP status.
    pub fn curl_get(&self, path: &str) -> Result<String> {
        let out = Command::new("curl")
            .args(["-sk", "-o", "/dev/null", "-w", "%{http_code}", "-H"])
            .arg(format!("Authorization: Bearer {}", self.token))
            .arg(format!("https://127.0.0.1:{}{path}", self.port))
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Whether the API server process is still running.
    pub fn apiserver_alive(&mut self) -> bool {
        self.apiserver.as_mut().is_some_and(|a| a.try_wait().is_ok_and(|s| s.is_none()))
    }

    /// A kube-rs client as the administrator.
    pub async fn client(&self) -> Result<kube::Client> {
        let file = kube::config::Kubeconfig::read_from(&self.kubeconfig)?;
        let config = kube::Config::from_custom_kubeconfig(file, &Default::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}
