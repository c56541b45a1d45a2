//! The reply routing a meshed pod's netns needs for the proxy's transparent connections to the
//! pod's apps (the proxy connecting with the client's address as source, as ztunnel does). The
//! datapath marks such a connection's socket `marks::REPLY` (0x111) from `sock_ops`;
//! `tcp_fwmark_accept` gives the app's accepted socket the SYN's mark (`fwmark_reflect` does the
//! same for the kernel's resets and ICMP errors); the rule `fwmark 0x111/0xfff lookup 133`
//! sends that mark to table 133, whose one route is `local` on `lo`: the app's replies come
//! back to the proxy instead of leaving for the real client. It is istio-cni's table-100 rule,
//! keyed on the same value; no netfilter rule, no conntrack. The proxy's own mark (ztunnel's
//! 0x539) has no rule: its HBONE, passthrough and 15008 packets route normally.
//!
//! Run inside the pod's netns (see `netns::Netns::run`). The node agent sets it up when it
//! enrols a pod and removes it when the pod leaves the mesh; the proxy never needs to.

use std::{io, process::Command};

use datapath_common::consts::marks;

/// The sysctls set to 1 in the pod (IPv4; IPv6 shares `tcp_fwmark_accept` with IPv4).
const SYSCTLS_V4: [&str; 2] =
    ["/proc/sys/net/ipv4/tcp_fwmark_accept", "/proc/sys/net/ipv4/fwmark_reflect"];
const SYSCTL_V6: &str = "/proc/sys/net/ipv6/fwmark_reflect";

/// Sets it up in the calling thread's netns. `Ok(None)`: IPv4 and IPv6; `Ok(Some(why))`: IPv4
/// only (the pod has no IPv6, or it failed); `Err`: not even IPv4. Idempotent.
pub fn set_up() -> io::Result<Option<String>> {
    for knob in SYSCTLS_V4 {
        std::fs::write(knob, "1").map_err(|e| io::Error::new(e.kind(), format!("{knob}: {e}")))?;
    }
    ip_batch("-4", &batch("0.0.0.0/0", true))?;
    let v6 = std::fs::write(SYSCTL_V6, "1").and_then(|()| ip_batch("-6", &batch("::/0", true)));
    Ok(v6.err().map(|e| e.to_string()))
}

/// Removes the rule and the table's route (the sysctls stay: with no marked socket they change
/// nothing). Missing pieces are not errors.
pub fn remove() -> io::Result<()> {
    ip_batch("-4", &batch("0.0.0.0/0", false))?;
    // A pod without IPv6 has nothing to remove there.
    let _ = ip_batch("-6", &batch("::/0", false));
    Ok(())
}

/// Whether it is in place for IPv4 (read-only checks).
pub fn is_set_up() -> bool {
    let accept = std::fs::read_to_string(SYSCTLS_V4[0]).is_ok_and(|v| v.trim() == "1");
    let rule = Command::new("ip")
        .args(["-4", "rule", "show", "fwmark", &mark()])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout).contains(&format!("lookup {}", marks::REPLY_TABLE))
        });
    accept && rule
}

/// `0x111/0xfff`.
pub fn mark() -> String {
    format!("{:#x}/{:#x}", marks::REPLY, marks::REPLY_MASK)
}

/// The `ip -batch` lines: the rule deleted first (`rule add` would duplicate it), then added
/// again with the table's `local` route when `add`.
fn batch(any: &str, add: bool) -> String {
    let (mark, table) = (mark(), marks::REPLY_TABLE);
    let mut b = format!("rule del fwmark {mark} lookup {table}\n");
    if add {
        b.push_str(&format!(
            "rule add fwmark {mark} lookup {table}\nroute replace local {any} dev lo table {table}\n"
        ));
    } else {
        b.push_str(&format!("route del local {any} dev lo table {table}\n"));
    }
    b
}

/// `ip FAMILY -force -batch -` with `batch` on its standard input.
fn ip_batch(family: &str, batch: &str) -> io::Result<()> {
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
    // Deleting what is not there fails as expected; any other error counts.
    let real: Vec<&str> = err
        .lines()
        .filter(|l| {
            !l.trim().is_empty()
                && !l.contains("No such file or directory")
                && !l.contains("No such process")
                && !l.starts_with("Command failed")
        })
        .collect();
    if real.is_empty() {
        Ok(())
    } else {
        Err(io::Error::other(format!("ip {family}: {}", real.join("; "))))
    }
}
