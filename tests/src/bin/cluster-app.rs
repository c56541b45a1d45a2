//! The cluster tests' workload (image `localhost/meshpath-testapp`, tests/tests/cluster.rs):
//! a server with an HTTP port for kubelet's probes and a TCP sink, and the clients the tests run
//! in pods with `kubectl exec`. Standard library only (and libc, for its listen backlog).
//!
//! - `serve [--http PORT] [--sink PORT] [--echo PORT] [--hello ADDR]`: HTTP (8080): `GET /healthz` → 200,
//!   `GET /peer` → the client's address as this pod sees it, `GET /count` → how many
//!   connections the sink has accepted; the sink (9000) reads a connection to its end and
//!   answers `bytes=N hash=H` (FNV-1a 64 of what it read), so a sender can check every byte
//!   arrived; the echo port (9100) sends back what it reads, and ends its side at the client's
//!   end. With `--hello`, the first thing it does, before it listens: connect to ADDR
//!   (again every 200 ms for up to 120 s until it can) and send `hello from LOCAL_ADDR`, the
//!   address its own socket has, so the listener can tell whether it was reached by this
//!   socket or by a proxy's (another port).
//! - `send ADDR --bytes N [--seconds S] [--until-stdin-closes]`: sends N bytes of a fixed
//!   pattern, spread over S seconds (with `--until-stdin-closes`, the rest at once when its
//!   standard input ends, and `unsent_at_stdin_end=B` printed: the bytes still to send then),
//!   closes its side and prints the sink's answer; exits 1 unless the sink read exactly what
//!   was sent.
//! - `get ADDR PATH`: one HTTP GET; prints the body; exits 1 unless the status is 200.
//! - `loop ADDR --seconds S [--every-ms M] [--until-stdin-closes]`: opens a new connection to
//!   the sink every M ms (20) for S seconds (or, with `--until-stdin-closes`, until its
//!   standard input ends, S seconds at most), each on a thread of its own, so a connection that waits does not hold
//!   up the next: each sends 64 bytes and checks the sink's answer within 120 s. Prints
//!   `opened=N answered=N refused=N reset=N other=N slowest_ms=N slowest_connect_ms=N` and
//!   `failed_at_ms=T,…` (when each failed connection was opened, the first 100), `began_unix_ms=`
//!   (the loop's start on the wall clock, for the proxies' logs) and the first
//!   errors; exits 1 unless every connection was answered.
//! - `hold ADDR --connections N --seconds S`: N long-lived connections to an echo port, one in
//!   three each of bulk (a paced stream of the fixed pattern, its echo checked byte by byte),
//!   request/response (64 bytes every 100 ms) and idle (a round trip at the start and at the
//!   end), until its standard input ends (S seconds at most); then each ends its side and reads
//!   the echo to its end. Prints `connections=N kept=K bytes=B longest_stall_ms=T` (the longest
//!   wait for an answer on any connection) and each failure; exits 1 unless all were kept.
//! - `raw-syn ADDR [--qdisc-bypass]`: what an app with CAP_NET_RAW (containerd's default) can
//!   do past the socket hooks: a hand-built TCP SYN to ADDR (IPv4, a listener on the same
//!   network, as pods of one node are on the bridge), sent as a whole Ethernet frame on a
//!   packet socket out of eth0 (with `--qdisc-bypass`, `PACKET_QDISC_BYPASS`: past every qdisc
//!   and TC program of the pod's side). Prints `answered` if a SYN-ACK comes back within 2 s,
//!   `unanswered` if not.

use std::{
    env,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs as _},
    process::ExitCode,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// The byte at `offset` of the stream a sender sends.
fn pattern(offset: u64) -> u8 {
    (offset % 251) as u8
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("serve") | None => serve(&args),
        Some("send") => send(&args[1..]),
        Some("get") => get(&args[1..]),
        Some("loop") => connect_loop(&args[1..]),
        Some("raw-syn") => raw_syn(&args[1..]),
        Some("hold") => hold(&args[1..]),
        Some(other) => {
            Err(format!("unknown command {other}; serve, send, get, loop, hold or raw-syn"))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cluster-app: {e}");
            ExitCode::FAILURE
        }
    }
}

fn listen(port: &str) -> Result<TcpListener, String> {
    let l = TcpListener::bind(format!("[::]:{port}"))
        .map_err(|e| format!("listening on {port}: {e}"))?;
    // The standard library listens with a backlog of 128; a server behind a node proxy that
    // restarts gets the connections that waited all at once, as a real server's larger
    // backlog takes them (nginx 511, Go's listeners the kernel's somaxconn): listen again
    // with the kernel's limit.
    // SAFETY: listen(2) on a socket this function owns.
    if unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&l), libc::SOMAXCONN) } != 0 {
        return Err(format!("listen on {port}: {}", std::io::Error::last_os_error()));
    }
    Ok(l)
}

/// `serve --hello`: one connection to `to` saying which local address it was made from.
fn hello(to: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let Some(addr) = to.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        eprintln!("cluster-app: --hello {to}: not an address");
        return;
    };
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(mut conn) => {
                let local = conn.local_addr().map(|a| a.to_string()).unwrap_or_default();
                let said = conn.write_all(format!("hello from {local}\n").as_bytes());
                let _ = conn.shutdown(Shutdown::Write);
                let mut rest = Vec::new();
                let _ = conn.read_to_end(&mut rest);
                eprintln!("cluster-app: hello to {to} from {local}: {said:?}");
                return;
            }
            Err(e) if Instant::now() > deadline => {
                eprintln!("cluster-app: hello to {to}: {e}");
                return;
            }
            Err(_) => thread::sleep(Duration::from_millis(200)),
        }
    }
}

fn serve(args: &[String]) -> Result<(), String> {
    if let Some(to) = flag(args, "--hello") {
        hello(&to);
    }
    let http = listen(&flag(args, "--http").unwrap_or_else(|| "8080".into()))?;
    let sink = listen(&flag(args, "--sink").unwrap_or_else(|| "9000".into()))?;
    let echo = listen(&flag(args, "--echo").unwrap_or_else(|| "9100".into()))?;
    thread::spawn(move || {
        for conn in echo.incoming().flatten() {
            thread::spawn(move || echo_one(conn));
        }
    });
    let accepted = Arc::new(AtomicU64::new(0));
    let count = accepted.clone();
    thread::spawn(move || {
        for conn in sink.incoming().flatten() {
            count.fetch_add(1, Ordering::Relaxed);
            thread::spawn(move || sink_one(conn));
        }
    });
    eprintln!("cluster-app: serving HTTP on {:?}", http.local_addr());
    for conn in http.incoming().flatten() {
        let accepted = accepted.clone();
        thread::spawn(move || http_one(conn, &accepted));
    }
    Ok(())
}

fn echo_one(conn: TcpStream) {
    let Ok(mut r) = conn.try_clone() else { return };
    let mut w = conn;
    if std::io::copy(&mut r, &mut w).is_ok() {
        let _ = w.shutdown(Shutdown::Write);
    }
}

fn sink_one(mut conn: TcpStream) {
    let mut buf = vec![0u8; 64 * 1024];
    let (mut n, mut h) = (0u64, FNV_OFFSET);
    loop {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => {
                h = fnv(h, &buf[..k]);
                n += k as u64;
            }
            Err(_) => return,
        }
    }
    let _ = writeln!(conn, "bytes={n} hash={h:016x}");
}

fn http_one(conn: TcpStream, accepted: &AtomicU64) {
    let peer = conn.peer_addr().map(|a| canonical(a.ip()).to_string()).unwrap_or_default();
    let mut reader = BufReader::new(match conn.try_clone() {
        Ok(c) => c,
        Err(_) => return,
    });
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    // The rest of the request head.
    loop {
        let mut h = String::new();
        match reader.read_line(&mut h) {
            Ok(0) | Err(_) => break,
            Ok(_) if h == "\r\n" || h == "\n" => break,
            Ok(_) => {}
        }
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/");
    let (status, body) = match path {
        "/healthz" => ("200 OK", "ok".to_owned()),
        "/peer" => ("200 OK", peer),
        "/count" => ("200 OK", accepted.load(Ordering::Relaxed).to_string()),
        _ => ("404 Not Found", "not found".to_owned()),
    };
    let mut conn = conn;
    let _ = write!(
        conn,
        "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// An IPv4 peer of a dual-stack listener in its IPv4 form.
fn canonical(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    }
}

/// Sets `flag` once this process's standard input ends (read to its end on a thread of its
/// own): how a test that ran the app with `kubectl exec -i` (or `nsenter`, on a CNI node)
/// tells it to finish.
fn on_stdin_end(flag: Arc<AtomicBool>) {
    thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        flag.store(true, Ordering::Relaxed);
    });
}

fn resolve(addr: &str) -> Result<SocketAddr, String> {
    addr.to_socket_addrs()
        .map_err(|e| format!("{addr}: {e}"))?
        .next()
        .ok_or_else(|| format!("{addr}: no address"))
}

fn send(args: &[String]) -> Result<(), String> {
    let addr =
        resolve(args.first().ok_or("send ADDR --bytes N [--seconds S] [--until-stdin-closes]")?)?;
    let total: u64 =
        flag(args, "--bytes").ok_or("--bytes N")?.parse().map_err(|e| format!("--bytes: {e}"))?;
    let seconds: f64 = flag(args, "--seconds")
        .map_or(Ok(0.0), |s| s.parse())
        .map_err(|e| format!("--seconds: {e}"))?;
    let hurry = Arc::new(AtomicBool::new(false));
    if args.iter().any(|a| a == "--until-stdin-closes") {
        on_stdin_end(hurry.clone());
    }
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    let started = Instant::now();
    let (mut sent, mut h) = (0u64, FNV_OFFSET);
    let mut unsent_at_stdin_end = None;
    let mut chunk = vec![0u8; 16 * 1024];
    while sent < total {
        let k = chunk.len().min((total - sent) as usize);
        for (i, b) in chunk[..k].iter_mut().enumerate() {
            *b = pattern(sent + i as u64);
        }
        conn.write_all(&chunk[..k]).map_err(|e| format!("sending at byte {sent}: {e}"))?;
        h = fnv(h, &chunk[..k]);
        sent += k as u64;
        if hurry.load(Ordering::Relaxed) && unsent_at_stdin_end.is_none() {
            unsent_at_stdin_end = Some(total - sent);
        }
        if seconds > 0.0 && unsent_at_stdin_end.is_none() {
            // Paced: byte `sent` is due at `sent / total` of the time.
            let due = Duration::from_secs_f64(seconds * sent as f64 / total as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                thread::sleep(wait);
            }
        }
    }
    conn.shutdown(Shutdown::Write).map_err(|e| format!("closing: {e}"))?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer).map_err(|e| format!("reading the answer: {e}"))?;
    let want = format!("bytes={sent} hash={h:016x}");
    if let Some(unsent) = unsent_at_stdin_end {
        println!("unsent_at_stdin_end={unsent}");
    }
    println!("sent {want}; the sink read {}", answer.trim());
    if answer.trim() != want {
        return Err(format!("the sink read {:?}, not {want:?}", answer.trim()));
    }
    Ok(())
}

fn get(args: &[String]) -> Result<(), String> {
    let addr = resolve(args.first().ok_or("get ADDR PATH")?)?;
    let path = args.get(1).map_or("/", String::as_str);
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    write!(conn, "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut resp = String::new();
    conn.read_to_string(&mut resp).map_err(|e| format!("reading: {e}"))?;
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    println!("{body}");
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("answer: {}", head.lines().next().unwrap_or_default()));
    }
    Ok(())
}

/// How one connection of `loop` ended.
enum Outcome {
    Answered { connect: Duration, total: Duration },
    Failed(std::io::ErrorKind, String),
}

/// One connection of `loop`: 64 bytes to the sink, its answer checked.
fn one_round(addr: SocketAddr) -> Outcome {
    let fail = |e: std::io::Error, at: &str| Outcome::Failed(e.kind(), format!("{at}: {e}"));
    let start = Instant::now();
    let mut conn = match TcpStream::connect_timeout(&addr, Duration::from_secs(120)) {
        Ok(c) => c,
        Err(e) => return fail(e, "connect"),
    };
    let connect = start.elapsed();
    let payload: Vec<u8> = (0..64u64).map(pattern).collect();
    let want = format!("bytes=64 hash={:016x}", fnv(FNV_OFFSET, &payload));
    let mut answer = String::new();
    let result = conn
        .set_read_timeout(Some(Duration::from_secs(120)))
        .and_then(|()| conn.write_all(&payload))
        .and_then(|()| conn.shutdown(Shutdown::Write))
        .and_then(|()| conn.read_to_string(&mut answer));
    match result {
        // Where and when, to find the connection in the proxies' access logs.
        Err(e) => {
            let from = conn.local_addr().map_or_else(|_| "?".to_owned(), |a| a.to_string());
            let after = start.elapsed().as_millis();
            fail(e, &format!("exchange (from {from}, failed after {after} ms)"))
        }
        Ok(_) if answer.trim() != want => Outcome::Failed(
            std::io::ErrorKind::InvalidData,
            format!("the sink read {:?}, not {want:?}", answer.trim()),
        ),
        Ok(_) => Outcome::Answered { connect, total: start.elapsed() },
    }
}

fn connect_loop(args: &[String]) -> Result<(), String> {
    let addr = resolve(args.first().ok_or("loop ADDR --seconds S [--every-ms M]")?)?;
    let seconds: u64 = flag(args, "--seconds")
        .ok_or("--seconds S")?
        .parse()
        .map_err(|e| format!("--seconds: {e}"))?;
    let every: u64 = flag(args, "--every-ms")
        .map_or(Ok(20), |s| s.parse())
        .map_err(|e| format!("--every-ms: {e}"))?;
    let every = Duration::from_millis(every.max(1));
    let until = Instant::now() + Duration::from_secs(seconds);
    let stdin_closed = Arc::new(AtomicBool::new(false));
    if args.iter().any(|a| a == "--until-stdin-closes") {
        on_stdin_end(stdin_closed.clone());
    }
    let mut rounds = Vec::new();
    let began = Instant::now();
    // The loop's clock against the wall's, for the times its failures are reported at.
    let began_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let mut next = began;
    while Instant::now() < until && !stdin_closed.load(Ordering::Relaxed) {
        let at = began.elapsed();
        rounds.push((at, thread::spawn(move || one_round(addr))));
        next += every;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
    }
    let (mut answered, mut refused, mut reset, mut other) = (0, 0, 0, 0);
    let (mut slowest, mut slowest_connect) = (Duration::ZERO, Duration::ZERO);
    let mut errors = Vec::new();
    let mut failed_at = Vec::new();
    let opened = rounds.len();
    for (at, r) in rounds {
        match r.join() {
            Ok(Outcome::Answered { connect, total }) => {
                answered += 1;
                slowest = slowest.max(total);
                slowest_connect = slowest_connect.max(connect);
            }
            Ok(Outcome::Failed(kind, text)) => {
                match kind {
                    std::io::ErrorKind::ConnectionRefused => refused += 1,
                    std::io::ErrorKind::ConnectionReset => reset += 1,
                    _ => other += 1,
                }
                if errors.len() < 20 {
                    errors.push(format!("opened at {} ms: {text}", at.as_millis()));
                }
                if failed_at.len() < 100 {
                    failed_at.push(at.as_millis().to_string());
                }
            }
            Err(_) => {
                other += 1;
                if failed_at.len() < 100 {
                    failed_at.push(at.as_millis().to_string());
                }
            }
        }
    }
    println!(
        "opened={opened} answered={answered} refused={refused} reset={reset} other={other} slowest_ms={} slowest_connect_ms={}",
        slowest.as_millis(),
        slowest_connect.as_millis()
    );
    println!("failed_at_ms={}", failed_at.join(","));
    println!("began_unix_ms={began_unix_ms}");
    for e in &errors {
        println!("error: {e}");
    }
    if answered != opened {
        return Err(format!("{} of {opened} connections were not answered", opened - answered));
    }
    Ok(())
}

/// The source port of `raw-syn`'s SYN (no socket of the pod has it).
const RAW_SYN_PORT: u16 = 40404;

/// `raw-syn ADDR [--qdisc-bypass]`.
fn raw_syn(args: &[String]) -> Result<(), String> {
    let dst: std::net::SocketAddrV4 = args
        .first()
        .ok_or("raw-syn needs ADDR")?
        .parse()
        .map_err(|e| format!("raw-syn ADDR: {e}"))?;
    let bypass = args.iter().any(|a| a == "--qdisc-bypass");
    // The pod's own address toward ADDR (a UDP connect sends nothing), and ADDR's MAC: a
    // datagram to its discard port makes the kernel resolve it (UDP is not captured).
    let udp = std::net::UdpSocket::bind("0.0.0.0:0").map_err(|e| format!("udp: {e}"))?;
    udp.connect((*dst.ip(), 9)).map_err(|e| format!("udp connect: {e}"))?;
    let std::net::SocketAddr::V4(src) = udp.local_addr().map_err(|e| format!("{e}"))? else {
        return Err("no IPv4 address toward ADDR".into());
    };
    let _ = udp.send(b"arp");
    let to_mac = mac_in_arp_table(*dst.ip(), Duration::from_secs(2))?;
    let from_mac = parse_mac(
        std::fs::read_to_string("/sys/class/net/eth0/address")
            .map_err(|e| format!("eth0's address: {e}"))?
            .trim(),
    )?;
    // SAFETY: plain socket calls on descriptors owned here (closed on return), with structs
    // fully initialised here.
    unsafe {
        let raw = libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_TCP);
        if raw < 0 {
            return Err(format!("raw socket: {}", std::io::Error::last_os_error()));
        }
        let raw = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw);
        let timeout = libc::timeval { tv_sec: 0, tv_usec: 100_000 };
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&raw),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            std::ptr::addr_of!(timeout).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        );
        let frame = syn_frame(to_mac, from_mac, src.ip().octets(), dst.ip().octets(), dst.port());
        send_frame(&frame, bypass)?;
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut buf = [0u8; 2048];
        while Instant::now() < deadline {
            let n = libc::recv(
                std::os::fd::AsRawFd::as_raw_fd(&raw),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
            );
            if n <= 0 {
                continue;
            }
            let pkt = &buf[..n as usize];
            let tcp = &pkt[usize::from(pkt[0] & 0x0f) * 4..];
            if pkt[12..16] == dst.ip().octets()
                && tcp.len() >= 14
                && u16::from_be_bytes([tcp[0], tcp[1]]) == dst.port()
                && u16::from_be_bytes([tcp[2], tcp[3]]) == RAW_SYN_PORT
                && tcp[13] & 0x12 == 0x12
            {
                println!("answered");
                return Ok(());
            }
        }
    }
    println!("unanswered");
    Ok(())
}

/// ADDR's MAC from the kernel's neighbour table, once it has one.
fn mac_in_arp_table(ip: std::net::Ipv4Addr, wait: Duration) -> Result<[u8; 6], String> {
    let deadline = Instant::now() + wait;
    loop {
        let table = std::fs::read_to_string("/proc/net/arp").map_err(|e| format!("arp: {e}"))?;
        let mac = table.lines().skip(1).find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.first() == Some(&ip.to_string().as_str()) && f.get(3) != Some(&"00:00:00:00:00:00"))
                .then(|| f.get(3).copied())
                .flatten()
        });
        if let Some(mac) = mac {
            return parse_mac(mac);
        }
        if Instant::now() > deadline {
            return Err(format!("no MAC for {ip} in /proc/net/arp"));
        }
        thread::sleep(Duration::from_millis(50));
    }
}

fn parse_mac(text: &str) -> Result<[u8; 6], String> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for m in &mut mac {
        let part = parts.next().ok_or_else(|| format!("not a MAC: {text}"))?;
        *m = u8::from_str_radix(part, 16).map_err(|_| format!("not a MAC: {text}"))?;
    }
    Ok(mac)
}

/// The one's-complement sum of 16-bit words, folded.
fn checksum(chunks: &[&[u8]]) -> u16 {
    let mut sum = 0u32;
    for chunk in chunks {
        for pair in chunk.chunks(2) {
            sum += u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]));
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An Ethernet frame carrying an IPv4 TCP SYN from `src`:[`RAW_SYN_PORT`] to `dst`:`port`.
fn syn_frame(to: [u8; 6], from: [u8; 6], src: [u8; 4], dst: [u8; 4], port: u16) -> Vec<u8> {
    let mut tcp = vec![0u8; 20];
    tcp[0..2].copy_from_slice(&RAW_SYN_PORT.to_be_bytes());
    tcp[2..4].copy_from_slice(&port.to_be_bytes());
    tcp[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = 0x02;
    tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
    let pseudo = [&src[..], &dst[..], &[0, 6], &20u16.to_be_bytes()[..]].concat();
    let sum = checksum(&[&pseudo, &tcp]);
    tcp[16..18].copy_from_slice(&sum.to_be_bytes());
    let mut ip = vec![0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&40u16.to_be_bytes());
    ip[8] = 64;
    ip[9] = 6;
    ip[12..16].copy_from_slice(&src);
    ip[16..20].copy_from_slice(&dst);
    let sum = checksum(&[&ip]);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    [&to[..], &from[..], &0x0800u16.to_be_bytes()[..], &ip, &tcp].concat()
}

/// Sends `frame` out of eth0 on a `SOCK_RAW` packet socket; a drop on the pod's side
/// (ENOBUFS) is not an error: whether the SYN got anywhere is for the answer to tell.
fn send_frame(frame: &[u8], qdisc_bypass: bool) -> Result<(), String> {
    // SAFETY: as in `raw_syn`.
    unsafe {
        let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(0x0800u16.to_be()));
        if fd < 0 {
            return Err(format!("packet socket: {}", std::io::Error::last_os_error()));
        }
        let fd = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let raw_fd = std::os::fd::AsRawFd::as_raw_fd(&fd);
        if qdisc_bypass {
            let on: libc::c_int = 1;
            if libc::setsockopt(
                raw_fd,
                libc::SOL_PACKET,
                libc::PACKET_QDISC_BYPASS,
                std::ptr::addr_of!(on).cast(),
                std::mem::size_of::<libc::c_int>() as u32,
            ) < 0
            {
                return Err(format!("PACKET_QDISC_BYPASS: {}", std::io::Error::last_os_error()));
            }
        }
        let mut addr: libc::sockaddr_ll = std::mem::zeroed();
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = 0x0800u16.to_be();
        addr.sll_ifindex = libc::if_nametoindex(c"eth0".as_ptr()) as i32;
        let n = libc::sendto(
            raw_fd,
            frame.as_ptr().cast(),
            frame.len(),
            0,
            std::ptr::addr_of!(addr).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        );
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOBUFS) {
                return Err(format!("sending the frame: {e}"));
            }
        }
    }
    Ok(())
}

/// What one `hold` connection does.
#[derive(Clone, Copy, Debug)]
enum Holding {
    Bulk,
    RequestResponse,
    Idle,
}

/// How long a `hold` connection waits for any answer before it counts as failed.
const HOLD_ANSWER_WITHIN: Duration = Duration::from_secs(120);

/// `hold ADDR --connections N --seconds S` (see the module's doc).
fn hold(args: &[String]) -> Result<(), String> {
    let addr = args.first().ok_or("hold ADDR --connections N --seconds S")?.clone();
    let n: usize = flag(args, "--connections").and_then(|v| v.parse().ok()).unwrap_or(60);
    let seconds: u64 = flag(args, "--seconds").and_then(|v| v.parse().ok()).unwrap_or(300);
    let stop = Arc::new(AtomicBool::new(false));
    let stall_ms = Arc::new(AtomicU64::new(0));
    let bytes = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for i in 0..n {
        let kind = [Holding::Bulk, Holding::RequestResponse, Holding::Idle][i % 3];
        let conn = TcpStream::connect(&addr).map_err(|e| format!("connection {i}: {e}"))?;
        let (stop, stall_ms, bytes) = (stop.clone(), stall_ms.clone(), bytes.clone());
        threads.push(thread::spawn(move || {
            hold_one(conn, kind, &stop, &stall_ms, &bytes)
                .map_err(|e| format!("connection {i} ({kind:?}): {e}"))
        }));
    }
    on_stdin_end(stop.clone());
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    let mut failures = Vec::new();
    for t in threads {
        match t.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failures.push(e),
            Err(_) => failures.push("a connection's thread panicked".into()),
        }
    }
    println!(
        "connections={n} kept={} bytes={} longest_stall_ms={}",
        n - failures.len(),
        bytes.load(Ordering::Relaxed),
        stall_ms.load(Ordering::Relaxed)
    );
    for f in failures.iter().take(20) {
        println!("failed: {f}");
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("{} of {n} connections failed", failures.len()))
    }
}

/// One `hold` connection, until `stop`; then its end, and the echo read to its end.
fn hold_one(
    conn: TcpStream,
    kind: Holding,
    stop: &AtomicBool,
    stall_ms: &AtomicU64,
    bytes: &AtomicU64,
) -> Result<(), String> {
    conn.set_read_timeout(Some(HOLD_ANSWER_WITHIN)).map_err(|e| e.to_string())?;
    let mut w = conn.try_clone().map_err(|e| e.to_string())?;
    let mut r = conn;
    let stalled = |since: Instant| {
        stall_ms.fetch_max(since.elapsed().as_millis() as u64, Ordering::Relaxed);
    };
    let round_trip = |w: &mut TcpStream, r: &mut TcpStream, at: u64| -> Result<(), String> {
        let msg: Vec<u8> = (0..64).map(|i| pattern(at + i)).collect();
        let start = Instant::now();
        w.write_all(&msg).map_err(|e| format!("send: {e}"))?;
        let mut back = [0u8; 64];
        r.read_exact(&mut back).map_err(|e| format!("answer: {e}"))?;
        stalled(start);
        if back[..] != msg[..] {
            return Err("the echo differs".into());
        }
        bytes.fetch_add(64, Ordering::Relaxed);
        Ok(())
    };
    match kind {
        Holding::Idle => {
            round_trip(&mut w, &mut r, 0)?;
            while !stop.load(Ordering::Relaxed) {
                thread::sleep(Duration::from_millis(100));
            }
            round_trip(&mut w, &mut r, 64)?;
        }
        Holding::RequestResponse => {
            let mut at = 0;
            while !stop.load(Ordering::Relaxed) {
                round_trip(&mut w, &mut r, at)?;
                at += 64;
                thread::sleep(Duration::from_millis(100));
            }
        }
        Holding::Bulk => {
            // Paced: 64 KiB every 50 ms (1.25 MiB/s), the echo read on another thread.
            let reader = thread::spawn(move || -> Result<u64, String> {
                let mut buf = vec![0u8; 64 * 1024];
                let mut off = 0u64;
                loop {
                    let k = r.read(&mut buf).map_err(|e| format!("echo at byte {off}: {e}"))?;
                    if k == 0 {
                        return Ok(off);
                    }
                    if let Some(i) = (0..k).find(|i| buf[*i] != pattern(off + *i as u64)) {
                        return Err(format!("echo byte {} differs", off + i as u64));
                    }
                    off += k as u64;
                }
            });
            let mut sent = 0u64;
            let mut chunk = vec![0u8; 64 * 1024];
            while !stop.load(Ordering::Relaxed) {
                for (i, b) in chunk.iter_mut().enumerate() {
                    *b = pattern(sent + i as u64);
                }
                let start = Instant::now();
                w.write_all(&chunk).map_err(|e| format!("send at byte {sent}: {e}"))?;
                stalled(start);
                sent += chunk.len() as u64;
                thread::sleep(Duration::from_millis(50));
            }
            w.shutdown(Shutdown::Write).map_err(|e| format!("end: {e}"))?;
            let got = reader.join().map_err(|_| "the reader panicked".to_string())??;
            if got != sent {
                return Err(format!("sent {sent} bytes, {got} came back"));
            }
            bytes.fetch_add(sent, Ordering::Relaxed);
            return Ok(());
        }
    }
    w.shutdown(Shutdown::Write).map_err(|e| format!("end: {e}"))?;
    let mut rest = [0u8; 1];
    match r.read(&mut rest) {
        Ok(0) => Ok(()),
        Ok(_) => Err("bytes after the last answer".into()),
        Err(e) => Err(format!("the end: {e}")),
    }
}
