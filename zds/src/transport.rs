//! Unix `SOCK_SEQPACKET` sockets for ZDS: message boundaries kept by the kernel, file
//! descriptors passed with SCM_RIGHTS, peer credentials available.

use std::{
    io::{self, IoSlice, IoSliceMut},
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd as _, OwnedFd, RawFd},
    path::Path,
};

use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag,
    SockType, UnixAddr,
};
use prost::Message;
use tokio::io::{unix::AsyncFd, Interest};

use crate::ZdsError;

/// Largest message accepted (Istio's messages are a few hundred bytes).
const MAX_MESSAGE: usize = 64 * 1024;

/// Most descriptors one message may carry: a pod's netns and its held listeners
/// (`crate::listeners`). More are a truncated message, refused.
pub const MAX_FDS: usize = 1 + crate::listeners::MAX_PER_POD;

fn seqpacket() -> io::Result<OwnedFd> {
    Ok(socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

/// Registers an owned socket with tokio's reactor.
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd stays open, and is the same descriptor, for as long as it is owned.
    unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}

/// One ZDS connection.
#[derive(Debug)]
pub struct SeqPacket {
    fd: AsyncFd<OwnedFd>,
}

impl SeqPacket {
    /// Connects to the agent's socket at `path`.
    pub fn connect(path: &Path) -> io::Result<Self> {
        let fd = seqpacket()?;
        socket::connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
        Ok(Self { fd: register(fd)? })
    }

    /// The connected peer's process id (SO_PEERCRED).
    pub fn peer_pid(&self) -> io::Result<i32> {
        let cred = socket::getsockopt(self.fd.get_ref(), socket::sockopt::PeerCredentials)?;
        Ok(cred.pid())
    }

    /// Sends one datagram, with `fds` attached (at most [`MAX_FDS`]).
    pub async fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        if fds.len() > MAX_FDS {
            return Err(io::Error::other(format!("{} descriptors in one ZDS message", fds.len())));
        }
        let fds: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        self.fd
            .async_io(Interest::WRITABLE, |s| {
                let iov = [IoSlice::new(bytes)];
                let cmsgs =
                    if fds.is_empty() { vec![] } else { vec![ControlMessage::ScmRights(&fds)] };
                let n = socket::sendmsg::<()>(
                    s.as_raw_fd(),
                    &iov,
                    &cmsgs,
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )?;
                if n != bytes.len() {
                    return Err(io::Error::other("short ZDS send"));
                }
                Ok(())
            })
            .await
    }

    /// Receives one datagram and the descriptors that came with it. `Closed` at end of stream.
    pub async fn recv(&self) -> Result<(Vec<u8>, Vec<OwnedFd>), ZdsError> {
        let (data, fds) = self
            .fd
            .async_io(Interest::READABLE, |s| {
                let mut buf = vec![0u8; MAX_MESSAGE];
                let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
                let mut iov = [IoSliceMut::new(&mut buf)];
                let msg = socket::recvmsg::<()>(
                    s.as_raw_fd(),
                    &mut iov,
                    Some(&mut space),
                    MsgFlags::MSG_CMSG_CLOEXEC,
                )?;
                let n = msg.bytes;
                let truncated = msg.flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
                let mut fds = Vec::new();
                for c in msg.cmsgs()? {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        // SAFETY: the kernel just installed these descriptors for us.
                        fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
                    }
                }
                if truncated {
                    return Err(io::Error::other("ZDS message or its descriptors truncated"));
                }
                buf.truncate(n);
                Ok((buf, fds))
            })
            .await?;
        if data.is_empty() && fds.is_empty() {
            return Err(ZdsError::Closed);
        }
        Ok((data, fds))
    }

    /// Sends a message with `fds` attached.
    pub async fn send_msg<M: Message>(
        &self,
        m: &M,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), ZdsError> {
        Ok(self.send(&m.encode_to_vec(), fds).await?)
    }

    /// Whether the peer has closed its end (checked without waiting, and without reading
    /// anything it sent).
    pub fn peer_closed(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        // A closed peer shuts both directions of a SOCK_SEQPACKET socket down: POLLHUP, which
        // poll reports whatever was asked.
        let mut fds = [PollFd::new(self.fd.get_ref().as_fd(), PollFlags::empty())];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(_) => fds[0]
                .revents()
                .is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR)),
            Err(_) => false,
        }
    }

    /// Receives a message and its descriptors.
    pub async fn recv_msg<M: Message + Default>(&self) -> Result<(M, Vec<OwnedFd>), ZdsError> {
        let (data, fds) = self.recv().await?;
        Ok((M::decode(data.as_slice())?, fds))
    }
}

impl AsFd for SeqPacket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.get_ref().as_fd()
    }
}

/// The agent's listening socket.
#[derive(Debug)]
pub struct Listener {
    fd: AsyncFd<OwnedFd>,
}

impl Listener {
    /// Listens at `path` (a stale socket file from a previous run is replaced); the socket file
    /// is made accessible to its owner only.
    pub fn bind(path: &Path) -> io::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let fd = seqpacket()?;
        socket::bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        socket::listen(&fd, Backlog::new(16)?)?;
        Ok(Self { fd: register(fd)? })
    }

    /// Accepts one proxy.
    pub async fn accept(&self) -> io::Result<SeqPacket> {
        let fd = self
            .fd
            .async_io(Interest::READABLE, |s| {
                let raw = socket::accept4(
                    s.as_raw_fd(),
                    SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
                )?;
                // SAFETY: accept4 returned a new descriptor we now own.
                Ok(unsafe { OwnedFd::from_raw_fd(raw) })
            })
            .await?;
        Ok(SeqPacket { fd: register(fd)? })
    }
}
