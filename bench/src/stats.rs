//! Load generators and their statistics: short-connection rate and request/response latency,
//! each run from one or more client threads inside the client pod's netns.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use meshpath_loader::netns::Netns;
use serde_json::{json, Map, Value};

/// Size of one request and one response.
pub const MESSAGE: usize = 64;

/// A server in `ns` at `addr`: for each connection, answers every MESSAGE-byte request with a
/// MESSAGE-byte response until the client closes. Runs until the process ends.
pub fn start_rr_server(ns: &Netns, addr: SocketAddr) -> Result<()> {
    let listener = ns.run(|| TcpListener::bind(addr))??;
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut conn = conn;
                let _ = conn.set_nodelay(true);
                let mut buf = [0u8; MESSAGE];
                while conn.read_exact(&mut buf).is_ok() {
                    if conn.write_all(&buf).is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(())
}

/// A server in `ns` at `addr` for the connection rate: for each connection, one request, one
/// response, then it closes first, so TIME_WAIT stays on the server and the client's ephemeral
/// ports are not used up by a long run.
pub fn start_oneshot_server(ns: &Netns, addr: SocketAddr) -> Result<()> {
    let listener = ns.run(|| TcpListener::bind(addr))??;
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let mut conn = conn;
            let mut buf = [0u8; MESSAGE];
            if conn.read_exact(&mut buf).is_ok() {
                let _ = conn.write_all(&buf);
            }
        }
    });
    Ok(())
}

/// Connections per second from `clients` threads at once, all together: each connects, sends
/// one request, reads the response, waits for the server to close, closes, again, for `secs`
/// seconds.
pub fn conn_per_s(ns: &Netns, to: SocketAddr, secs: f64, clients: usize) -> Result<f64> {
    let (n, elapsed) = connections(ns, to, secs, clients)?;
    Ok(n as f64 / elapsed.as_secs_f64())
}

/// What [`conn_per_s`] runs: the connections made, and the time they took.
pub fn connections(
    ns: &Netns,
    to: SocketAddr,
    secs: f64,
    clients: usize,
) -> Result<(u64, Duration)> {
    let client = |start: Instant| -> Result<u64> {
        let mut n = 0u64;
        let mut buf = [0u8; MESSAGE];
        while start.elapsed().as_secs_f64() < secs {
            let mut c = TcpStream::connect(to)?;
            c.set_nodelay(true)?;
            c.write_all(&[7u8; MESSAGE])?;
            c.read_exact(&mut buf)?;
            // The server closes first.
            let mut rest = [0u8; 1];
            let _ = c.read(&mut rest)?;
            n += 1;
        }
        Ok(n)
    };
    ns.run(|| -> Result<(u64, Duration)> {
        let start = Instant::now();
        let counts = in_threads(clients, || client(start))?;
        Ok((counts.iter().sum(), start.elapsed()))
    })?
}

/// Records metric `key` of scenario `name` in `out`: its value, or null (failed, and said
/// why). A metric that fails is not the end of the whole run.
pub fn record(out: &mut Map<String, Value>, name: &str, key: &str, v: Result<f64>) {
    let value = match v {
        Ok(x) => json!(x),
        Err(e) => {
            eprintln!("bench: {name}: {key} failed: {e:#}");
            json!(null)
        }
    };
    out.insert(key.to_owned(), value);
}

/// Round trips of a request/response run before it measures, and measured.
const RR_WARMUP: usize = 2_000;
const RR_COUNT: usize = 20_000;

/// Connection rate (to `oneshot`) and request/response p50 and p99 (to `rr`) from `ns`, from
/// one client (latency-bound: each connection waits for the one before) and from 100 at once
/// (`*_100`, bound by the CPU the path costs), each recorded in `out`.
///
/// With `proxies` (their pids), also what they did per round trip from one client, where a
/// message's latency is made, in a run of its own: their threads' context switches
/// (`rr_switches`: a thread woken and put to sleep again) and their system calls
/// (`rr_syscalls`, counted by `perf stat`).
pub fn record_rate_and_latency(
    out: &mut Map<String, Value>,
    name: &str,
    ns: &Netns,
    oneshot: SocketAddr,
    rr: SocketAddr,
    secs: f64,
    proxies: &[u32],
) {
    for (clients, suffix) in [(1, ""), (100, "_100")] {
        record(out, name, &format!("conn_per_s{suffix}"), conn_per_s(ns, oneshot, secs, clients));
        let rr_run = rr_latency(ns, rr, RR_WARMUP, RR_COUNT, clients);
        let key = |k: &str| format!("{k}{suffix}");
        for (k, v) in [
            ("rr_p50_us", rr_run.as_ref().map(|r| r.p50_us)),
            ("rr_p99_us", rr_run.as_ref().map(|r| r.p99_us)),
            ("rr_cpu_us", rr_run.as_ref().map(|r| r.cpu_us_per_rr)),
            ("rr_busy", rr_run.as_ref().map(|r| r.busy)),
        ] {
            record(out, name, &key(k), v.map_err(|e| anyhow::anyhow!("{e:#}")));
        }
    }
    // A run of its own: perf's counting, switched in and out with each proxy thread, slows
    // every wake-up it counts (p50 about a third higher here), so the latency above is not
    // taken under it.
    if !proxies.is_empty() {
        let watch = Watch::start(proxies);
        let done = rr_latency(ns, rr, RR_WARMUP, RR_COUNT, 1);
        let trips = (RR_WARMUP + RR_COUNT) as f64;
        let (switches, syscalls) = watch.stop();
        let counted = |n: Result<f64>| done.as_ref().map_err(|e| anyhow::anyhow!("{e:#}")).and(n);
        record(out, name, "rr_switches", counted(switches).map(|n| n / trips));
        record(out, name, "rr_syscalls", counted(syscalls).map(|n| n / trips));
    }
}

/// The proxies' context switches (from /proc) and system calls (`perf stat`) while a run
/// lasts.
struct Watch {
    pids: Vec<u32>,
    switches: Result<u64>,
    perf: std::io::Result<std::process::Child>,
}

/// Context switches, voluntary and not, of every thread of `pids` so far.
fn switches(pids: &[u32]) -> Result<u64> {
    let mut n = 0;
    for pid in pids {
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
            let status = std::fs::read_to_string(task?.path().join("status"))?;
            n += status
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>();
        }
    }
    Ok(n)
}

impl Watch {
    fn start(pids: &[u32]) -> Self {
        let list: Vec<String> = pids.iter().map(u32::to_string).collect();
        let perf = std::process::Command::new("perf")
            .args(["stat", "-x", ",", "-e", "raw_syscalls:sys_enter", "-p", &list.join(",")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn();
        // perf attaches before it counts: a moment for it.
        if perf.is_ok() {
            std::thread::sleep(Duration::from_millis(300));
        }
        Self { pids: pids.to_vec(), switches: switches(pids), perf }
    }

    /// Switches, and system calls if perf ran, since `start`.
    fn stop(self) -> (Result<f64>, Result<f64>) {
        let now = switches(&self.pids);
        let switched = match (self.switches, now) {
            (Ok(a), Ok(b)) => Ok(b.saturating_sub(a) as f64),
            (Err(e), _) | (_, Err(e)) => Err(e),
        };
        let syscalls = self.perf.context("perf stat (Debian's linux-perf)").and_then(|perf| {
            // SAFETY: a signal to our own child.
            unsafe { libc::kill(perf.id() as i32, libc::SIGINT) };
            let out = perf.wait_with_output()?;
            let text = String::from_utf8_lossy(&out.stderr);
            text.lines()
                .find(|l| l.contains("raw_syscalls:sys_enter"))
                .and_then(|l| l.split(',').next()?.trim().parse::<f64>().ok())
                .with_context(|| format!("perf stat printed no count: {text}"))
        });
        (switched, syscalls)
    }
}

/// What a request/response run measured.
pub struct Rr {
    /// Round-trip latency percentiles, µs.
    pub p50_us: f64,
    pub p99_us: f64,
    /// The whole machine's busy CPU time per round trip (every process and the kernel), µs.
    pub cpu_us_per_rr: f64,
    /// The share of all CPUs busy meanwhile (0 to 1).
    pub busy: f64,
}

/// The whole machine's busy CPU time so far, in seconds (every process and the kernel: what a
/// proxy's own time leaves out when its work moves into the kernel in others' contexts).
pub fn machine_busy_s() -> Result<f64> {
    Ok(cpu_jiffies()?.0 as f64 / clock_ticks_per_s())
}

/// The clock ticks /proc counts CPU time in, per second.
pub fn clock_ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64
}

/// Busy and total jiffies of all CPUs so far (/proc/stat's `cpu` line; idle and iowait are
/// not busy, steal is neither).
fn cpu_jiffies() -> Result<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().filter(|l| l.starts_with("cpu ")).context("/proc/stat")?;
    let f: Vec<u64> = line.split_whitespace().skip(1).map(|x| x.parse().unwrap_or(0)).collect();
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal
    let busy = at(0) + at(1) + at(2) + at(5) + at(6);
    Ok((busy, busy + at(3) + at(4)))
}

/// One request/response connection (to a [`start_rr_server`]), made from the calling thread's
/// netns and kept across runs of round trips.
pub struct RrClient(TcpStream);

impl RrClient {
    pub fn connect(to: SocketAddr) -> Result<Self> {
        let c = TcpStream::connect(to).with_context(|| format!("connecting to {to}"))?;
        c.set_nodelay(true)?;
        Ok(Self(c))
    }

    /// `n` round trips of a MESSAGE-byte request and its response, one after the other; the
    /// time each took.
    pub fn round_trips(&mut self, n: usize) -> Result<Vec<Duration>> {
        let mut buf = [0u8; MESSAGE];
        let mut samples = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            self.0.write_all(&[1u8; MESSAGE])?;
            self.0.read_exact(&mut buf)?;
            samples.push(t.elapsed());
        }
        Ok(samples)
    }
}

/// Request/response latency from `clients` threads at once, each on its own connection:
/// `count` round trips in all after `warmup` (both split evenly among the clients); the p50 and
/// p99 over every client's round trips, and the CPU the whole run cost per round trip.
pub fn rr_latency(
    ns: &Netns,
    to: SocketAddr,
    warmup: usize,
    count: usize,
    clients: usize,
) -> Result<Rr> {
    let (warmup, count) = (warmup / clients.max(1), count / clients.max(1));
    let client = || -> Result<Vec<Duration>> {
        let mut c = RrClient::connect(to)?;
        c.round_trips(warmup)?;
        c.round_trips(count)
    };
    ns.run(|| -> Result<Rr> {
        let (busy0, total0) = cpu_jiffies()?;
        let mut samples: Vec<Duration> = in_threads(clients, client)?.concat();
        let (busy1, total1) = cpu_jiffies()?;
        let trips = ((warmup + count) * clients.max(1)) as f64;
        let hz = clock_ticks_per_s();
        let busy = (busy1 - busy0) as f64;
        Ok(Rr {
            p50_us: percentile_us(&mut samples, 0.50),
            p99_us: percentile_us(&mut samples, 0.99),
            cpu_us_per_rr: busy / hz * 1e6 / trips,
            busy: busy / (total1 - total0).max(1) as f64,
        })
    })?
}

/// Runs `f` on `n` threads at once (threads started from inside a netns are in it too); the
/// results, or the first error.
fn in_threads<T: Send>(n: usize, f: impl Fn() -> Result<T> + Sync) -> Result<Vec<T>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n.max(1)).map(|_| s.spawn(&f)).collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("a load thread panicked"))?)
            .collect()
    })
}

/// The `q` quantile of `samples` in microseconds (nearest rank).
pub fn percentile_us(samples: &mut [Duration], q: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_unstable();
    let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
    samples[rank - 1].as_secs_f64() * 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let mut s: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile_us(&mut s, 0.50), 50.0);
        assert_eq!(percentile_us(&mut s, 0.99), 99.0);
    }
}
