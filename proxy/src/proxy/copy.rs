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
    pin::Pin,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    task::{ready, Context, Poll},
    time::{Duration, Instant},
};

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use tokio::{
    io::AsyncWriteExt as _,
    net::{
        tcp::{OwnedReadHalf, OwnedWriteHalf},
        TcpStream,
    },
};

use crate::{
    metrics::Meter,
    proxy::stop::{when_woken, Stop, Watch},
};

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

    /// The next bytes read (`None` at end of stream), polled: written by hand, as the connection's task holds it for its
    /// whole life (an `async` read and a `select!` around it cost an idle connection more).
    ///
    /// The read goes through tokio's `poll_read`, not `try_read_buf`: a read shorter than the
    /// buffer tells tokio the socket is drained, so the next poll waits for the next readiness
    /// rather than calling `recv` once more to be told EAGAIN. That call was one in three of a
    /// small message's system calls here (`cargo xtask bench proxy`: `rr_syscalls`).
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<BytesMut>>> {
        // No buffer until there is something to read.
        ready!(self.half.as_ref().poll_read_ready(cx))?;
        let mut buf = BytesMut::with_capacity(self.next);
        // Pending (the readiness was stale): the buffer goes, and the task waits.
        match ready!(tokio_util::io::poll_read_buf(Pin::new(&mut self.half), cx, &mut buf))? {
            0 => Poll::Ready(Ok(None)),
            n => {
                if n >= self.next {
                    self.next = (self.next * 2).min(MAX_READ);
                }
                Poll::Ready(Ok(Some(buf)))
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

/// How one direction of an HBONE stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The sender's app ended it (FIN): the receiver's app gets one.
    Eof,
    /// Paused (`hbone::PAUSED` trailers): the sender stopped reading its app with everything
    /// read in the stream; the receiver's app gets no end, the stream resumes elsewhere.
    Paused,
}

/// What pauses a resumable stream's copy from its app: this proxy's stop, or the peer's pause,
/// which the other direction sees (its `PAUSED` trailers) and flags here.
struct Pausing<'a> {
    stop: Watch<'a>,
    peer: &'a AtomicBool,
}

impl Pausing<'_> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.peer.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        self.stop.poll_fired(cx)
    }
}

/// Copies a plain socket into an HTTP/2 stream, respecting flow control; ends the stream on EOF.
/// With `pause`: once it pauses, stops at the next read and ends the stream with
/// `hbone::PAUSED` trailers instead (the bytes not read stay in the socket).
async fn copy_to_h2(
    from: &mut GrowingReader,
    to: &mut SendStream<Bytes>,
    meter: &Meter,
    idle: &Idle,
    mut pause: Option<Pausing<'_>>,
) -> io::Result<(u64, Ended)> {
    let mut total = 0u64;
    loop {
        // A pause is seen before more data, as in `copy_plain`.
        let next = poll_fn(|cx| {
            if pause.as_mut().is_some_and(|p| p.poll(cx).is_ready()) {
                return Poll::Ready(Ok(None));
            }
            from.poll_read(cx).map_ok(Some)
        })
        .await?;
        let Some(next) = next else {
            let mut trailers = http::HeaderMap::new();
            trailers.insert(crate::proxy::hbone::PAUSED, http::HeaderValue::from(total));
            to.send_trailers(trailers).map_err(io::Error::other)?;
            return Ok((total, Ended::Paused));
        };
        let Some(buf) = next else {
            to.send_data(Bytes::new(), true).map_err(io::Error::other)?;
            return Ok((total, Ended::Eof));
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
/// shuts the socket's write side down at the end, or on an error (the app sees the end: the
/// other direction, reading the app, then ends too). With `peer_paused`: a stream the peer
/// paused leaves the socket open and sets it, so that the other direction pauses too.
async fn copy_from_h2(
    mut from: RecvStream,
    to: &mut OwnedWriteHalf,
    meter: &Meter,
    idle: &Idle,
    peer_paused: Option<&AtomicBool>,
) -> io::Result<(u64, Ended)> {
    let mut total = 0u64;
    // Written without `?` so that an error shuts the write side too, with no nested future:
    // every idle connection's task holds this one (tests/tests/idle_connections.rs).
    let failed = loop {
        match from.data().await {
            None => break None,
            Some(Err(e)) => break Some(io::Error::other(e)),
            Some(Ok(chunk)) => {
                idle.touch();
                let _ = from.flow_control().release_capacity(chunk.len());
                total += chunk.len() as u64;
                if let Err(e) = to.write_all(&chunk).await {
                    break Some(e);
                }
                meter.add(chunk.len() as u64);
            }
        }
    };
    let failed = match (failed, peer_paused) {
        (None, Some(flag)) => match poll_fn(|cx| {
            let paused = ready!(from.poll_trailers(cx))?
                .is_some_and(|t| t.contains_key(crate::proxy::hbone::PAUSED));
            if paused {
                flag.store(true, Ordering::Release);
                // The other direction runs in this task (`splice_resumable` joins the two):
                // woken, it sees the flag.
                cx.waker().wake_by_ref();
            }
            Poll::Ready(Ok::<_, h2::Error>(paused))
        })
        .await
        {
            Ok(true) => return Ok((total, Ended::Paused)),
            Ok(false) => None,
            Err(e) => Some(io::Error::other(e)),
        },
        (failed, _) => failed,
    };
    match failed {
        None => {
            to.shutdown().await?;
            Ok((total, Ended::Eof))
        }
        Some(e) => {
            let _ = to.shutdown().await;
            Err(e)
        }
    }
}

/// Copies one plain socket into another, shutting the other's write side down at the end;
/// or, once `stop` fires, stops at the next read with everything read written out
/// (`Ok(None)`: the bytes not yet read stay in the socket's buffer, for whoever takes it next).
async fn copy_plain(
    from: &mut GrowingReader,
    to: &mut OwnedWriteHalf,
    meter: &Meter,
    idle: &Idle,
    stop: &Stop,
) -> io::Result<Option<u64>> {
    let mut total = 0u64;
    let mut stopped = stop.watch();
    loop {
        // A stop is seen before more data. Not reading loses nothing: the bytes stay in the
        // socket for whoever takes it next.
        let next = poll_fn(|cx| {
            if stopped.poll_fired(cx).is_ready() {
                return Poll::Ready(Ok(None));
            }
            from.poll_read(cx).map_ok(Some)
        })
        .await?;
        let Some(next) = next else { return Ok(None) };
        let Some(buf) = next else { break };
        idle.touch();
        to.write_all(&buf).await?;
        total += buf.len() as u64;
        meter.add(buf.len() as u64);
    }
    to.shutdown().await?;
    Ok(Some(total))
}

/// Both directions, or an error once the connection has been idle for its timeout.
async fn both_or_idle<T>(
    idle: &Idle,
    both: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    tokio::select! {
        r = both => r,
        quiet = when_woken(idle.expired()) => Err(io::Error::new(
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
    meters: (&Meter, &Meter),
    idle_timeout: Option<Duration>,
) -> io::Result<(u64, u64)> {
    match splice_resumable(tcp, send, recv, meters, idle_timeout, None).await? {
        Spliced::Done(x, y) => Ok((x, y)),
        Spliced::Paused { .. } => Err(io::Error::other("paused without a pause")),
    }
}

/// How a resumable stream's splice ended.
#[derive(Debug)]
pub enum Spliced {
    /// Both directions ended; the bytes each way.
    Done(u64, u64),
    /// Paused (by `stop`, or by the peer): the app's socket, nothing read from it unsent and
    /// nothing received unwritten; the bytes each way (tcp → stream, stream → tcp).
    Paused { tcp: TcpStream, out: u64, back: u64 },
}

/// As [`splice`], for a stream both ends can pause (`resume`), with `stop` this side's reason
/// to: once it fires, or the peer paused, each direction still open pauses (stops at its
/// next read, sends `hbone::PAUSED`); a direction that had ended stays ended. Without `stop`,
/// [`splice`].
pub async fn splice_resumable(
    tcp: TcpStream,
    mut send: SendStream<Bytes>,
    recv: RecvStream,
    (out, back): (&Meter, &Meter),
    idle_timeout: Option<Duration>,
    stop: Option<&Stop>,
) -> io::Result<Spliced> {
    let idle = Idle::new(idle_timeout);
    let peer_paused = AtomicBool::new(false);
    let pause = stop.map(|stop| Pausing { stop: stop.watch(), peer: &peer_paused });
    let peer = stop.is_some().then_some(&peer_paused);
    let (r, mut w) = tcp.into_split();
    let mut r = GrowingReader::new(r);
    let ((x, ex), (y, ey)) = both_or_idle(&idle, async {
        // `join!` polls both directions on every wake of the task. The stream's side is polled
        // only when it woke the task: its poll takes h2's lock, which the connection's task
        // holds as it reads and writes for every stream. The app's side is polled on every
        // wake (a readiness check): it sees the peer's pause, which the stream's side flags.
        let (x, y) = tokio::join!(
            copy_to_h2(&mut r, &mut send, out, &idle, pause),
            when_woken(copy_from_h2(recv, &mut w, back, &idle, peer))
        );
        Ok::<_, io::Error>((x?, y?))
    })
    .await?;
    if ex == Ended::Paused || ey == Ended::Paused {
        let tcp = r.half.reunite(w).map_err(|_| io::Error::other("halves of two sockets"))?;
        return Ok(Spliced::Paused { tcp, out: x, back: y });
    }
    Ok(Spliced::Done(x, y))
}

/// How a plain relay ended.
#[derive(Debug)]
pub enum Relayed {
    /// Both directions ended; the bytes each way.
    Done(u64, u64),
    /// Stopped for a hand-over: both sockets, nothing read from either left unwritten.
    Stopped(TcpStream, TcpStream),
}

/// Plain TCP both ways (passthrough, inbound plaintext), counting like `splice`, until both
/// directions end, or until `stop` fires (a hand-over, `handover`): then each direction
/// stops at its next read, after writing out what it had read, and the sockets come back.
pub async fn relay(
    a: TcpStream,
    b: TcpStream,
    (a_to_b, b_to_a): (&Meter, &Meter),
    idle_timeout: Option<Duration>,
    stop: &Stop,
) -> io::Result<Relayed> {
    let idle = Idle::new(idle_timeout);
    let (ar, mut aw) = a.into_split();
    let (br, mut bw) = b.into_split();
    let (mut ar, mut br) = (GrowingReader::new(ar), GrowingReader::new(br));
    let (x, y) = both_or_idle(&idle, async {
        let (x, y) = tokio::join!(
            copy_plain(&mut ar, &mut bw, a_to_b, &idle, stop),
            copy_plain(&mut br, &mut aw, b_to_a, &idle, stop)
        );
        Ok::<_, io::Error>((x?, y?))
    })
    .await?;
    match (x, y) {
        (Some(x), Some(y)) => Ok(Relayed::Done(x, y)),
        // One direction may have ended before the stop: its socket is handed over half closed,
        // and whoever takes it reads its end again.
        _ => {
            let a = ar.half.reunite(aw).map_err(|_| io::Error::other("halves of two sockets"))?;
            let b = br.half.reunite(bw).map_err(|_| io::Error::other("halves of two sockets"))?;
            Ok(Relayed::Stopped(a, b))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::{io::AsyncReadExt as _, net::TcpListener};

    /// A connected pair of loopback sockets: (the end the relay holds, the far end).
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let far = TcpStream::connect(l.local_addr().expect("addr")).await.expect("connect");
        let (near, _) = l.accept().await.expect("accept");
        (near, far)
    }

    /// The hand-over's promise: a relay stopped in the middle of a bulk transfer has written
    /// out everything it read, and the rest is still in the source socket for the next owner.
    #[tokio::test]
    async fn a_relay_stopped_mid_transfer_leaves_every_byte_either_delivered_or_in_its_socket() {
        let data: Vec<u8> = (0..64 << 20).map(|i| (i % 251) as u8).collect();
        let ((src, mut writer), (dst, mut reader)) = (pair().await, pair().await);
        let (r, _src_w) = src.into_split();
        let (_dst_r, mut to) = dst.into_split();
        let mut from = GrowingReader::new(r);
        let sent = data.clone();
        let sender = tokio::spawn(async move {
            for c in sent.chunks(1 << 20) {
                if writer.write_all(c).await.is_err() {
                    break;
                }
            }
            writer
        });
        let stop = Arc::new(Stop::default());
        let receiver = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = reader.read(&mut buf).await.expect("receive");
                    if n == 0 {
                        break got;
                    }
                    got.extend_from_slice(&buf[..n]);
                    if got.len() > 16 << 20 {
                        stop.fire();
                    }
                }
            })
        };
        let meter = Meter::default();
        let copied = copy_plain(&mut from, &mut to, &meter, &Idle::new(None), &stop).await;
        assert!(copied.expect("relay").is_none(), "stopped, not ended");
        // The next owner: ends the relay's side, then reads the rest from the source.
        to.shutdown().await.expect("end the far side");
        let mut got = receiver.await.expect("receiver");
        assert_eq!(got.len() as u64, meter.get(), "read and counted, not written out");
        let mut buf = vec![0u8; 1 << 16];
        while got.len() < data.len() {
            let n = from.half.read(&mut buf).await.expect("read the rest");
            assert_ne!(n, 0, "the source ended early");
            got.extend_from_slice(&buf[..n]);
        }
        drop(sender.await.expect("sender"));
        assert!(got == data, "{} bytes of {}, or out of order", got.len(), data.len());
    }
}
