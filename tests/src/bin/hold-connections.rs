//! `hold-connections ADDR`: an app that accepts every connection on ADDR and keeps it open,
//! without reading, so a test can hold more connections than its own descriptor limit allows
//! at both ends. Prints `listening` once bound; then, for each line on stdin, `HELD DATA`: the
//! connections accepted, and how many of them have had bytes arrive.

use std::{
    io::{BufRead as _, Read as _},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{Arc, Mutex},
};

fn main() -> anyhow::Result<()> {
    let addr: SocketAddr = std::env::args().nth(1).unwrap_or_default().parse()?;
    let listener = TcpListener::bind(addr)?;
    let held: Arc<Mutex<Vec<(TcpStream, bool)>>> = Arc::default();
    let h = held.clone();
    std::thread::spawn(move || {
        for c in listener.incoming().flatten() {
            let _ = c.set_nonblocking(true);
            h.lock().unwrap_or_else(|p| p.into_inner()).push((c, false));
        }
    });
    println!("listening");
    for _ in std::io::stdin().lock().lines() {
        let mut held = held.lock().unwrap_or_else(|p| p.into_inner());
        for (c, seen) in held.iter_mut() {
            let mut buf = [0u8; 64];
            *seen |= matches!(c.read(&mut buf), Ok(n) if n > 0);
        }
        println!("{} {}", held.len(), held.iter().filter(|(_, seen)| *seen).count());
    }
    Ok(())
}
