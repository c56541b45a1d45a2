//! A plain relay's bulk bytes moved socket to socket inside the kernel: splice(2) from the
//! source socket into a pipe, then from the pipe into the destination socket. The bytes are
//! never copied into this process (two copies per byte fewer than a read and a write), which is
//! what the node-local path, passthrough and inbound plaintext spend most of their CPU on in a
//! bulk transfer.
//!
//! Taken only by a direction that has shown bulk (`copy.rs` switches once its reads have grown
//! to their largest): a pipe costs two descriptors and the kernel's pipe buffer, which a
//! request/response or idle connection does not need, and for one small message a splice saves
//! nothing. Nothing stays in the pipe between reads: each read's bytes are written out before
//! the next read, as the copy does, so a relay stopped for a hand-over leaves nothing behind in
//! it.
//!
//! A socket whose bytes arrive by the node's sk_msg shortcut (`accelerate.rs`) has them in a
//! queue splice does not read: readable, yet splice finds nothing. A read is then tried, and if
//! it finds bytes the direction goes back to copying for good ([`Filled::Read`]).

use std::{
    io,
    os::fd::{AsFd as _, AsRawFd as _, OwnedFd},
    task::{ready, Context, Poll},
};

use bytes::BytesMut;
use nix::{
    fcntl::{fcntl, splice, FcntlArg, OFlag, SpliceFFlags},
    unistd::pipe2,
};
use tokio::{io::Interest, net::TcpStream};

/// The pipe's capacity asked for: one of the copy's largest reads (`copy::MAX_READ`). A
/// process refused it (over its user's pipe quota) keeps the kernel's default, 64 KiB.
pub const PIPE_BYTES: usize = crate::proxy::copy::MAX_READ;

/// The most a read tried after an empty splice takes ([`Filled::Read`]).
const FALLBACK_READ: usize = 64 * 1024;

/// A pipe carrying one direction of a relay.
#[derive(Debug)]
pub struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

/// What [`Pipe::poll_fill`] moved.
#[derive(Debug)]
pub enum Filled {
    /// Bytes now in the pipe, to be written out with [`Pipe::drain`].
    Piped(usize),
    /// The source's end of stream.
    End,
    /// Bytes a read found where splice found none (the sk_msg shortcut): the direction must
    /// copy from now on.
    Read(BytesMut),
}

fn flags() -> SpliceFFlags {
    SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK
}

impl Pipe {
    /// A non-blocking pipe, or `None` when the process has no descriptor to spare (the
    /// direction then copies as before: nothing is refused for it).
    pub fn new() -> Option<Self> {
        let (read, write) = pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC).ok()?;
        // Refused: the default size, which only means more splices per byte.
        let _ = fcntl(write.as_raw_fd(), FcntlArg::F_SETPIPE_SZ(PIPE_BYTES as i32));
        Some(Self { read, write })
    }

    /// Moves what `from` holds into the (empty) pipe once it is readable.
    pub fn poll_fill(&self, from: &TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<Filled>> {
        loop {
            ready!(from.poll_read_ready(cx))?;
            // WouldBlock from the closure clears the readiness, so the next poll waits.
            let moved = from.try_io(Interest::READABLE, || {
                match splice(from.as_fd(), None, self.write.as_fd(), None, PIPE_BYTES, flags()) {
                    Ok(0) => Ok(Filled::End),
                    Ok(n) => Ok(Filled::Piped(n)),
                    Err(nix::errno::Errno::EAGAIN) => {
                        let mut buf = BytesMut::with_capacity(FALLBACK_READ);
                        match from.try_read_buf(&mut buf)? {
                            0 => Ok(Filled::End),
                            _ => Ok(Filled::Read(buf)),
                        }
                    }
                    Err(e) => Err(io::Error::from(e)),
                }
            });
            match moved {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }

    /// Writes the `n` bytes in the pipe to `to`, all of them.
    pub async fn drain(&self, to: &TcpStream, mut n: usize) -> io::Result<()> {
        while n > 0 {
            to.writable().await?;
            let moved = to.try_io(Interest::WRITABLE, || {
                splice(self.read.as_fd(), None, to.as_fd(), None, n, flags())
                    .map_err(io::Error::from)
            });
            match moved {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(m) => n -= m.min(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}
