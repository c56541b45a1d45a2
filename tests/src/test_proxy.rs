//! `meshpath-test-proxy` (or another proxy binary) run in a pod's netns and cgroup, its output
//! collected.

use std::{path::Path, process::Command};

use anyhow::{Context as _, Result};

use crate::CgroupGuard;

/// `meshpath-test-proxy` running inside a pod's netns, in its own cgroup registered as the
/// proxy's; killed on drop. Its stdout lines are collected.
#[derive(Debug)]
pub struct TestProxy {
    child: std::process::Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl TestProxy {
    /// Starts `meshpath-test-proxy` (`mode` is `echo` or `forward`) and waits until it
    /// listens. With `inbound` it also listens on the inbound port (the datapath finds it).
    pub fn start(
        bin: &Path,
        netns: &Path,
        cgroup: &CgroupGuard,
        mode: &str,
        inbound: bool,
        envs: &[(&str, &str)],
    ) -> Result<Self> {
        let mut cmd = Command::new(bin);
        cmd.arg(netns).arg(mode).args(inbound.then_some("inbound")).envs(envs.iter().copied());
        Self::spawn(cmd, cgroup)
    }

    /// Starts `cmd` in `cgroup` and waits for its `READY` line (any program that prints one);
    /// its log lines are shown as `proxy: …`.
    pub fn spawn(cmd: Command, cgroup: &CgroupGuard) -> Result<Self> {
        Self::spawn_as("proxy", cmd, cgroup)
    }

    /// As [`TestProxy::spawn`], its log lines shown as `LABEL: …` (the node agent's as
    /// `agent: …`).
    pub fn spawn_as(label: &'static str, cmd: Command, cgroup: &CgroupGuard) -> Result<Self> {
        let (proxy, ready) = Self::launch(label, cmd, cgroup)?;
        // A bound on start-up, not a timing: an agent loading the datapath under QEMU's TCG
        // on a busy machine once took past 10 s (CI's 6.1 guest, cni.rs).
        ready
            .recv_timeout(std::time::Duration::from_secs(30))
            .with_context(|| format!("the {label} did not become ready"))?;
        Ok(proxy)
    }

    /// As [`TestProxy::spawn`], without waiting for `READY` (a proxy a test expects never to
    /// get there).
    pub fn spawn_unready(cmd: Command, cgroup: &CgroupGuard) -> Result<Self> {
        Ok(Self::launch("proxy", cmd, cgroup)?.0)
    }

    /// Starts `cmd` in `cgroup`; the receiver gets its `READY` line.
    fn launch(
        label: &'static str,
        mut cmd: Command,
        cgroup: &CgroupGuard,
    ) -> Result<(Self, std::sync::mpsc::Receiver<()>)> {
        use std::{io::BufRead as _, os::fd::AsRawFd as _, os::unix::process::CommandExt as _};
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(cgroup.path().join("cgroup.procs"))
            .context("opening cgroup.procs")?;
        let procs_fd = procs.as_raw_fd();
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        // SAFETY: only write(2) between fork and exec, on an fd open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::write(procs_fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().with_context(|| format!("starting the {label}"))?;
        drop(procs);
        let stdout = child.stdout.take().with_context(|| format!("{label} stdout"))?;
        let stderr = child.stderr.take().with_context(|| format!("{label} stderr"))?;
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        // Its logs: kept with the lines (tests read access logs) and shown if the test fails.
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("{label}: {line}");
                sink.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                if line == "READY" {
                    let _ = ready_tx.send(());
                }
                sink.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        });
        Ok((Self { child, lines }, ready_rx))
    }

    /// Lines printed so far (stdout and stderr).
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits up to `timeout` for a line starting with `prefix`; whether one came.
    pub fn wait_for_line(&self, prefix: &str, timeout: std::time::Duration) -> bool {
        crate::wait_until(timeout, || self.lines().iter().any(|l| l.starts_with(prefix)))
    }

    /// Waits up to `timeout` for a line containing `needle`; whether one came.
    pub fn wait_for_text(&self, needle: &str, timeout: std::time::Duration) -> bool {
        crate::wait_until(timeout, || self.lines().iter().any(|l| l.contains(needle)))
    }

    /// The proxy's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` to the proxy process.
    pub fn signal(&self, signal: libc::c_int) -> std::io::Result<()> {
        // SAFETY: kill(2) on our own child's pid.
        if unsafe { libc::kill(self.child.id() as libc::pid_t, signal) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits up to `timeout` for the process to exit; whether it did.
    pub fn wait_exit(&mut self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        false
    }

    /// Stops the proxy now.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        self.stop();
    }
}
