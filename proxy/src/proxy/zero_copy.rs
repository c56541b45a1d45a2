//! A plain relay's bulk bytes moved inside the kernel: socket → pipe → socket with splice(2),
//! never copied into the proxy's memory and out again (`copy::relay`: passthrough, inbound
//! plaintext, node-local).
//!
//! Only a direction that has shown itself bulk takes a pipe (`copy::GrowingReader` at its
//! largest read), and gives it back when its reads turn small again: a small message costs two
//! system calls either way (a read and a write, or two splices), while a pipe costs two
//! descriptors and kernel memory that an idle or chatty connection should not hold. A pipe that
//! cannot be made (out of descriptors, or past the user's pipe pages, `fs.pipe-user-pages-*`)
//! leaves the direction on read and write.
//!
//! The pipe is empty whenever the copy looks at its stop: what was spliced in is spliced out
//! before the next splice in. A hand-over (`handover`) therefore finds no byte between the two
//! sockets, as with read and write.

use std::{
    io,
    os::fd::{AsRawFd as _, OwnedFd},
    task::{ready, Context, Poll},
};

use nix::{
    fcntl::{fcntl, splice, FcntlArg, OFlag, SpliceFFlags},
    unistd::pipe2,
};
use tokio::{io::Interest, net::TcpStream};

/// The pipe size asked for: one bulk read's (`copy::MAX_READ`), so that one splice moves what
/// one read did. The kernel's default (64 KiB) if refused.
const SIZE: usize = crate::proxy::copy::MAX_READ;

/// Neither end blocks: readiness comes from tokio, as for a read.
const FLAGS: SpliceFFlags = SpliceFFlags::SPLICE_F_NONBLOCK.union(SpliceFFlags::SPLICE_F_MOVE);

/// One direction's pipe.
#[derive(Debug)]
pub struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    /// What one splice in may move: the pipe's size.
    room: usize,
}

impl Pipe {
    pub fn new() -> io::Result<Self> {
        let (read, write) = pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        let size = i32::try_from(SIZE).unwrap_or(i32::MAX);
        let room = match fcntl(write.as_raw_fd(), FcntlArg::F_SETPIPE_SZ(size)) {
            Ok(n) => n,
            Err(_) => fcntl(write.as_raw_fd(), FcntlArg::F_GETPIPE_SZ)?,
        };
        Ok(Self { read, write, room: usize::try_from(room).unwrap_or(0).max(1) })
    }

    /// Splices what `from` has into the (empty) pipe, as much as the pipe holds: the count, 0 at
    /// the end of the stream. Pending until `from` is readable.
    ///
    /// Readiness is cleared only on EAGAIN, never after a short splice as tokio's own read
    /// does: a splice may stop short of what the socket holds (each of the socket's buffers
    /// takes one of the pipe's slots), and a sender waiting on a full window would then wait
    /// for a readiness that never comes.
    pub fn poll_fill(&mut self, from: &TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        loop {
            ready!(from.poll_read_ready(cx))?;
            let spliced = from.try_io(Interest::READABLE, || {
                splice(from, None, &self.write, None, self.room, FLAGS).map_err(io::Error::from)
            });
            match spliced {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return Poll::Ready(r),
            }
        }
    }

    /// Splices the `left` bytes in the pipe into `to`, counting them down; pending while its
    /// send buffer is full. Polled by hand, not an `async fn`: a readiness future would be held
    /// in every plain relay's task, idle ones included (tests/tests/idle_connections.rs).
    pub fn poll_empty_into(
        &mut self,
        to: &TcpStream,
        left: &mut usize,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        while *left > 0 {
            ready!(to.poll_write_ready(cx))?;
            let spliced = to.try_io(Interest::WRITABLE, || {
                splice(&self.read, None, to, None, *left, FLAGS).map_err(io::Error::from)
            });
            match spliced {
                Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Ok(m) => *left = left.saturating_sub(m),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        Poll::Ready(Ok(()))
    }
}
