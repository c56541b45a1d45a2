//! The real Kubernetes API server the agent's tests run against, obtained once per machine:
//! etcd from Debian's `etcd-server` package, and `kube-apiserver` built from Debian's
//! `kubernetes` source package (its Go dependencies are vendored in it; nothing else is
//! downloaded), the way its debian/rules builds it. The binary is cached under the tool cache;
//! later runs find it and do nothing.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::bootstrap::{cache_dir, run};

/// Where the built `kube-apiserver` is kept.
pub fn kube_apiserver_path() -> PathBuf {
    cache_dir().join("kube-apiserver").join("kube-apiserver")
}

/// The Debian packages the build needs (Go, and what `make` and `apt-get source` use).
const BUILD_PACKAGES: &[&str] = &["golang-go", "rsync", "jq", "make", "dpkg-dev"];

/// Makes sure `kube-apiserver` is built and cached; returns its path.
pub fn ensure_kube_apiserver() -> Result<PathBuf> {
    let bin = kube_apiserver_path();
    if works(&bin) {
        return Ok(bin);
    }
    println!("bootstrap: building kube-apiserver from Debian's kubernetes source (about 5 minutes, once)");
    ensure_deb_src()?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(BUILD_PACKAGES)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdout(Stdio::null()))
    .context("installing the Go toolchain to build kube-apiserver")?;
    let work = cache_dir().join("kube-apiserver-build");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    run(Command::new("apt-get")
        .args(["source", "-qq", "kubernetes"])
        .current_dir(&work)
        .stdout(Stdio::null()))
    .context("apt-get source kubernetes (needs the deb-src lists added above)")?;
    let tree = fs::read_dir(&work)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.is_dir())
        .context("apt-get source unpacked no directory")?;
    // As debian/rules: a GOPATH in the tree whose k8s.io/kubernetes is the tree itself.
    let gopath = tree.join(".go");
    fs::create_dir_all(gopath.join("src/k8s.io"))?;
    let link = gopath.join("src/k8s.io/kubernetes");
    if !link.exists() {
        std::os::unix::fs::symlink("../../..", &link)?;
    }
    let make = || {
        Command::new("make")
            .arg("WHAT=cmd/kube-apiserver")
            .current_dir(&tree)
            .env("GOPATH", &gopath)
            .env("CGO_ENABLED", "0")
            // Everything is vendored: never reach for a module proxy or another toolchain.
            .env("GOPROXY", "off")
            .env("GOTOOLCHAIN", "local")
            .env("GOFLAGS", "-mod=vendor")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    // A first make that fails can leave empty generator binaries behind: start over once.
    if !make() {
        let _ = fs::remove_dir_all(tree.join("_output"));
        if !make() {
            bail!(
                "building kube-apiserver failed; run `make WHAT=cmd/kube-apiserver` in {} with \
                 GOPATH={} to see why",
                tree.display(),
                gopath.display()
            );
        }
    }
    let built = tree.join("_output/local/bin/linux/amd64/kube-apiserver");
    let dir = bin.parent().context("cache path")?;
    fs::create_dir_all(dir)?;
    fs::copy(&built, &bin).with_context(|| format!("copying {}", built.display()))?;
    let _ = fs::remove_dir_all(&work);
    if !works(&bin) {
        bail!("{} was built but does not run", bin.display());
    }
    Ok(bin)
}

fn works(bin: &Path) -> bool {
    Command::new(bin)
        .arg("--version")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Adds a `deb-src` twin of each configured Debian `deb` source (deb822 format), once.
fn ensure_deb_src() -> Result<()> {
    let ours = Path::new("/etc/apt/sources.list.d/meshpath-deb-src.sources");
    if ours.exists() {
        return Ok(());
    }
    let dir = Path::new("/etc/apt/sources.list.d");
    let mut twin = String::new();
    for entry in fs::read_dir(dir)?.flatten() {
        let p = entry.path();
        if p.extension().is_none_or(|e| e != "sources") {
            continue;
        }
        let text = fs::read_to_string(&p)?;
        for stanza in text.split("\n\n") {
            if stanza.lines().any(|l| l.trim() == "Types: deb") {
                twin.push_str(&stanza.replace("Types: deb", "Types: deb-src"));
                twin.push_str("\n\n");
            }
        }
    }
    if twin.is_empty() {
        bail!("no deb822 Debian source in {} to add a deb-src twin of", dir.display());
    }
    fs::write(ours, twin)?;
    run(Command::new("apt-get").args(["update", "-qq"]).stdout(Stdio::null()))
        .context("apt-get update after adding deb-src")
}

/// A Kubernetes API server (and its etcd) on loopback ports, for the demo: started from the
/// cached `kube-apiserver` and Debian's etcd, with one administrator token. Stopped on drop.
pub struct ApiServer {
    children: Vec<std::process::Child>,
    pub port: u16,
    token: String,
    /// A kubeconfig for the agents.
    pub kubeconfig: PathBuf,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        for mut c in self.children.drain(..).rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl ApiServer {
    /// Starts etcd and the API server with their files under `dir`; returns once it answers.
    pub fn start(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir)?;
        let (client, peer, port) = (free_port()?, free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut s = Self {
            children: Vec::new(),
            port,
            token: format!("demo-{}", std::process::id()),
            kubeconfig: dir.join("kubeconfig"),
        };
        s.children.push(
            Command::new("etcd")
                .args(["--name", "default", "--data-dir"])
                .arg(dir.join("etcd"))
                .args(["--listen-client-urls", &etcd_url, "--advertise-client-urls", &etcd_url])
                .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("default={peer_url}")])
                .stdout(Stdio::null())
                .stderr(fs::File::create(dir.join("etcd.log"))?)
                .spawn()
                .context("starting etcd")?,
        );
        fs::write(dir.join("tokens.csv"), format!("{},admin,admin,system:masters\n", s.token))?;
        let key = dir.join("sa.key");
        run(Command::new("openssl")
            .args(["genrsa", "-out"])
            .arg(&key)
            .arg("2048")
            .stderr(Stdio::null()))?;
        fs::write(
            &s.kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: demo\n  cluster:\n    server: https://127.0.0.1:{port}\n    insecure-skip-tls-verify: true\nusers:\n- name: admin\n  user:\n    token: {}\ncontexts:\n- name: demo\n  context:\n    cluster: demo\n    user: admin\ncurrent-context: demo\n",
                s.token
            ),
        )?;
        s.children.push(
            Command::new(kube_apiserver_path())
                .args(["--etcd-servers", &etcd_url, "--bind-address", "127.0.0.1"])
                .args(["--secure-port", &port.to_string(), "--insecure-port", "0"])
                .arg("--cert-dir")
                .arg(dir.join("certs"))
                .arg("--token-auth-file")
                .arg(dir.join("tokens.csv"))
                .arg("--service-account-key-file")
                .arg(&key)
                .arg("--service-account-signing-key-file")
                .arg(&key)
                .args(["--service-account-issuer", "https://kubernetes.default.svc"])
                .args([
                    "--authorization-mode",
                    "RBAC",
                    "--service-cluster-ip-range",
                    "10.96.0.0/16",
                ])
                .args(["--disable-admission-plugins", "ServiceAccount"])
                .stdout(Stdio::null())
                .stderr(fs::File::create(dir.join("apiserver.log"))?)
                .spawn()
                .context("starting kube-apiserver")?,
        );
        for _ in 0..300 {
            if s.request("GET", "/readyz", None).is_ok() {
                return Ok(s);
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        bail!("the API server did not become ready (log: {})", dir.join("apiserver.log").display())
    }

    /// One request (as the administrator); the JSON answer. `body` is JSON; PATCH is a merge
    /// patch.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<serde_json::Value> {
        let mut cmd = Command::new("curl");
        // Not curl's user agent: for it the API server pretty-prints its answers, and this
        // build's JSON encoder (json-iterator on Go 1.19) crashes the server doing so.
        cmd.args(["-sk", "-A", "meshpath-xtask", "--fail-with-body", "-X", method, "-H"])
            .arg(format!("Authorization: Bearer {}", self.token));
        if let Some(b) = body {
            let ct =
                if method == "PATCH" { "application/merge-patch+json" } else { "application/json" };
            cmd.args(["-H", &format!("Content-Type: {ct}"), "--data-binary", &b.to_string()]);
        }
        let out = cmd.arg(format!("https://127.0.0.1:{}{path}", self.port)).output()?;
        if !out.status.success() {
            bail!(
                "{method} {path}: curl {}: {} {}",
                out.status,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null))
    }
}
