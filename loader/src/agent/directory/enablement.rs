//! Whether a pod is in the mesh, and how, decided from its Pod and Namespace objects exactly as
//! Istio ambient decides it, plus meshpath's own per-pod options. Pure: no API calls.
//!
//! In the mesh: the pod's namespace, or the pod itself, is labelled
//! `istio.io/dataplane-mode=ambient`, and the pod is not labelled `istio.io/dataplane-mode=none`.
//! Never: pods with an Istio sidecar (`sidecar.istio.io/status`), `hostNetwork` pods, the
//! proxy's own pods, and pods of excluded namespaces.
//!
//! Options, from annotations: Istio's `ambient.istio.io/bypass-inbound-capture: "true"` (no
//! inbound capture) and `ambient.istio.io/dns-capture: "false"` (no DNS capture), read as Go's
//! ParseBool reads them (a value it rejects is ignored, as istio-cni ignores it); meshpath's
//! `meshpath.io/exclude-outbound-ports`, `meshpath.io/exclude-inbound-ports` (comma-separated
//! ports), `meshpath.io/exclude-outbound-cidrs`, `meshpath.io/exclude-inbound-cidrs`
//! (comma-separated prefixes). A meshpath annotation that does not parse leaves the pod out of
//! the mesh (never half in it) with the reason.

use std::{collections::BTreeMap, net::IpAddr};

use datapath_common::consts::k8s;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Namespace, Pod};

/// What the datapath is told to do for a meshed pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MeshOptions {
    pub capture_inbound: bool,
    pub capture_dns: bool,
    pub exclude_outbound_ports: Vec<u16>,
    pub exclude_inbound_ports: Vec<u16>,
    pub exclude_outbound_cidrs: Vec<IpNet>,
    pub exclude_inbound_cidrs: Vec<IpNet>,
}

/// A pod in the mesh: who it is and what capture it gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    /// From `status.podIPs` (empty until the kubelet wrote them).
    pub ips: Vec<IpAddr>,
    pub options: MeshOptions,
}

/// The decision for one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Meshed(Member),
    /// Not in the mesh; why (for the log).
    NotMeshed(&'static str),
    /// Asked into the mesh, but an annotation does not parse: left out; the message says which.
    Invalid(String),
}

fn label<'a>(labels: Option<&'a BTreeMap<String, String>>, key: &str) -> Option<&'a str> {
    labels.and_then(|l| l.get(key)).map(String::as_str)
}

/// Decides for `pod`, whose namespace is `ns` (None: not seen), with `excluded` namespaces.
pub fn decide(pod: &Pod, ns: Option<&Namespace>, excluded: &[String]) -> Decision {
    let meta = &pod.metadata;
    let namespace = meta.namespace.clone().unwrap_or_default();
    if excluded.contains(&namespace) {
        return Decision::NotMeshed("its namespace is excluded");
    }
    let pod_mode = label(meta.labels.as_ref(), k8s::DATAPLANE_MODE);
    if pod_mode == Some(k8s::DATAPLANE_MODE_NONE) {
        return Decision::NotMeshed("it is labelled istio.io/dataplane-mode=none");
    }
    let ns_mode = ns.and_then(|n| label(n.metadata.labels.as_ref(), k8s::DATAPLANE_MODE));
    if pod_mode != Some(k8s::DATAPLANE_MODE_AMBIENT) && ns_mode != Some(k8s::DATAPLANE_MODE_AMBIENT)
    {
        return Decision::NotMeshed("neither it nor its namespace is labelled for ambient");
    }
    if meta.annotations.as_ref().is_some_and(|a| a.contains_key(k8s::SIDECAR_STATUS)) {
        return Decision::NotMeshed("it has an Istio sidecar");
    }
    let spec = pod.spec.as_ref();
    if spec.and_then(|s| s.host_network) == Some(true) {
        return Decision::NotMeshed("it uses the host's network");
    }
    if label(meta.labels.as_ref(), k8s::APP_NAME) == Some(k8s::PROXY_APP_NAME) {
        return Decision::NotMeshed("it is the node proxy");
    }
    let options = match options(meta.annotations.as_ref()) {
        Ok(o) => o,
        Err(e) => return Decision::Invalid(e),
    };
    let ips = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ips.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|i| i.ip.parse().ok())
        .collect();
    Decision::Meshed(Member {
        uid: meta.uid.clone().unwrap_or_default(),
        name: meta.name.clone().unwrap_or_default(),
        namespace,
        service_account: spec
            .and_then(|s| s.service_account_name.clone())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "default".into()),
        ips,
        options,
    })
}

fn options(annotations: Option<&BTreeMap<String, String>>) -> Result<MeshOptions, String> {
    let get = |k: &str| annotations.and_then(|a| a.get(k)).map(|v| v.trim());
    // Istio's own boolean annotations, read as istio-cni reads them: a value Go's
    // strconv.ParseBool takes ("True", "1", "f", …) counts; any other is ignored, as if absent.
    let istio_boolean = |k: &str, default: bool| -> bool {
        annotations.and_then(|a| a.get(k)).and_then(|v| go_parse_bool(v)).unwrap_or(default)
    };
    fn list<T: std::str::FromStr>(k: &str, v: Option<&str>) -> Result<Vec<T>, String>
    where
        T::Err: std::fmt::Display,
    {
        v.into_iter()
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<T>().map_err(|e| format!("annotation {k}: {s:?}: {e}")))
            .collect()
    }
    Ok(MeshOptions {
        capture_inbound: !istio_boolean(k8s::BYPASS_INBOUND_CAPTURE, false),
        capture_dns: istio_boolean(k8s::DNS_CAPTURE, true),
        exclude_outbound_ports: list(
            k8s::EXCLUDE_OUTBOUND_PORTS,
            get(k8s::EXCLUDE_OUTBOUND_PORTS),
        )?,
        exclude_inbound_ports: list(k8s::EXCLUDE_INBOUND_PORTS, get(k8s::EXCLUDE_INBOUND_PORTS))?,
        exclude_outbound_cidrs: list(
            k8s::EXCLUDE_OUTBOUND_CIDRS,
            get(k8s::EXCLUDE_OUTBOUND_CIDRS),
        )?,
        exclude_inbound_cidrs: list(k8s::EXCLUDE_INBOUND_CIDRS, get(k8s::EXCLUDE_INBOUND_CIDRS))?,
    })
}

/// Go's `strconv.ParseBool`: exactly these spellings, nothing trimmed.
fn go_parse_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Pod {
        let map = |kv: &[(&str, &str)]| {
            Some(kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect())
        };
        let mut p = Pod::default();
        p.metadata.name = Some("web-0".into());
        p.metadata.namespace = Some("shop".into());
        p.metadata.uid = Some("u-1".into());
        p.metadata.labels = map(labels);
        p.metadata.annotations = map(annotations);
        p
    }

    fn ns(ambient: bool) -> Namespace {
        let mut n = Namespace::default();
        n.metadata.name = Some("shop".into());
        if ambient {
            n.metadata.labels = Some(
                [(k8s::DATAPLANE_MODE.to_owned(), k8s::DATAPLANE_MODE_AMBIENT.to_owned())].into(),
            );
        }
        n
    }

    fn meshed(d: &Decision) -> bool {
        matches!(d, Decision::Meshed(_))
    }

    #[test]
    fn a_pod_in_an_ambient_namespace_is_meshed() {
        assert!(meshed(&decide(&pod(&[], &[]), Some(&ns(true)), &[])));
    }

    #[test]
    fn a_pod_labelled_ambient_is_meshed_in_any_namespace() {
        let p = pod(&[(k8s::DATAPLANE_MODE, "ambient")], &[]);
        assert!(meshed(&decide(&p, Some(&ns(false)), &[])));
        assert!(meshed(&decide(&p, None, &[])));
    }

    #[test]
    fn a_pod_without_either_label_is_not_meshed() {
        assert!(!meshed(&decide(&pod(&[], &[]), Some(&ns(false)), &[])));
    }

    #[test]
    fn a_pod_labelled_none_opts_out_of_an_ambient_namespace() {
        let p = pod(&[(k8s::DATAPLANE_MODE, "none")], &[]);
        assert!(!meshed(&decide(&p, Some(&ns(true)), &[])));
    }

    #[test]
    fn sidecars_host_network_the_proxy_and_excluded_namespaces_are_left_alone() {
        let sidecar = pod(&[], &[(k8s::SIDECAR_STATUS, "{}")]);
        assert!(!meshed(&decide(&sidecar, Some(&ns(true)), &[])));
        let mut host = pod(&[], &[]);
        host.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            host_network: Some(true),
            ..Default::default()
        });
        assert!(!meshed(&decide(&host, Some(&ns(true)), &[])));
        let proxy = pod(&[(k8s::APP_NAME, k8s::PROXY_APP_NAME)], &[]);
        assert!(!meshed(&decide(&proxy, Some(&ns(true)), &[])));
        assert!(!meshed(&decide(&pod(&[], &[]), Some(&ns(true)), &["shop".into()])));
    }

    #[test]
    fn annotations_set_the_capture_options() {
        let p = pod(
            &[],
            &[
                (k8s::BYPASS_INBOUND_CAPTURE, "true"),
                (k8s::DNS_CAPTURE, "false"),
                (k8s::EXCLUDE_OUTBOUND_PORTS, "9090, 9091"),
                (k8s::EXCLUDE_INBOUND_CIDRS, "10.1.0.0/16"),
            ],
        );
        let Decision::Meshed(m) = decide(&p, Some(&ns(true)), &[]) else { panic!("not meshed") };
        assert!(!m.options.capture_inbound && !m.options.capture_dns);
        assert_eq!(m.options.exclude_outbound_ports, [9090, 9091]);
        assert_eq!(m.options.exclude_inbound_cidrs, ["10.1.0.0/16".parse::<IpNet>().expect("net")]);
        assert_eq!(m.service_account, "default");
    }

    #[test]
    fn istios_boolean_annotations_are_read_as_go_parses_booleans() {
        for (v, bypass) in
            [("True", true), ("1", true), ("T", true), ("FALSE", false), ("0", false)]
        {
            let p = pod(&[], &[(k8s::BYPASS_INBOUND_CAPTURE, v)]);
            let Decision::Meshed(m) = decide(&p, Some(&ns(true)), &[]) else { panic!("{v}") };
            assert_eq!(m.options.capture_inbound, !bypass, "{v}");
        }
    }

    #[test]
    fn an_istio_boolean_annotation_go_cannot_parse_is_ignored_and_the_pod_meshed_in_full() {
        for v in ["yes", "on", " true", "maybe"] {
            let p = pod(&[], &[(k8s::BYPASS_INBOUND_CAPTURE, v), (k8s::DNS_CAPTURE, v)]);
            let Decision::Meshed(m) = decide(&p, Some(&ns(true)), &[]) else { panic!("{v:?}") };
            assert!(m.options.capture_inbound && m.options.capture_dns, "{v:?}");
        }
    }

    #[test]
    fn a_malformed_meshpath_annotation_leaves_the_pod_out_with_the_reason() {
        for (k, v) in
            [(k8s::EXCLUDE_OUTBOUND_PORTS, "90x"), (k8s::EXCLUDE_INBOUND_CIDRS, "10.1.0.0/33")]
        {
            match decide(&pod(&[], &[(k, v)]), Some(&ns(true)), &[]) {
                Decision::Invalid(why) => assert!(why.contains(k), "{why}"),
                other => panic!("{k}={v}: {other:?}"),
            }
        }
    }
}
