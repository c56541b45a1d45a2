//! Moving bytes between a connection's two sides: plain TCP into and out of an HTTP/2 stream
//! (HBONE), or plain TCP both ways (passthrough, inbound plaintext).
//!
//! Memory: a side holds no read buffer while its socket is idle: one is taken when the socket is
//! readable, starting at [`FIRST_READ`] and doubling while reads fill it, up to [`MAX_READ`].
//! An idle connection therefore costs its sockets, its task and (HBONE) its HTTP/2 stream, not
//! 2 × 256 KiB (`cargo xtask test`: `ten_thousand_idle_connections_stay_under_the_memory_bound`).
//! Large reads are what bulk transfers need: fewer, larger HTTP/2 DATA frames cost less CPU per
//! byte, up to [`MAX_READ`] (results/README.md, "Why the proxy has its shape").
//!
//! Idle timeout: a connection on which neither side has sent anything for the timeout is closed
//! (both directions count: a long download with a silent upload is not idle).

use std::{
    future::poll_fn,
    io,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use tokio::{
    io::{AsyncWrite, AsyncWriteExt as _},
    net::{tcp::OwnedReadHalf, TcpStream},
};

use crate::metrics::Meter;

/// The first read buffer a side takes once its socket is readable.
pub const FIRST_READ: usize = 4 * 1024;
/// The largest (see the module docs).
pub const MAX_READ: usize = 256 * 1024;

/// Reads a socket into buffers that exist only while there is data: none while idle, growing
/// while reads fill them.
struct GrowingReader {
    half: OwnedReadHalf,
    next: usize,
}

impl GrowingReader {
    fn new(half: OwnedReadHalf) -> Self {
        Self { half, next: FIRST_READ }
    }

    /// The next bytes read; `None` at end of stream.
    async fn read(&mut self) -> io::Result<Option<BytesMut>> {
        loop {
            self.half.readable().await?;
            let mut buf = BytesMut::with_capacity(self.next);
            match self.half.try_read_buf(&mut buf) {
                Ok(0) => return Ok(None),
                Ok(n) => {
                    if n == self.next {
                        self.next = (self.next * 2).min(MAX_READ);
                    }
                    return Ok(Some(buf));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

/// When a connection last carried a byte either way.
#[derive(Debug)]
pub struct Idle {
    start: Instant,
    last_ms: AtomicU64,
    timeout: Option<Duration>,
}

impl Idle {
    /// `None`: never times out.
    pub fn new(timeout: Option<Duration>) -> Arc<Self> {
        Arc::new(Self { start: Instant::now(), last_ms: AtomicU64::new(0), timeout })
    }

    fn touch(&self) {
        if self.timeout.is_some() {
            let now = self.start.elapsed().as_millis() as u64;
            self.last_ms.store(now, Ordering::Relaxed);
        }
    }

    /// Resolves once nothing has moved for the timeout (never without one).
    async fn expired(&self) -> Duration {
        let Some(timeout) = self.timeout else { return std::future::pending().await };
        loop {
            let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let quiet = self.start.elapsed().saturating_sub(last);
            if quiet >= timeout {
                return quiet;
            }
            tokio::time::sleep(timeout - quiet).await;
        }
    }
}

/// Copies a plain socket into an HTTP/2 stream, respecting flow control; ends the stream on EOF.
async fn copy_to_h2(
    from: OwnedReadHalf,
    mut to: SendStream<Bytes>,
    meter: &Meter,
    idle: &Idle,
) -> io::Result<u64> {
    let mut from = GrowingReader::new(from);
    let mut total = 0u64;
    loop {
        let Some(buf) = from.read().await? else {
            to.send_data(Bytes::new(), true).map_err(io::Error::other)?;
            return Ok(total);
        };
        idle.touch();
        let n = buf.len() as u64;
        total += n;
        meter.add(n);
        let mut data = buf.freeze();
        while !data.is_empty() {
            to.reserve_capacity(data.len());
            let granted = poll_fn(|cx| to.poll_capacity(cx))
                .await
                .ok_or_else(|| io::Error::new(io::ErrorKind::BrokenPipe, "HBONE stream closed"))?
                .map_err(io::Error::other)?;
            let chunk = data.split_to(granted.min(data.len()));
            to.send_data(chunk, false).map_err(io::Error::other)?;
        }
    }
}

/// Copies an HTTP/2 stream into a plain socket, releasing flow-control capacity as it goes;
/// shuts the socket's write side down at the end.
async fn copy_from_h2(
    mut from: RecvStream,
    mut to: impl AsyncWrite + Unpin,
    meter: &Meter,
    idle: &Idle,
) -> io::Result<u64> {
    let mut total = 0u64;
    while let Some(chunk) = from.data().await {
        let chunk = chunk.map_err(io::Error::other)?;
        idle.touch();
        let _ = from.flow_control().release_capacity(chunk.len());
        total += chunk.len() as u64;
        to.write_all(&chunk).await?;
        meter.add(chunk.len() as u64);
    }
    to.shutdown().await?;
    Ok(total)
}

/// Copies one plain socket into another; shuts the other's write side down at the end.
async fn copy_plain(
    from: OwnedReadHalf,
    mut to: impl AsyncWrite + Unpin,
    meter: &Meter,
    idle: &Idle,
) -> io::Result<u64> {
    let mut from = GrowingReader::new(from);
    let mut total = 0u64;
    while let Some(buf) = from.read().await? {
        idle.touch();
        to.write_all(&buf).await?;
        total += buf.len() as u64;
        meter.add(buf.len() as u64);
    }
    to.shutdown().await?;
    Ok(total)
}

/// Both directions, or an error once the connection has been idle for its timeout.
async fn both_or_idle(
    idle: &Idle,
    both: impl std::future::Future<Output = (io::Result<u64>, io::Result<u64>)>,
) -> io::Result<(u64, u64)> {
    tokio::select! {
        (x, y) = both => Ok((x?, y?)),
        quiet = idle.expired() => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("idle for {}s: closed", quiet.as_secs()),
        )),
    }
}

/// Carries `tcp` over the HTTP/2 stream both ways until both directions end, counting bytes
/// tcp → stream on `out` and stream → tcp on `back` as they move. Returns the totals.
pub async fn splice(
    tcp: TcpStream,
    send: SendStream<Bytes>,
    recv: RecvStream,
    (out, back): (&Meter, &Meter),
    idle_timeout: Option<Duration>,
) -> io::Result<(u64, u64)> {
    let idle = Idle::new(idle_timeout);
    let (r, w) = tcp.into_split();
    both_or_idle(&idle, async {
        tokio::join!(copy_to_h2(r, send, out, &idle), copy_from_h2(recv, w, back, &idle))
    })
    .await
}

/// Plain TCP both ways (passthrough, inbound plaintext), counting like `splice`.
pub async fn relay(
    a: TcpStream,
    b: TcpStream,
    (a_to_b, b_to_a): (&Meter, &Meter),
    idle_timeout: Option<Duration>,
) -> io::Result<(u64, u64)> {
    let idle = Idle::new(idle_timeout);
    let (ar, aw) = a.into_split();
    let (br, bw) = b.into_split();
    both_or_idle(&idle, async {
        tokio::join!(copy_plain(ar, bw, a_to_b, &idle), copy_plain(br, aw, b_to_a, &idle))
    })
    .await
}
