//! Network namespaces: open and check a pod's netns, run code inside it, read its cookie.

use std::{
    fs::File,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use nix::{
    sched::{setns, CloneFlags},
    sys::socket::{socket, AddressFamily, SockFlag, SockType},
};

use crate::{Error, Result};

/// `SO_NETNS_COOKIE` (include/uapi/asm-generic/socket.h); not in every libc crate version.
const SO_NETNS_COOKIE: libc::c_int = 71;
/// `NS_GET_NSTYPE` ioctl on an nsfs file: `_IO(0xb7, 0x3)`.
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;

/// An open network namespace with the facts meshpath keys on.
#[derive(Debug)]
pub struct Netns {
    file: File,
    path: PathBuf,
    inode: u64,
    cookie: u64,
}

impl Netns {
    /// Opens `path` (e.g. `/var/run/netns/NAME` or `/proc/PID/ns/net`) and checks that it is a
    /// network namespace.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path)
            .map_err(|e| Error::NotANetns { path: path.to_owned(), reason: e.to_string() })?;
        Self::from_file(file, path)
    }

    /// A namespace already open (e.g. received over a unix socket); `label` names it in errors
    /// and listings.
    pub fn from_file(file: File, label: &Path) -> Result<Self> {
        let path = label;
        let not_netns = |reason: String| Error::NotANetns { path: path.to_owned(), reason };
        let fs = nix::sys::statfs::fstatfs(file.as_fd()).map_err(|e| not_netns(e.to_string()))?;
        if fs.filesystem_type() != nix::sys::statfs::NSFS_MAGIC {
            return Err(not_netns("not a namespace file".into()));
        }
        // SAFETY: NS_GET_NSTYPE takes no argument and only reads the nsfs inode.
        let ty = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_NSTYPE) };
        if ty < 0 {
            return Err(not_netns(std::io::Error::last_os_error().to_string()));
        }
        if ty != libc::CLONE_NEWNET {
            return Err(not_netns("a namespace of another type".into()));
        }
        let inode = file.metadata().map_err(|e| not_netns(e.to_string()))?.ino();
        let mut ns = Self { file, path: path.to_owned(), inode, cookie: 0 };
        ns.cookie = ns.run(read_cookie)??;
        Ok(ns)
    }

    /// The open namespace file (what netns-scoped links attach to).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The path this namespace was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The namespace's inode number (as `ls -iL` or `/proc/PID/ns/net` shows it).
    pub fn inode(&self) -> u64 {
        self.inode
    }

    /// The namespace's cookie: the key of every per-pod map.
    pub fn cookie(&self) -> u64 {
        self.cookie
    }

    /// Runs `f` on a new thread that has entered this namespace, and returns what it returns.
    /// Only that thread changes namespace; the caller's stays where it was. The mount namespace is
    /// untouched, so bpffs pins stay reachable.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        let fd = self.file.as_fd();
        std::thread::scope(|s| {
            s.spawn(|| {
                setns(fd, CloneFlags::CLONE_NEWNET).map_err(|e| {
                    Error::io(format!("entering netns {}", self.path.display()), e.into())
                })?;
                Ok(f())
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }
}

/// Reads the cookie of the calling thread's network namespace.
pub fn read_cookie() -> Result<u64> {
    let sock = socket(AddressFamily::Inet, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)
        .or_else(|_| socket(AddressFamily::Unix, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None))
        .map_err(|e| Error::io("creating a socket to read the netns cookie", e.into()))?;
    socket_cookie(sock.as_fd())
}

/// The cookie of the network namespace `sock` was made in.
pub fn socket_cookie(sock: BorrowedFd<'_>) -> Result<u64> {
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: the out-pointer and length describe a valid u64.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(Error::io(
            "getsockopt(SO_NETNS_COOKIE) (needs Linux 5.14 or later)",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(cookie)
}
