//! Real TCP traffic between pods: sinks and senders, byte counts with retransmits, a line
//! read, and the sentinel listener behind a port that must not be reached.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    thread::JoinHandle,
};

use anyhow::{Context as _, Result};
use meshpath_loader::netns::Netns;

use crate::{NetnsGuard, PodPair};

/// Reads one line (5 s at most) from a connection, without the newline.
pub fn read_line(conn: &TcpStream) -> String {
    use std::io::BufRead as _;
    conn.set_read_timeout(Some(std::time::Duration::from_secs(5))).expect("timeout");
    let mut line = String::new();
    std::io::BufReader::new(conn).read_line(&mut line).expect("read a line from the proxy");
    line.trim_end().to_owned()
}

/// A TCP server inside `ns` that counts the bytes it receives on one connection.
pub fn tcp_sink(ns: &Netns, addr: SocketAddrV4) -> Result<JoinHandle<std::io::Result<u64>>> {
    let listener = ns.run(|| TcpListener::bind(addr))??;
    Ok(std::thread::spawn(move || {
        let (mut conn, _) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        loop {
            match conn.read(&mut buf)? {
                0 => return Ok(total),
                n => total += n as u64,
            }
        }
    }))
}

/// Connects from inside `ns` to `addr` and sends exactly `bytes` bytes, then closes.
pub fn tcp_send(ns: &Netns, addr: SocketAddrV4, bytes: usize) -> Result<u64> {
    let mut conn = ns.run(|| TcpStream::connect(SocketAddr::V4(addr)))??;
    let chunk = vec![0x5au8; 1 << 16];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len());
        conn.write_all(&chunk[..n])?;
        left -= n;
    }
    conn.shutdown(std::net::Shutdown::Write)?;
    // Wait for the peer to close so every segment has crossed both TC hooks.
    let mut rest = [0u8; 1];
    let _ = conn.read(&mut rest)?;
    retransmitted_at_most(&conn)
}

/// At most how many payload bytes `conn` sent twice: its retransmitted segments (TCP_INFO's
/// `tcpi_total_retrans`) times its MSS. A loaded machine retransmits now and then, and a
/// counter of bytes on the wire rightly counts those bytes again.
fn retransmitted_at_most(conn: &TcpStream) -> Result<u64> {
    let info = tcp_info(conn)?;
    Ok(u64::from(info.tcpi_total_retrans) * u64::from(info.tcpi_snd_mss))
}

fn tcp_info(conn: &TcpStream) -> Result<libc::tcp_info> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: an all-zero tcp_info is valid; getsockopt writes at most `len` bytes into it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` outlive the call and describe the buffer.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("TCP_INFO");
    }
    Ok(info)
}

/// Sends `bytes` from pod a to pod b over TCP and returns what b received.
pub fn transfer(pods: &PodPair, port: u16, bytes: usize) -> Result<u64> {
    Ok(transfer_counting_retransmits(pods, port, bytes)?.0)
}

/// As [`transfer`], with at most how many payload bytes the sender retransmitted.
pub fn transfer_counting_retransmits(
    pods: &PodPair,
    port: u16,
    bytes: usize,
) -> Result<(u64, u64)> {
    let (a, b) = (pods.a.open()?, pods.b.open()?);
    let addr = SocketAddrV4::new(pods.b_ip, port);
    let sink = tcp_sink(&b, addr)?;
    let retransmitted = tcp_send(&a, addr, bytes)?;
    let got = sink.join().map_err(|_| anyhow::anyhow!("sink panicked"))??;
    Ok((got, retransmitted))
}

/// A real listener behind a port that a test says must not be reached. Without one, a
/// connection that leaked around the proxy would be refused all the same, and the check would
/// pass whether or not capture works.
#[derive(Debug)]
pub struct Sentinel {
    listener: TcpListener,
    addr: SocketAddr,
}

impl Sentinel {
    /// Listens on `addr` inside `ns`.
    pub fn new(ns: &NetnsGuard, addr: SocketAddr) -> Self {
        let listener = ns.listen(addr).expect("sentinel listener");
        listener.set_nonblocking(true).expect("nonblocking");
        Self { listener, addr }
    }

    /// Panics if any connection reached it.
    pub fn assert_untouched(&self, what: &str) {
        match self.listener.accept() {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Ok((_, peer)) => panic!("{what}: {} was reached from {peer}", self.addr),
            Err(e) => panic!("{what}: sentinel on {}: {e}", self.addr),
        }
    }
}
