//! A gRPC channel to istiod (xDS or the CA): HTTP/2 over TLS, istiod's certificate verified
//! against a root file read at each connect (its ConfigMap can change), with the name of the
//! URL's host (or `ALT_*_HOSTNAME`), and every call carrying `authorization: Bearer <token>` (the
//! token file read again for each call: the kubelet rotates projected tokens) and `clusterid`.

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::{bail, Context as _};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tonic::{metadata::MetadataValue, service::Interceptor, Request, Status};

/// Where and how to reach one of istiod's services.
#[derive(Debug, Clone)]
pub struct ChannelConfig {
    /// `https://HOST:PORT` (a bare `HOST:PORT` is taken as https).
    pub address: String,
    /// PEM roots istiod's serving certificate must chain to.
    pub root_ca: PathBuf,
    /// Another name istiod's certificate may carry instead of the URL's host.
    pub alt_hostname: Option<String>,
    /// The service account token (a file, read for each call); none: no authorization header.
    pub token: Option<PathBuf>,
    pub cluster_id: String,
}

/// A connected channel and what each call adds to its metadata.
#[derive(Debug, Clone)]
pub struct Channel {
    pub inner: tonic::transport::Channel,
    token: Option<PathBuf>,
    cluster_id: String,
}

/// How long the TCP connect and TLS handshake to istiod may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

fn host_port(address: &str) -> anyhow::Result<(String, u16)> {
    let rest = address.strip_prefix("https://").unwrap_or(address);
    if rest.starts_with("http://") || address.starts_with("http://") {
        bail!("{address}: istiod is reached over TLS only (https://)");
    }
    let authority = rest.split('/').next().unwrap_or(rest);
    let uri: http::uri::Authority =
        authority.parse().with_context(|| format!("{address} is not https://HOST:PORT"))?;
    let port = uri.port_u16().unwrap_or(443);
    Ok((uri.host().trim_matches(['[', ']']).to_owned(), port))
}

fn roots(path: &std::path::Path) -> anyhow::Result<rustls::RootCertStore> {
    let certs: Vec<CertificateDer<'static>> =
        rustls::pki_types::pem::PemObject::pem_file_iter(path)
            .with_context(|| format!("reading istiod's root {}", path.display()))?
            .collect::<Result<_, _>>()
            .with_context(|| format!("parsing istiod's root {}", path.display()))?;
    if certs.is_empty() {
        bail!("{} holds no certificate", path.display());
    }
    let mut store = rustls::RootCertStore::empty();
    for c in certs {
        store.add(c).with_context(|| format!("a root in {}", path.display()))?;
    }
    Ok(store)
}

impl Channel {
    /// Connects: TCP, TLS (ALPN h2), HTTP/2.
    pub async fn connect(cfg: &ChannelConfig) -> anyhow::Result<Self> {
        let (host, port) = host_port(&cfg.address)?;
        let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(&cfg.root_ca)?)
        .with_no_client_auth();
        tls.alpn_protocols = vec![b"h2".to_vec()];
        let name = cfg.alt_hostname.clone().unwrap_or_else(|| host.clone());
        let server_name = ServerName::try_from(name.clone())
            .with_context(|| format!("{name} is not a server name"))?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
        let target = format!("{host}:{port}");
        let connect = tower::service_fn(move |_: http::Uri| {
            let (connector, server_name, target) =
                (connector.clone(), server_name.clone(), target.clone());
            async move {
                let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&target))
                    .await
                    .map_err(|_| {
                        std::io::Error::other(format!("connecting to {target}: timed out"))
                    })??;
                tcp.set_nodelay(true)?;
                let tls =
                    tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(server_name, tcp))
                        .await
                        .map_err(|_| {
                            std::io::Error::other("TLS handshake with istiod: timed out")
                        })??;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        });
        // The URI gives the requests their authority; TLS is the connector's, so its scheme is
        // plain http for tonic.
        let uri = if host.contains(':') {
            format!("http://[{host}]:{port}")
        } else {
            format!("http://{host}:{port}")
        };
        let inner = tonic::transport::Endpoint::from_shared(uri)?
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .connect_with_connector(connect)
            .await
            .with_context(|| format!("connecting to {}", cfg.address))?;
        Ok(Self { inner, token: cfg.token.clone(), cluster_id: cfg.cluster_id.clone() })
    }

    /// Adds the token and the cluster id to each call.
    pub fn interceptor(&self) -> CallMetadata {
        CallMetadata { token: self.token.clone(), cluster_id: self.cluster_id.clone() }
    }
}

/// The metadata every call to istiod carries.
#[derive(Debug, Clone)]
pub struct CallMetadata {
    token: Option<PathBuf>,
    cluster_id: String,
}

impl Interceptor for CallMetadata {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(path) = &self.token {
            let token = std::fs::read_to_string(path).map_err(|e| {
                Status::unauthenticated(format!("reading the token {}: {e}", path.display()))
            })?;
            let token = token.trim();
            if token.is_empty() {
                return Err(Status::unauthenticated(format!("{} is empty", path.display())));
            }
            let v = MetadataValue::try_from(format!("Bearer {token}"))
                .map_err(|_| Status::unauthenticated("the token is not a header value"))?;
            req.metadata_mut().insert("authorization", v);
        }
        if !self.cluster_id.is_empty() {
            let v = MetadataValue::try_from(self.cluster_id.as_str())
                .map_err(|_| Status::invalid_argument("the cluster id is not a header value"))?;
            req.metadata_mut().insert("clusterid", v);
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::host_port;

    #[test]
    fn istiod_addresses_are_https_host_and_port() {
        assert_eq!(
            host_port("https://istiod.istio-system.svc:15012").expect("url"),
            ("istiod.istio-system.svc".to_owned(), 15012)
        );
        assert_eq!(host_port("127.0.0.1:15012").expect("bare"), ("127.0.0.1".to_owned(), 15012));
        assert_eq!(host_port("https://[::1]:15012").expect("v6"), ("::1".to_owned(), 15012));
        assert!(host_port("http://istiod:15010").is_err(), "plaintext accepted");
    }
}
