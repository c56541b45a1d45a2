//! `hold-connections ADDR`: an app that accepts every connection on ADDR and keeps it open,
//! without reading, so a test can hold more connections than its own descriptor limit allows
//! at both ends. Prints `listening` once bound; then, for each line on stdin, `HELD DATA`: the
//! connections accepted, and how many of them have had bytes arrive.
//!
//! Accepting never waits for a count. With std's 128-connection backlog and the accept thread
//! waiting on the lock the count held while it read 10,000 sockets, a burst overflowed the
//! queue: the kernel answered with SYN cookies, dropped the cookie's ACK at the full accept
//! queue, and kept no state to retry, so the proxy's upstream end was ESTABLISHED and idle
//! while the app never saw the connection (`nstat`: TcpExtSyncookiesSent 13, ListenOverflows
//! 339; the idle-connection test failed with 9983 of 10000 held).

use std::{
    io::{BufRead as _, Read as _},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::mpsc,
};

use socket2::{Domain, Socket, Type};

/// The listen backlog: the kernel caps it at `net.core.somaxconn` (4096 by default).
const BACKLOG: i32 = 4096;

fn listen(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    s.listen(BACKLOG)?;
    Ok(s.into())
}

fn main() -> anyhow::Result<()> {
    let addr: SocketAddr = std::env::args().nth(1).unwrap_or_default().parse()?;
    let listener = listen(addr)?;
    let (accepted, incoming) = mpsc::channel::<TcpStream>();
    std::thread::spawn(move || {
        for c in listener.incoming().flatten() {
            let _ = c.set_nonblocking(true);
            if accepted.send(c).is_err() {
                break;
            }
        }
    });
    println!("listening");
    let mut held: Vec<(TcpStream, bool)> = Vec::new();
    for _ in std::io::stdin().lock().lines() {
        held.extend(incoming.try_iter().map(|c| (c, false)));
        for (c, seen) in held.iter_mut() {
            let mut buf = [0u8; 64];
            *seen |= matches!(c.read(&mut buf), Ok(n) if n > 0);
        }
        println!("{} {}", held.len(), held.iter().filter(|(_, seen)| *seen).count());
    }
    Ok(())
}
