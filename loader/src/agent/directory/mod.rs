//! Which pods are in the mesh, and as whom: from the Kubernetes API (`kube`, as istio-cni's
//! node agent does) or, without a cluster, from a workloads file (`file`: ztunnel's local
//! configuration format, what the demo and most tests use). Both answer the same question with
//! the same `Decision` (`enablement`), so the rest of the agent has one code path.

pub mod enablement;
pub mod file;
pub mod kube;

use std::{path::PathBuf, sync::Arc};

pub use enablement::{Decision, Member, MeshOptions};

/// Where the agent learns which pods are meshed (the CLI's `--workloads` or `--kube`).
#[derive(Debug, Clone)]
pub enum DirectoryConfig {
    Workloads(PathBuf),
    Kube(kube::KubeConfig),
}

/// The running source.
#[derive(Debug, Clone)]
pub enum Directory {
    File(Arc<file::WorkloadsFile>),
    Kube(Arc<kube::Kube>),
}

impl Directory {
    /// Starts the source (the Kubernetes watches begin; nothing waits for them).
    pub async fn start(cfg: &DirectoryConfig) -> anyhow::Result<Self> {
        Ok(match cfg {
            DirectoryConfig::Workloads(p) => {
                Self::File(Arc::new(file::WorkloadsFile::new(p.clone())))
            }
            DirectoryConfig::Kube(k) => Self::Kube(kube::Kube::start(k.clone()).await?),
        })
    }

    /// The decision for the pod a CNI request names.
    pub async fn lookup(&self, uid: &str, namespace: &str, name: &str) -> anyhow::Result<Decision> {
        match self {
            Self::File(f) => f.lookup(uid, namespace, name),
            Self::Kube(k) => match k.decide_cached(uid, namespace, name) {
                Some(d) => Ok(d),
                // Not in the cache yet (CNI ADD can come before the pod's watch event).
                None => k.decide_live(uid, namespace, name).await,
            },
        }
    }

    /// Whether the source is up (the Kubernetes watches synced and not failing).
    pub fn healthy(&self) -> bool {
        match self {
            Self::File(_) => true,
            Self::Kube(k) => k.healthy(),
        }
    }

    /// Tells the API a pod is (`true`) or no longer is captured: the
    /// `ambient.istio.io/redirection` annotation (istiod gives a pod HBONE only with it). Best
    /// effort: the reconcile loop sets it again if this fails.
    /// While the API server does not answer, not even tried: an ADD would wait out
    /// [`kube::API_TIMEOUT`] for nothing.
    pub async fn set_redirected(&self, namespace: &str, name: &str, on: bool) {
        if let Self::Kube(k) = self {
            if !k.reachable() {
                tracing::info!(pod = %format!("{namespace}/{name}"), on, "the API server is unreachable: the redirection annotation waits for the reconcile loop");
                return;
            }
            if let Err(e) = k.annotate(namespace, name, on).await {
                tracing::warn!(pod = %format!("{namespace}/{name}"), error = %e, on, "redirection annotation not written; the reconcile loop retries");
            }
        }
    }
}
