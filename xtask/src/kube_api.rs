//! A real Kubernetes API server for `cargo xtask demo --kube`: etcd from Debian's `etcd-server`
//! package and the `kube-apiserver` kubernetes.rs built, on loopback ports.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::bootstrap::run;

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
            Command::new(crate::kubernetes::binary("kube-apiserver"))
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
        cmd.args(["-sk", "--fail-with-body", "-X", method, "-H"])
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
