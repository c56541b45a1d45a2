//! istiod's APIs as a node proxy speaks them (Istio's ztunnel speaks the same): the delta xDS
//! stream of Envoy's aggregated discovery service carrying Istio's `Address` (a workload or a
//! service) and `Authorization` resources, and the certificate service. Messages, client and
//! server are generated from proto/ (build.rs); this crate holds no logic.

#![allow(missing_docs, clippy::all, unused_qualifications)]

/// `istio.workload`: workloads and services.
pub mod workload {
    tonic::include_proto!("istio.workload");
}

/// `istio.security`: L4 authorization policies.
pub mod security {
    tonic::include_proto!("istio.security");
}

/// `istio.v1.auth`: the certificate service.
pub mod ca {
    tonic::include_proto!("istio.v1.auth");
}

/// `envoy.service.discovery.v3`: the delta stream.
pub mod discovery {
    tonic::include_proto!("envoy.service.discovery.v3");
}

/// The xDS type of workloads and services.
pub const ADDRESS_TYPE: &str = "type.googleapis.com/istio.workload.Address";
/// The xDS type of authorization policies.
pub const AUTHORIZATION_TYPE: &str = "type.googleapis.com/istio.security.Authorization";
/// The metadata key (in `IstioCertificateRequest.metadata`) under which a node proxy names the
/// identity it asks a certificate for.
pub const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";
