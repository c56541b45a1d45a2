//! Network namespaces: open and check a pod's netns, run code inside it (on the calling thread),
//! read its cookie.

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

    /// Runs `f` on the calling thread inside this namespace, and returns what it returns. The
    /// thread is back in its own namespace before this returns (or unwinds): see [`run_in`].
    pub fn run<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let home = File::open("/proc/thread-self/ns/net")
            .map_err(|e| Error::io("opening the calling thread's netns", e))?;
        run_in(&self.file, &home, f)
            .map_err(|e| Error::io(format!("entering netns {}", self.path.display()), e))
    }
}

/// Runs `f` on the calling thread inside the network namespace `ns`, then moves the thread
/// back to `home`, which must be the namespace it is in now (a caller that makes many sockets
/// keeps it open rather than opening `/proc/thread-self/ns/net` each time). `setns(2)` moves only
/// the calling thread, and only while `f` runs: `f` is synchronous, so nothing else runs on
/// the thread meanwhile (not even another task of an async runtime). Threads `f` starts are
/// born in `ns`. The mount namespace is untouched, so bpffs pins stay reachable.
///
/// Two `setns(2)` calls on the caller's thread, where this used to start a thread per call
/// (~0.1 ms each here, four of them per pod set-up between the agent and the proxy).
///
/// If the thread cannot go back (after `f` returns or panics), every later step run on it would
/// happen in the wrong namespace, silently: the process aborts instead (fail closed).
pub fn run_in<T>(ns: &File, home: &File, f: impl FnOnce() -> T) -> std::io::Result<T> {
    /// Moves the thread back to `home` when dropped, unwinding included.
    struct Back<'a>(BorrowedFd<'a>);

    impl Drop for Back<'_> {
        fn drop(&mut self) {
            if let Err(e) = setns(self.0, CloneFlags::CLONE_NEWNET) {
                // Straight to stderr (no logger is known to this crate), and a failed write
                // must not stop the abort: `eprintln!` would panic instead.
                use std::io::Write as _;
                let _ = writeln!(
                    std::io::stderr(),
                    "meshpath: cannot return to the thread's own network namespace ({e}); aborting"
                );
                std::process::abort();
            }
        }
    }

    setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
    let _back = Back(home.as_fd());
    Ok(f())
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

/// Every place a network namespace can be opened from on this host: the named ones
/// (`/var/run/netns`), then every process's.
fn candidates() -> impl Iterator<Item = PathBuf> {
    let named =
        std::fs::read_dir("/var/run/netns").into_iter().flatten().flatten().map(|e| e.path());
    let procs = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())))
        .map(|e| e.path().join("ns/net"));
    named.chain(procs)
}

/// Whether `path`'s namespace has this inode: its link target's, without opening it.
fn has_inode(path: &Path, inode: u64) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.ino() == inode)
}

/// Finds a network namespace by inode: at `hint` (the path it was opened from before) first,
/// then the named ones, then every process's.
pub fn find_by_inode(hint: &Path, inode: u64) -> Option<Netns> {
    let matches = |p: &Path| Netns::open(p).ok().filter(|n| n.inode() == inode);
    if let Some(n) = matches(hint) {
        return Some(n);
    }
    candidates().find_map(|p| has_inode(&p, inode).then(|| matches(&p)).flatten())
}

/// Finds each of `inodes`' network namespaces in one walk of the host's (those not found are
/// left out: their namespaces are gone).
pub fn find_all_by_inode(
    inodes: &std::collections::BTreeSet<u64>,
) -> std::collections::BTreeMap<u64, Netns> {
    let mut found = std::collections::BTreeMap::new();
    for path in candidates() {
        if found.len() == inodes.len() {
            break;
        }
        let Ok(meta) = std::fs::metadata(&path) else { continue };
        if inodes.contains(&meta.ino()) && !found.contains_key(&meta.ino()) {
            if let Ok(n) = Netns::open(&path) {
                found.insert(n.inode(), n);
            }
        }
    }
    found
}
