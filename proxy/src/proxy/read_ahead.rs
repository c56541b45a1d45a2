//! Reading an HBONE connection's TCP socket in large reads, for rustls.
//!
//! rustls reads TLS records from its transport a little at a time (its deframer asks for 4 KiB
//! more than it holds, up to one record): a bulk HBONE stream took 78,000 `recv` calls per GB.
//! [`ReadAhead`] sits between the socket and rustls: when rustls asks for less than [`CHUNK`],
//! it reads up to [`CHUNK`] from the socket into a buffer of its own and serves rustls from it;
//! a larger request goes to the socket directly: a third of the `recv` calls per byte, at the
//! price of one copy of what is received; it buys memory rather than speed (results/README.md,
//! "Why the proxy has its shape").
//!
//! The buffer's size follows the traffic, from [`FIRST`] (a small message's records) up to
//! [`CHUNK`]: doubled when a read fills it, halved when one fills less than a quarter of it. A
//! small message never takes a [`CHUNK`]-sized buffer: past jemalloc's per-thread cache (32
//! KiB), each one was an arena allocation and free, the largest part of the CPU a 64-byte
//! round trip cost meshpath-proxy over ztunnel (`perf record` of `cargo xtask bench proxy`'s
//! request/response run).
//!
//! Memory: the buffer exists only while data is arriving. It is dropped as soon as it is
//! drained and the socket has nothing more (the read returned pending), so an idle pooled
//! HBONE connection holds none (`cargo xtask bench proxy`: `rss_kib_per_idle_conn`), and a
//! connection holds at most one [`CHUNK`] however its peer sends. Writes pass straight through.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Buf as _, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The most read from the socket at once into the buffer.
pub const CHUNK: usize = 64 * 1024;

/// The first read's size, and the least it shrinks to.
pub const FIRST: usize = 4 * 1024;

/// A transport read in [`CHUNK`]s (see the module docs).
#[derive(Debug)]
pub struct ReadAhead<T> {
    inner: T,
    /// Read from the socket, not yet handed out. Empty with no capacity while idle.
    buf: BytesMut,
    /// The size of the next read into `buf`.
    next: usize,
}

impl<T> ReadAhead<T> {
    pub fn new(inner: T) -> Self {
        Self { inner, buf: BytesMut::new(), next: FIRST }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// Bytes read from the socket and not yet handed out.
    #[cfg(test)]
    fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The buffer's capacity (0 while idle).
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.buf.capacity()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ReadAhead<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.buf.is_empty() {
            if out.remaining() >= CHUNK {
                // As large as a read of ours would be: no copy through the buffer.
                this.buf = BytesMut::new();
                return Pin::new(&mut this.inner).poll_read(cx, out);
            }
            // A fresh buffer, or the drained one's whole allocation back (an empty `BytesMut`
            // that owns its allocation reclaims it without copying).
            this.buf.reserve(this.next);
            let read = tokio_util::io::poll_read_buf(Pin::new(&mut this.inner), cx, &mut this.buf);
            match read {
                Poll::Ready(Ok(n)) if n > 0 => {
                    if n >= this.next {
                        this.next = (this.next * 2).min(CHUNK);
                    } else if n < this.next / 4 {
                        this.next = (this.next / 2).max(FIRST);
                    }
                }
                // Nothing more for now (the connection may stay idle a long time), an error, or
                // the end of stream (which nothing put in `out` says): give the buffer back.
                _ => {
                    this.buf = BytesMut::new();
                    return read.map_ok(|_| ());
                }
            }
        }
        let n = out.remaining().min(this.buf.len());
        out.put_slice(&this.buf[..n]);
        // Drained, the buffer is kept for the next read while data keeps coming.
        this.buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ReadAhead<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// A transport that counts the reads made of it.
    struct Counted<T> {
        inner: T,
        reads: usize,
    }

    impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            out: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            self.reads += 1;
            Pin::new(&mut self.inner).poll_read(cx, out)
        }
    }

    #[tokio::test]
    async fn small_reads_are_served_from_large_socket_reads_in_order() {
        let (mut tx, rx) = tokio::io::duplex(32 * CHUNK);
        let data: Vec<u8> = (0..16 * CHUNK).map(|i| (i % 251) as u8).collect();
        tx.write_all(&data).await.expect("write to the duplex");
        drop(tx);
        let mut r = ReadAhead::new(Counted { inner: rx, reads: 0 });
        let mut got = Vec::new();
        let mut small = [0u8; 4096];
        loop {
            let n = r.read(&mut small).await.expect("read through ReadAhead");
            if n == 0 {
                break;
            }
            got.extend_from_slice(&small[..n]);
        }
        assert_eq!(got, data);
        // Four reads growing from 4 KiB to 32 KiB, then 64 KiB ones, and the end of stream:
        // where 4 KiB reads would have made 257.
        assert!(r.get_ref().reads <= 4 + 16 + 1, "{} socket reads", r.get_ref().reads);
    }

    #[tokio::test]
    async fn a_small_message_takes_a_small_buffer() {
        let (mut tx, rx) = tokio::io::duplex(4 * CHUNK);
        let mut r = ReadAhead::new(rx);
        let mut small = [0u8; 4096];
        for _ in 0..3 {
            tx.write_all(&[5u8; 100]).await.expect("write to the duplex");
            assert_eq!(r.read(&mut small[..10]).await.expect("read through ReadAhead"), 10);
            assert!(r.capacity() <= FIRST, "a {} byte buffer for 100 bytes", r.capacity());
            let rest = r.read(&mut small).await.expect("read through ReadAhead");
            assert_eq!(rest, 90);
        }
    }

    #[tokio::test]
    async fn the_buffer_is_given_back_once_the_socket_has_nothing_more() {
        let (mut tx, rx) = tokio::io::duplex(4 * CHUNK);
        tx.write_all(&[7u8; 10_000]).await.expect("write to the duplex");
        let mut r = ReadAhead::new(rx);
        let mut small = [0u8; 4096];
        let mut n = 0;
        while n < 10_000 {
            n += r.read(&mut small).await.expect("read through ReadAhead");
        }
        assert_eq!(r.buffered(), 0);
        // The next read finds the socket empty: pending, and the buffer is gone.
        let more = tokio::time::timeout(std::time::Duration::from_millis(50), r.read(&mut small));
        assert!(more.await.is_err(), "nothing was sent");
        assert_eq!(r.capacity(), 0);
        tx.write_all(b"later").await.expect("write to the duplex");
        let n = r.read(&mut small).await.expect("read through ReadAhead");
        assert_eq!(&small[..n], b"later");
    }

    #[tokio::test]
    async fn a_large_read_goes_to_the_socket_directly() {
        let (mut tx, rx) = tokio::io::duplex(4 * CHUNK);
        tx.write_all(&[1u8; 1000]).await.expect("write to the duplex");
        let mut r = ReadAhead::new(rx);
        let mut big = vec![0u8; CHUNK];
        assert_eq!(r.read(&mut big).await.expect("read through ReadAhead"), 1000);
        assert_eq!(r.capacity(), 0);
    }
}
