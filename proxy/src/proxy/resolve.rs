//! Where an outbound connection goes, decided from the store before anything is dialled:
//!
//! - a service VIP: through the service's waypoint if istiod names one, else to one of its
//!   healthy endpoints (picked at random), the port mapped to the endpoint's;
//! - any other address: the workload there, through its waypoint if it has one (unless the
//!   connection comes from that waypoint), or the address as it is.
//!
//! Waypoints are followed as ztunnel follows them: HBONE to the waypoint (a workload's address,
//! or an endpoint of the waypoint's service, on the HBONE port istiod names), the CONNECT
//! naming the original destination (the VIP, not an endpoint: the waypoint picks), the
//! waypoint's own identity verified. A waypoint that cannot be found fails the connection:
//! reaching the destination directly would skip the L7 policy the waypoint enforces.

use std::net::{IpAddr, SocketAddr};

use crate::{
    identity::Identity,
    state::{
        store::WorkloadStore,
        workloads::{parse_vip, Protocol, Service, Waypoint, WaypointAt, Workload},
    },
};

/// The `reason` of a connection to a service with no healthy endpoint.
pub const NO_ENDPOINT: &str = "no_healthy_endpoint";
/// The `reason` of a connection whose destination's waypoint cannot be found or has no
/// healthy endpoint (refused, never sent around it).
pub const UNKNOWN_WAYPOINT: &str = "unknown_waypoint";

/// Where a connection goes.
#[derive(Debug)]
pub struct Target {
    /// The destination: what the CONNECT names over HBONE, or where plain TCP is sent.
    pub addr: SocketAddr,
    /// Who is dialled, for telemetry and the identity checked: the destination workload, or
    /// the waypoint's.
    pub workload: Option<Workload>,
    /// The service the app asked for.
    pub service: Option<String>,
    /// Over HBONE: the address dialled (the destination's `ip:15008`, or the waypoint's).
    pub hbone: Option<SocketAddr>,
    /// The waypoint it goes through, for logs.
    pub waypoint: Option<Waypoint>,
}

/// Why a connection has nowhere to go: the metric `reason` and a sentence for the log.
pub type Refusal = (&'static str, String);

/// Resolves `orig`, asked by `src` (its identity and address: a connection from a waypoint
/// to the workload it serves is not sent back to the waypoint).
pub fn resolve(
    store: &WorkloadStore,
    orig: SocketAddr,
    src: (&Identity, IpAddr),
) -> Result<Target, Refusal> {
    let Some(svc) = store.service_by_vip(orig.ip()) else {
        let workload = store.by_ip(orig.ip());
        if let Some((w, wp)) = workload.and_then(|w| Some((w, w.waypoint.as_ref()?))) {
            if !is_from(store, wp, src) {
                return through(store, wp, orig, None)
                    .map_err(|why| (UNKNOWN_WAYPOINT, format!("workload {}: {why}", w.uid)));
            }
        }
        let hbone = workload
            .filter(|w| w.protocol == Protocol::Hbone)
            .map(|_| SocketAddr::new(orig.ip(), datapath_common::consts::ports::HBONE));
        return Ok(Target {
            addr: orig,
            workload: workload.cloned(),
            service: None,
            hbone,
            waypoint: None,
        });
    };
    if let Some(wp) = &svc.waypoint {
        return through(store, wp, orig, Some(svc))
            .map_err(|why| (UNKNOWN_WAYPOINT, format!("service {}: {why}", svc.hostname)));
    }
    let (w, addr) = endpoint(store, svc, orig.port(), orig.ip())
        .map_err(|why| (NO_ENDPOINT, format!("service {}: {why}", svc.hostname)))?;
    let hbone = (w.protocol == Protocol::Hbone)
        .then(|| SocketAddr::new(addr.ip(), datapath_common::consts::ports::HBONE));
    Ok(Target {
        addr,
        workload: Some(w.clone()),
        service: Some(svc.hostname.clone()),
        hbone,
        waypoint: None,
    })
}

/// `orig` sent through waypoint `wp`.
fn through(
    store: &WorkloadStore,
    wp: &Waypoint,
    orig: SocketAddr,
    svc: Option<&Service>,
) -> Result<Target, String> {
    let (w, at) = find(store, wp, orig.ip())?;
    Ok(Target {
        addr: orig,
        workload: Some(w.clone()),
        service: svc.map(|s| s.hostname.clone()),
        hbone: Some(at),
        waypoint: Some(wp.clone()),
    })
}

/// The waypoint's workload and the address its HBONE is dialled at: the workload at its
/// address, or an endpoint of the service it names (by VIP or hostname).
fn find<'s>(
    store: &'s WorkloadStore,
    wp: &Waypoint,
    like: IpAddr,
) -> Result<(&'s Workload, SocketAddr), String> {
    let port = wp.hbone_mtls_port;
    match &wp.destination {
        WaypointAt::Address(a) => {
            let ip = parse_vip(a).map_err(|e| format!("waypoint {wp}: {e}"))?;
            if let Some(svc) = store.service_by_vip(ip) {
                return endpoint(store, svc, port, like).map_err(|e| format!("waypoint {wp}: {e}"));
            }
            let w = store.by_ip(ip).ok_or_else(|| format!("waypoint {wp} not found"))?;
            Ok((w, SocketAddr::new(ip, port)))
        }
        WaypointAt::Hostname { namespace, hostname } => {
            let svc = store
                .service_by_hostname(hostname)
                .filter(|s| s.namespace == *namespace)
                .ok_or_else(|| format!("waypoint {wp} not found"))?;
            endpoint(store, svc, port, like).map_err(|e| format!("waypoint {wp}: {e}"))
        }
    }
}

/// Whether `src` is waypoint `wp` itself: its identity, from one of its addresses (ztunnel's
/// check; an identity alone could be any pod of the waypoint's service account).
fn is_from(store: &WorkloadStore, wp: &Waypoint, (id, ip): (&Identity, IpAddr)) -> bool {
    let me = |w: &Workload| w.identity() == *id && w.workload_ips.contains(&ip);
    let of_service =
        |svc: &Service| store.endpoints(svc, wp.hbone_mtls_port).into_iter().any(|(w, _)| me(w));
    match &wp.destination {
        WaypointAt::Address(a) => match parse_vip(a) {
            Ok(vip) => match store.service_by_vip(vip) {
                Some(svc) => of_service(svc),
                None => store.by_ip(vip).is_some_and(me),
            },
            Err(_) => false,
        },
        WaypointAt::Hostname { namespace, hostname } => store
            .service_by_hostname(hostname)
            .filter(|s| s.namespace == *namespace)
            .is_some_and(of_service),
    }
}

/// One healthy endpoint of `svc` for `port` (at random), at an address of `like`'s family if
/// it has one.
fn endpoint<'s>(
    store: &'s WorkloadStore,
    svc: &Service,
    port: u16,
    like: IpAddr,
) -> Result<(&'s Workload, SocketAddr), String> {
    let endpoints = store.endpoints(svc, port);
    if endpoints.is_empty() {
        return Err("no healthy endpoint".into());
    }
    let (w, target) = endpoints[random_index(endpoints.len())];
    let ip = w
        .workload_ips
        .iter()
        .find(|ip| ip.is_ipv4() == like.is_ipv4())
        .or_else(|| w.workload_ips.first())
        .copied()
        .ok_or_else(|| format!("endpoint {} has no address", w.uid))?;
    Ok((w, SocketAddr::new(ip, target)))
}

fn random_index(n: usize) -> usize {
    use ring::rand::SecureRandom as _;
    let mut b = [0u8; 8];
    let _ = ring::rand::SystemRandom::new().fill(&mut b);
    (u64::from_ne_bytes(b) % n as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store of: pod `app` (10.0.0.1) behind service `app` (VIP 10.96.0.1), pod `wp`
    /// (10.0.0.9, identity `waypoint`) behind service `wp` (10.96.0.9), plus `extra` YAML
    /// fields for the app's workload and service.
    fn store(app_waypoint: &str, svc_waypoint: &str) -> WorkloadStore {
        WorkloadStore::parse(&format!(
            "workloads:\n\
             - {{uid: c//Pod/d/app, name: app, namespace: d, serviceAccount: app, workloadIps: [10.0.0.1], protocol: HBONE, services: {{\"d/app.d.svc\": {{80: 8080}}}}{app_waypoint}}}\n\
             - {{uid: c//Pod/d/wp, name: wp, namespace: d, serviceAccount: waypoint, workloadIps: [10.0.0.9], protocol: HBONE, services: {{\"d/wp.d.svc\": {{15008: 15008}}}}}}\n\
             services:\n\
             - {{name: app, namespace: d, hostname: app.d.svc, vips: [\"/10.96.0.1\"], ports: {{80: 8080}}{svc_waypoint}}}\n\
             - {{name: wp, namespace: d, hostname: wp.d.svc, vips: [\"/10.96.0.9\"], ports: {{15008: 15008}}}}\n"
        ))
        .expect("store")
    }

    const BY_HOSTNAME: &str =
        ", waypoint: {destination: {hostname: {namespace: d, hostname: wp.d.svc}}}";
    const BY_ADDRESS: &str = ", waypoint: {destination: {address: \"/10.0.0.9\"}}";

    fn client() -> (Identity, IpAddr) {
        (Identity::new("cluster.local", "d", "client"), "10.0.0.5".parse().expect("ip"))
    }

    fn at(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    #[test]
    fn a_service_without_a_waypoint_goes_to_an_endpoint_over_its_hbone_port() {
        let s = store("", "");
        let (id, ip) = client();
        let t = resolve(&s, at("10.96.0.1:80"), (&id, ip)).expect("resolved");
        assert_eq!(t.addr, at("10.0.0.1:8080"));
        assert_eq!(t.hbone, Some(at("10.0.0.1:15008")));
        assert!(t.waypoint.is_none());
    }

    #[test]
    fn a_service_with_a_waypoint_goes_to_the_waypoint_naming_the_vip() {
        for waypoint in [BY_HOSTNAME, BY_ADDRESS] {
            let s = store("", waypoint);
            let (id, ip) = client();
            let t = resolve(&s, at("10.96.0.1:80"), (&id, ip)).expect("resolved");
            assert_eq!(t.addr, at("10.96.0.1:80"), "the CONNECT names the VIP the app asked");
            assert_eq!(t.hbone, Some(at("10.0.0.9:15008")), "{waypoint}");
            let w = t.workload.expect("the waypoint's workload");
            assert_eq!(w.identity().to_string(), "spiffe://cluster.local/ns/d/sa/waypoint");
            assert_eq!(t.service.as_deref(), Some("app.d.svc"));
        }
    }

    #[test]
    fn a_waypoint_named_by_its_service_vip_is_reached_at_an_endpoint() {
        let s = store("", ", waypoint: {destination: {address: \"/10.96.0.9\"}}");
        let (id, ip) = client();
        let t = resolve(&s, at("10.96.0.1:80"), (&id, ip)).expect("resolved");
        assert_eq!(t.hbone, Some(at("10.0.0.9:15008")));
    }

    #[test]
    fn a_workload_with_a_waypoint_is_reached_through_it_unless_the_waypoint_asks() {
        let s = store(BY_HOSTNAME, "");
        let (id, ip) = client();
        let t = resolve(&s, at("10.0.0.1:8080"), (&id, ip)).expect("resolved");
        assert_eq!((t.addr, t.hbone), (at("10.0.0.1:8080"), Some(at("10.0.0.9:15008"))));
        // The waypoint's own connection onward goes to the workload, not back to itself.
        let wp = Identity::new("cluster.local", "d", "waypoint");
        let t = resolve(&s, at("10.0.0.1:8080"), (&wp, "10.0.0.9".parse().expect("ip")))
            .expect("resolved");
        assert_eq!((t.addr, t.hbone), (at("10.0.0.1:8080"), Some(at("10.0.0.1:15008"))));
        // The waypoint's identity from another address is not the waypoint.
        let t = resolve(&s, at("10.0.0.1:8080"), (&wp, ip)).expect("resolved");
        assert_eq!(t.hbone, Some(at("10.0.0.9:15008")));
    }

    #[test]
    fn a_service_whose_endpoint_has_a_waypoint_goes_to_the_endpoint() {
        // ztunnel follows a workload's waypoint only when the app asked for the workload.
        let s = store(BY_HOSTNAME, "");
        let (id, ip) = client();
        let t = resolve(&s, at("10.96.0.1:80"), (&id, ip)).expect("resolved");
        assert_eq!(t.hbone, Some(at("10.0.0.1:15008")));
    }

    #[test]
    fn a_waypoint_that_cannot_be_found_refuses_the_connection() {
        for waypoint in [
            ", waypoint: {destination: {hostname: {namespace: d, hostname: gone.d.svc}}}",
            ", waypoint: {destination: {hostname: {namespace: other, hostname: wp.d.svc}}}",
            ", waypoint: {destination: {address: \"/10.0.0.77\"}}",
        ] {
            let s = store("", waypoint);
            let (id, ip) = client();
            let err = resolve(&s, at("10.96.0.1:80"), (&id, ip)).expect_err(waypoint);
            assert_eq!(err.0, UNKNOWN_WAYPOINT, "{}", err.1);
        }
    }

    #[test]
    fn a_waypoint_service_without_a_healthy_endpoint_refuses_the_connection() {
        let s = WorkloadStore::parse(
            "services:\n\
             - {name: app, namespace: d, hostname: app.d.svc, vips: [\"/10.96.0.1\"], waypoint: {destination: {hostname: {namespace: d, hostname: wp.d.svc}}}}\n\
             - {name: wp, namespace: d, hostname: wp.d.svc, vips: [\"/10.96.0.9\"]}\n",
        )
        .expect("store");
        let (id, ip) = client();
        let err = resolve(&s, at("10.96.0.1:80"), (&id, ip)).expect_err("resolved");
        assert_eq!(err.0, UNKNOWN_WAYPOINT);
        assert!(err.1.contains("no healthy endpoint"), "{}", err.1);
    }
}
