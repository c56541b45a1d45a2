use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    process::Command,
    time::Duration,
};

use anyhow::{bail, Context as _, Result};

use crate::{sibling_bin, CgroupGuard, NetnsGuard, TestProxy};

/// `meshpath-proxy` as a node runs it: in its own "node" network namespace (so its node-wide
/// endpoints 15000/15020/15021 are its own), in `cgroup` (registered as the proxy's).
/// Field order matters: the process is killed before its namespace is deleted.
#[derive(Debug)]
pub struct NodeProxy {
    pub proxy: TestProxy,
    pub node: NetnsGuard,
}

/// Where the proxy said it listens.
fn endpoint(proxy: &TestProxy, name: &str) -> Result<SocketAddr> {
    let line = proxy
        .lines()
        .into_iter()
        .find_map(|l| l.strip_prefix(&format!("{name} ")).map(str::to_owned))
        .with_context(|| format!("the proxy printed no {name} line"))?;
    Ok(line.parse()?)
}

impl NodeProxy {
    /// Starts `meshpath-proxy ARGS…` in a new node netns, with `env` added to its environment.
    pub fn start(
        args: &[String],
        env: &[(&str, &str)],
        cgroup: &CgroupGuard,
        rust_log: &str,
    ) -> Result<Self> {
        Self::start_in(NetnsGuard::new("mp-node")?, args, env, cgroup, rust_log)
    }

    /// [`Self::start`] in a node namespace made beforehand (one something else already
    /// listens in: the istiod stand-in).
    pub fn start_in(
        node: NetnsGuard,
        args: &[String],
        env: &[(&str, &str)],
        cgroup: &CgroupGuard,
        rust_log: &str,
    ) -> Result<Self> {
        Self::start_limited(node, args, env, cgroup, rust_log, None)
    }

    /// [`Self::start_in`], the proxy run in `memory` (a [`crate::MemoryCgroup`]'s
    /// directory) when given: under its memory limit.
    pub fn start_limited(
        node: NetnsGuard,
        args: &[String],
        env: &[(&str, &str)],
        cgroup: &CgroupGuard,
        rust_log: &str,
        memory: Option<&std::path::Path>,
    ) -> Result<Self> {
        if let Some(mem) = memory {
            // A shell that joins the memory cgroup, then becomes the proxy.
            let mut cmd = Command::new("sh");
            cmd.arg("-c")
                .arg("echo $$ > \"$0/cgroup.procs\" && exec \"$@\"")
                .arg(mem)
                .arg("nsenter")
                .arg(format!("--net={}", node.path().display()))
                .arg(sibling_bin("meshpath-proxy"))
                .args(args)
                .envs(env.iter().copied())
                .env("RUST_LOG", rust_log);
            let proxy = TestProxy::spawn(cmd, cgroup)?;
            return Ok(Self { proxy, node });
        }
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", node.path().display()))
            .arg(sibling_bin("meshpath-proxy"))
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", rust_log);
        let proxy = TestProxy::spawn(cmd, cgroup)?;
        Ok(Self { proxy, node })
    }

    /// A TCP connection to the endpoint `name` (ADMIN, STATS, READINESS), from its node.
    pub fn connect_endpoint(&self, name: &str) -> Result<TcpStream> {
        let mut addr = endpoint(&self.proxy, name)?;
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        Ok(self
            .node
            .open()?
            .run(|| TcpStream::connect_timeout(&addr, Duration::from_secs(5)))??)
    }

    /// One HTTP/1.0 request to the endpoint `name` (ADMIN, STATS, READINESS); the status and
    /// the body.
    pub fn http(&self, name: &str, method: &str, path: &str) -> Result<(u16, String)> {
        Self::http_in(&self.proxy, &self.node, name, method, path)
    }

    /// `http` for a proxy process `proxy` running in `node`.
    pub fn http_in(
        proxy: &TestProxy,
        node: &NetnsGuard,
        name: &str,
        method: &str,
        path: &str,
    ) -> Result<(u16, String)> {
        let mut addr = endpoint(proxy, name)?;
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let mut conn =
            node.open()?.run(|| TcpStream::connect_timeout(&addr, Duration::from_secs(5)))??;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(conn, "{method} {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut resp = String::new();
        conn.read_to_string(&mut resp)?;
        let (head, body) = resp.split_once("\r\n\r\n").context("no HTTP header end")?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("bad status line in {head:?}"))?;
        Ok((status, body.to_owned()))
    }

    /// `GET /metrics`.
    pub fn metrics(&self) -> Result<String> {
        match self.http("STATS", "GET", "/metrics")? {
            (200, body) => Ok(body),
            (s, body) => bail!("/metrics answered {s}: {body}"),
        }
    }

    /// The sum of metric `name` over the series whose labels include every `labels` pair.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        Ok(sum_metric(&self.metrics()?, name, labels))
    }

    /// `GET /config_dump`, parsed.
    pub fn config_dump(&self) -> Result<serde_json::Value> {
        match self.http("ADMIN", "GET", "/config_dump")? {
            (200, body) => Ok(serde_json::from_str(&body)?),
            (s, body) => bail!("/config_dump answered {s}: {body}"),
        }
    }

    /// Waits up to `timeout` for `cond` on the metrics text; whether it held.
    pub fn wait_metrics(&self, timeout: Duration, cond: impl Fn(&str) -> bool) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if self.metrics().is_ok_and(|m| cond(&m)) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// How many file descriptors the proxy process holds.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.proxy.pid())).map(|d| d.count()).unwrap_or(0)
    }
}

/// The sum of metric `name` over the series of Prometheus text `text` whose labels include
/// every `labels` pair.
pub fn sum_metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
            (n == name).then_some((rest, value))
        })
        .filter(|(rest, _)| labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))))
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum()
}
