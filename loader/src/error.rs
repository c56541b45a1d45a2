//! The loader's typed errors. Each names the pod (by netns path or cookie) and the cause in one
//! sentence; the CLI adds context with anyhow.

use std::{io, path::PathBuf};

/// Everything that can go wrong in the loader library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Netns(#[from] meshpath_podnet::Error),

    #[error("pod {pod} (netns cookie {cookie}) is already enrolled; unenrol it first")]
    AlreadyEnrolled { pod: String, cookie: u64 },

    #[error("pod {pod}: address {ip} already belongs to the pod with netns cookie {other}")]
    AddressInUse { pod: String, ip: std::net::IpAddr, other: u64 },

    #[error("pod {pod}: {count} {what}, at most {max} per pod")]
    TooManyExclusions { pod: String, what: &'static str, count: usize, max: usize },

    #[error("pod {pod} is not enrolled")]
    NotEnrolled { pod: String },

    #[error("pod {pod}: interface {iface} not found in its network namespace")]
    NoSuchInterface { pod: String, iface: String },

    #[error(
        "the datapath pinned at {} cannot be upgraded in place: its map {map} is {found}, this \
         version's is {wanted}, and its entries cannot be carried from one to the other. The \
         node keeps the datapath it has, every pod captured as before; to move it to this \
         version, drain the node, remove that directory (as the uninstall Job's \
         remove-datapath step does) and start the agent again",
        root.display()
    )]
    StaleDatapath { root: PathBuf, map: String, found: String, wanted: String },

    #[error("bpffs is not mounted at {0} and could not be mounted: {1}")]
    Bpffs(PathBuf, io::Error),

    #[error(
        "the kernel (Linux {kernel}) rejected eBPF program {program}: {cause}; the verifier's \
         log (also in {}) follows:\n{text}",
        log.display()
    )]
    Verifier { program: String, kernel: String, cause: io::Error, log: PathBuf, text: String },

    #[error("{what}: {source}")]
    Bpf {
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

/// Result with the loader's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an aya (or other library) error with what was being done.
    pub fn bpf(what: impl Into<String>, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Bpf { what: what.into(), source: Box::new(e) }
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(what: impl Into<String>, source: io::Error) -> Self {
        Self::Io { what: what.into(), source }
    }
}
