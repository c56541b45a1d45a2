//! The cluster tests' workload (image `localhost/meshpath-testapp`, tests/tests/cluster.rs):
//! a server with an HTTP port for kubelet's probes and a TCP sink, and the clients the tests run
//! in pods with `kubectl exec`. Standard library only.
//!
//! - `serve [--http PORT] [--sink PORT]`: HTTP (8080): `GET /healthz` → 200, `GET /peer` → the
//!   client's address as this pod sees it, `GET /count` → how many connections the sink has
//!   accepted; the sink (9000) reads a connection to its end and answers
//!   `bytes=N hash=H` (FNV-1a 64 of what it read), so a sender can check every byte arrived.
//! - `send ADDR --bytes N [--seconds S]`: sends N bytes of a fixed pattern, spread over S
//!   seconds, closes its side and prints the sink's answer; exits 1 unless the sink read
//!   exactly what was sent.
//! - `get ADDR PATH`: one HTTP GET; prints the body; exits 1 unless the status is 200.

use std::{
    env,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs as _},
    process::ExitCode,
    sync::{
        atomic::{AtomicU64, Ordering},
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
        Some(other) => Err(format!("unknown command {other}; serve, send or get")),
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
    TcpListener::bind(format!("[::]:{port}")).map_err(|e| format!("listening on {port}: {e}"))
}

fn serve(args: &[String]) -> Result<(), String> {
    let http = listen(&flag(args, "--http").unwrap_or_else(|| "8080".into()))?;
    let sink = listen(&flag(args, "--sink").unwrap_or_else(|| "9000".into()))?;
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

fn resolve(addr: &str) -> Result<SocketAddr, String> {
    addr.to_socket_addrs()
        .map_err(|e| format!("{addr}: {e}"))?
        .next()
        .ok_or_else(|| format!("{addr}: no address"))
}

fn send(args: &[String]) -> Result<(), String> {
    let addr = resolve(args.first().ok_or("send ADDR --bytes N [--seconds S]")?)?;
    let total: u64 =
        flag(args, "--bytes").ok_or("--bytes N")?.parse().map_err(|e| format!("--bytes: {e}"))?;
    let seconds: f64 = flag(args, "--seconds")
        .map_or(Ok(0.0), |s| s.parse())
        .map_err(|e| format!("--seconds: {e}"))?;
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    let started = Instant::now();
    let (mut sent, mut h) = (0u64, FNV_OFFSET);
    let mut chunk = vec![0u8; 16 * 1024];
    while sent < total {
        let k = chunk.len().min((total - sent) as usize);
        for (i, b) in chunk[..k].iter_mut().enumerate() {
            *b = pattern(sent + i as u64);
        }
        conn.write_all(&chunk[..k]).map_err(|e| format!("sending at byte {sent}: {e}"))?;
        h = fnv(h, &chunk[..k]);
        sent += k as u64;
        if seconds > 0.0 {
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
