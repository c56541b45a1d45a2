//! What a meshed pod's network namespace needs that only a privileged host process may write:
//! the reply routing for the proxy's transparent connections to the pod's apps. The proxy's
//! socket to the app is marked `0x539`; `tcp_fwmark_accept` gives the app's accepted socket the
//! same mark (`fwmark_reflect` for the kernel's resets); a rule sends that mark to table 133,
//! whose one route is `local` on `lo`: the app's replies come back to the proxy instead of
//! leaving for the real client. No netfilter rule, no conntrack.
//!
//! Run inside the pod's netns. meshpath-cni does it at ADD (it runs on the host, as root); the
//! proxy does it too where it may, and otherwise checks it is there.

use std::{io, process::Command};

use datapath_common::consts::marks;

/// Sets it up. `Ok(None)`: IPv4 and IPv6; `Ok(Some(why))`: IPv4 only (the pod has no IPv6, or
/// it failed); `Err`: not even IPv4. Idempotent.
pub fn reply_routing() -> io::Result<Option<String>> {
    for knob in ["/proc/sys/net/ipv4/tcp_fwmark_accept", "/proc/sys/net/ipv4/fwmark_reflect"] {
        std::fs::write(knob, "1").map_err(|e| io::Error::new(e.kind(), format!("{knob}: {e}")))?;
    }
    ip_batch("-4", "0.0.0.0/0")?;
    let v6 = std::fs::write("/proc/sys/net/ipv6/fwmark_reflect", "1")
        .and_then(|()| ip_batch("-6", "::/0"));
    Ok(v6.err().map(|e| e.to_string()))
}

/// Whether it is in place for IPv4 (read-only checks: what a process that may not write
/// `/proc/sys` can still see).
pub fn reply_routing_ready() -> bool {
    let accept = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_fwmark_accept")
        .is_ok_and(|v| v.trim() == "1");
    let rule = Command::new("ip")
        .args(["-4", "rule", "show", "fwmark", &mark()])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout).contains(&format!("lookup {}", marks::REPLY_TABLE))
        });
    accept && rule
}

fn mark() -> String {
    format!("{:#x}/{:#x}", marks::PROXY_SOCKET, marks::PROXY_SOCKET_MASK)
}

/// `ip FAMILY -force -batch -`: the rule (deleted first: `rule add` would duplicate it) and the
/// `local` route of the reply table.
fn ip_batch(family: &str, any: &str) -> io::Result<()> {
    let (mark, table) = (mark(), marks::REPLY_TABLE);
    let batch = format!(
        "rule del fwmark {mark} lookup {table}\nrule add fwmark {mark} lookup {table}\nroute replace local {any} dev lo table {table}\n"
    );
    let mut child = Command::new("ip")
        .args([family, "-force", "-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        io::Write::write_all(&mut stdin, batch.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    // The expected failure of the first `rule del` (nothing to delete) aside, any error counts.
    let real: Vec<&str> = err
        .lines()
        .filter(|l| {
            !l.trim().is_empty()
                && !l.contains("No such file or directory")
                && !l.starts_with("Command failed")
        })
        .collect();
    if real.is_empty() {
        Ok(())
    } else {
        Err(io::Error::other(format!("ip {family}: {}", real.join("; "))))
    }
}
