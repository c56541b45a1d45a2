//! Raw and packet sockets in an enrolled pod (CAP_NET_RAW, which runtimes grant by default):
//! a TCP SYN the pod builds by hand never reaches a peer past the proxy, nor does a probe a peer
//! would answer (a bare ACK, a FIN: ACK and FIN scans), and the datapath counts the drop; the
//! pod's kernel still sends its own resets, and the ACKs of its TIME_WAIT sockets. Each "never
//! reaches" test has a real listener behind the destination (for the FIN, the peer's kernel at
//! a closed port), whose answer (a SYN-ACK, a reset) the sender would see, and reads the peer's
//! count of TCP segments received, which must not move; the first test shows the same SYN from
//! a pod outside the mesh is answered. A packet socket's frame is judged by what it holds: an
//! IPv4 SYN sent with the socket's protocol set to ARP, or behind one or two VLAN tags, never
//! reaches the peer either.

use std::{
    io,
    mem::MaybeUninit,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream},
    os::fd::{AsRawFd as _, FromRawFd as _},
    time::{Duration, Instant},
};

use meshpath_loader::decisions;
use meshpath_tests::{Mesh, NetnsGuard};
use socket2::{Domain, Protocol, Socket, Type};

const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const ACK: u8 = 0x10;
/// The source port the hand-built SYNs claim (no socket of the sender has it).
const SRC_PORT: u16 = 40404;

/// The one's-complement sum of 16-bit words, folded.
fn checksum(chunks: &[&[u8]]) -> u16 {
    let mut sum = 0u32;
    for chunk in chunks {
        for pair in chunk.chunks(2) {
            sum += u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]));
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A 20-byte TCP header with only SYN set, its checksum over the pseudo-header of src → dst.
fn tcp_syn(src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    tcp_segment(src, dst, SYN)
}

/// A 20-byte TCP header with `flags`, no data, its checksum over the pseudo-header of
/// src → dst.
fn tcp_segment(src: SocketAddr, dst: SocketAddr, flags: u8) -> Vec<u8> {
    let mut tcp = vec![0u8; 20];
    tcp[0..2].copy_from_slice(&src.port().to_be_bytes());
    tcp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    tcp[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    if flags & ACK != 0 {
        tcp[8..12].copy_from_slice(&0x0bad_cafeu32.to_be_bytes());
    }
    tcp[12] = 5 << 4;
    tcp[13] = flags;
    tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
    let len = (tcp.len() as u32).to_be_bytes();
    let sum = match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            checksum(&[&s.octets(), &d.octets(), &[0, 6], &len[2..], &tcp])
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            checksum(&[&s.octets(), &d.octets(), &len, &[0, 0, 0, 6], &tcp])
        }
        _ => panic!("mixed families"),
    };
    tcp[16..18].copy_from_slice(&sum.to_be_bytes());
    tcp
}

/// An IPv4 header (20 bytes, DF) in front of `tcp`.
fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, tcp: &[u8]) -> Vec<u8> {
    let mut ip = vec![0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((20 + tcp.len()) as u16).to_be_bytes());
    ip[6] = 0x40;
    ip[8] = 64;
    ip[9] = 6;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let sum = checksum(&[&ip]);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    ip.extend_from_slice(tcp);
    ip
}

/// An IPv6 header (40 bytes) in front of `tcp`.
fn ipv6(src: Ipv6Addr, dst: Ipv6Addr, tcp: &[u8]) -> Vec<u8> {
    let mut ip = vec![0u8; 40];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&(tcp.len() as u16).to_be_bytes());
    ip[6] = 6;
    ip[7] = 64;
    ip[8..24].copy_from_slice(&src.octets());
    ip[24..40].copy_from_slice(&dst.octets());
    ip.extend_from_slice(tcp);
    ip
}

/// A raw TCP socket made in `ns` (as the pod's app would make it), which also receives a copy
/// of every TCP segment arriving there.
fn raw_tcp(ns: &NetnsGuard, v6: bool) -> Socket {
    let domain = if v6 { Domain::IPV6 } else { Domain::IPV4 };
    let s = ns
        .open()
        .expect("netns")
        .run(|| Socket::new(domain, Type::RAW, Some(Protocol::TCP)))
        .expect("enter netns")
        .expect("raw socket");
    s.set_read_timeout(Some(Duration::from_millis(100))).expect("timeout");
    s
}

/// Whether a SYN-ACK from `peer` to [`SRC_PORT`] arrives on `raw` within `wait`.
fn syn_ack_from(raw: &Socket, peer: SocketAddr, wait: Duration) -> bool {
    answer_from(raw, peer, SRC_PORT, SYN | ACK, wait)
}

/// Whether a segment with (at least) `flags` from `peer` to port `to` arrives on `raw` within
/// `wait`.
fn answer_from(raw: &Socket, peer: SocketAddr, to: u16, flags: u8, wait: Duration) -> bool {
    let deadline = Instant::now() + wait;
    let mut buf = [MaybeUninit::<u8>::uninit(); 2048];
    while Instant::now() < deadline {
        let (n, from) = match meshpath_tests::again_after_eintr(|| raw.recv_from(&mut buf)) {
            Ok(r) => r,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                continue
            }
            Err(e) => panic!("reading the raw socket: {e}"),
        };
        // SAFETY: recv_from initialised the first n bytes.
        let pkt: Vec<u8> = buf[..n].iter().map(|b| unsafe { b.assume_init() }).collect();
        // IPv4 raw sockets receive the IP header, IPv6 ones start at TCP.
        let tcp = if peer.is_ipv4() { &pkt[usize::from(pkt[0] & 0x0f) * 4..] } else { &pkt[..] };
        let from_ip = from.as_socket().map(|a| a.ip());
        if tcp.len() >= 20
            && from_ip == Some(peer.ip())
            && u16::from_be_bytes([tcp[0], tcp[1]]) == peer.port()
            && u16::from_be_bytes([tcp[2], tcp[3]]) == to
            && tcp[13] & flags == flags
        {
            return true;
        }
    }
    false
}

/// TCP segments received in `ns` so far (its `Tcp: InSegs`, IPv4 and IPv6 together).
fn tcp_in_segs(ns: &NetnsGuard) -> u64 {
    let snmp = ns
        .open()
        .expect("netns")
        .run(|| std::fs::read_to_string("/proc/thread-self/net/snmp"))
        .expect("enter netns")
        .expect("snmp");
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next().expect("Tcp names"), tcp.next().expect("Tcp values"));
    let i = names.split_whitespace().position(|n| n == "InSegs").expect("InSegs");
    values.split_whitespace().nth(i).expect("InSegs value").parse().expect("a number")
}

/// How many TCP segments the datapath's guard dropped because no TCP socket sent them
/// (counted node-wide: the guard is one program for every pod).
fn dropped(mesh: &Mesh) -> u64 {
    decisions::of(&mesh.datapath(), datapath_common::decisions::NODE_WIDE)
        .expect("decisions")
        .iter()
        .find(|d| d.hook == "tc egress" && d.decision == "dropped")
        .map_or(0, |d| d.count)
}

/// A "never reaches" test: pod a meshed, a real listener in pod b at `dst`, a raw TCP socket in
/// pod a to see any answer, and pod b's count of TCP segments received before the SYN.
struct Attempt {
    mesh: Mesh,
    dst: SocketAddr,
    src: SocketAddr,
    raw: Socket,
    segs_before: u64,
    _listener: Option<std::net::TcpListener>,
}

impl Attempt {
    /// To a listener in pod b.
    fn new(v6: bool, port: u16) -> Self {
        Self::with(v6, port, true)
    }

    /// To a port of pod b where nothing listens: its kernel answers there with a reset.
    fn to_closed_port(v6: bool, port: u16) -> Self {
        Self::with(v6, port, false)
    }

    fn with(v6: bool, port: u16, listen: bool) -> Self {
        let mesh = Mesh::capturing();
        let dst = mesh.b(v6, port);
        let _listener = listen.then(|| mesh.pods.b.listen(dst).expect("listener in b"));
        let raw = raw_tcp(&mesh.pods.a, v6);
        let segs_before = tcp_in_segs(&mesh.pods.b);
        let src = SocketAddr::new(mesh.a(v6, 0).ip(), SRC_PORT);
        Self { mesh, dst, src, raw, segs_before, _listener }
    }

    /// After the SYN: no answer, nothing received by the peer, one drop counted.
    fn assert_never_reached(&self) {
        self.assert_unanswered(SYN | ACK, "SYN");
    }

    /// After a hand-built segment (`what`): no answer with `answer` set, nothing received by the
    /// peer, one drop counted.
    fn assert_unanswered(&self, answer: u8, what: &str) {
        let dst = self.dst;
        assert!(
            !answer_from(&self.raw, dst, SRC_PORT, answer, Duration::from_secs(1)),
            "{dst} answered the hand-built {what}"
        );
        assert_eq!(tcp_in_segs(&self.mesh.pods.b), self.segs_before, "pod b received TCP");
        assert!(dropped(&self.mesh) >= 1, "no drop counted");
    }
}

#[test]
fn a_raw_syn_from_a_pod_outside_the_mesh_is_answered() {
    // The control for the tests below: the same SYN, sent by pod b (not enrolled) to a
    // listener in pod a, gets its SYN-ACK.
    let mesh = Mesh::capturing();
    let dst = mesh.a(false, 8870);
    let _listener = mesh.pods.a.listen(dst).expect("listener in a");
    let raw = raw_tcp(&mesh.pods.b, false);
    let src = SocketAddr::new(mesh.pods.b_ip.into(), SRC_PORT);
    raw.send_to(&tcp_syn(src, dst), &dst.into()).expect("send");
    assert!(syn_ack_from(&raw, dst, Duration::from_secs(2)), "no SYN-ACK from {dst}");
}

#[test]
fn a_raw_socket_syn_from_a_meshed_pod_never_reaches_the_peer() {
    let t = Attempt::new(false, 8871);
    let syn = tcp_syn(t.src, t.dst);
    t.raw.send_to(&syn, &t.dst.into()).expect("the kernel accepts the send");
    t.assert_never_reached();
}

#[test]
fn a_raw_socket_syn_over_ipv6_never_reaches_the_peer() {
    let t = Attempt::new(true, 8872);
    // An IPv6 raw socket takes the destination's port as 0 (it names a protocol there).
    let to = SocketAddr::new(t.dst.ip(), 0);
    t.raw.send_to(&tcp_syn(t.src, t.dst), &to.into()).expect("the kernel accepts the send");
    t.assert_never_reached();
}

#[test]
fn a_packet_socket_syn_from_a_meshed_pod_never_reaches_the_peer() {
    let t = Attempt::new(false, 8873);
    let b_mac = mac_of_eth0(&t.mesh.pods.b);
    let pods = &t.mesh.pods;
    let frame = ipv4(pods.a_ip, pods.b_ip, &tcp_syn(t.src, t.dst));
    let sent = pods.a.open().expect("netns a").run(|| send_on_packet_socket(&frame, b_mac));
    // A packet socket hears of a drop at TC egress: ENOBUFS (NET_XMIT_DROP).
    match sent.expect("enter netns") {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
        Err(e) => panic!("sending the frame: {e}"),
    }
    t.assert_never_reached();
}

/// Ethernet's IPv4 and IPv6 ethertypes, 802.1Q and 802.1ad tags, ARP.
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const ETH_P_ARP: u16 = 0x0806;

/// A whole Ethernet frame from pod a to pod b: `tags` (each an ethertype, with VLAN 0, which a
/// receiver takes as untagged) between the addresses and IPv4 or IPv6 (the attempt's family)
/// carrying a hand-built SYN.
fn tagged_syn_frame(t: &Attempt, tags: &[u16]) -> Vec<u8> {
    let pods = &t.mesh.pods;
    syn_frame(mac_of_eth0(&pods.b), mac_of_eth0(&pods.a), t.src, t.dst, tags)
}

/// An Ethernet frame to `to_mac` from `from_mac`, `tags` (VLAN 0 each), then a SYN from `src`
/// to `dst` over their family.
fn syn_frame(
    to_mac: [u8; 6],
    from_mac: [u8; 6],
    src: SocketAddr,
    dst: SocketAddr,
    tags: &[u16],
) -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(&to_mac);
    frame.extend_from_slice(&from_mac);
    for tag in tags {
        frame.extend_from_slice(&tag.to_be_bytes());
        frame.extend_from_slice(&[0, 0]);
    }
    let syn = tcp_syn(src, dst);
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            frame.extend_from_slice(&ETH_P_IP.to_be_bytes());
            frame.extend_from_slice(&ipv4(s, d, &syn));
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            frame.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
            frame.extend_from_slice(&ipv6(s, d, &syn));
        }
        _ => panic!("mixed families"),
    }
    frame
}

/// Sends `frame` as it is (a `SOCK_RAW` packet socket) out of pod a's eth0, the socket's
/// protocol (`sll_protocol`, which becomes the kernel's idea of the frame's) `protocol`.
fn send_frame(t: &Attempt, frame: &[u8], protocol: u16) {
    let sent = t.mesh.pods.a.open().expect("netns a").run(|| send_raw_frame(frame, protocol));
    // A packet socket hears of a drop at TC egress: ENOBUFS (NET_XMIT_DROP).
    match sent.expect("enter netns") {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
        Err(e) => panic!("sending the frame: {e}"),
    }
}

/// The kernel takes a packet socket's frame to be what its `sll_protocol` says (ARP here),
/// while the receiver reads the frame's own ethertype (IPv4): the guard must read the frame.
#[test]
fn a_packet_socket_syn_labelled_as_arp_never_reaches_the_peer() {
    let t = Attempt::new(false, 8876);
    send_frame(&t, &tagged_syn_frame(&t, &[]), ETH_P_ARP);
    t.assert_never_reached();
}

/// Behind an 802.1Q tag of VLAN 0 (priority only), which the receiver strips and then reads
/// the IPv4 SYN behind it.
#[test]
fn a_packet_socket_syn_behind_a_vlan_tag_never_reaches_the_peer() {
    let t = Attempt::new(false, 8877);
    send_frame(&t, &tagged_syn_frame(&t, &[ETH_P_8021Q]), ETH_P_8021Q);
    t.assert_never_reached();
}

/// Behind two tags (802.1ad outside, 802.1Q inside), each stripped by the receiver in turn.
#[test]
fn a_packet_socket_syn_behind_two_vlan_tags_never_reaches_the_peer() {
    let t = Attempt::new(false, 8878);
    send_frame(&t, &tagged_syn_frame(&t, &[ETH_P_8021AD, ETH_P_8021Q]), ETH_P_8021AD);
    t.assert_never_reached();
}

/// IPv6 behind an 802.1Q tag of VLAN 0, the socket saying ARP.
#[test]
fn a_packet_socket_ipv6_syn_behind_a_vlan_tag_never_reaches_the_peer() {
    let t = Attempt::new(true, 8879);
    send_frame(&t, &tagged_syn_frame(&t, &[ETH_P_8021Q]), ETH_P_ARP);
    t.assert_never_reached();
}

/// The control for the frames above: the same IPv6 frame from pod b, outside the mesh, to a
/// listener in pod a is answered (the frame is one a receiver takes).
#[test]
fn a_packet_socket_ipv6_syn_behind_a_vlan_tag_from_outside_the_mesh_is_answered() {
    let mesh = Mesh::capturing();
    let dst = mesh.a(true, 8880);
    let _listener = mesh.pods.a.listen(dst).expect("listener in a");
    let raw = raw_tcp(&mesh.pods.b, true);
    let src = SocketAddr::new(mesh.b(true, 0).ip(), SRC_PORT);
    let (a_mac, b_mac) = (mac_of_eth0(&mesh.pods.a), mac_of_eth0(&mesh.pods.b));
    let frame = syn_frame(a_mac, b_mac, src, dst, &[ETH_P_8021Q]);
    let sent = mesh.pods.b.open().expect("netns b").run(|| send_raw_frame(&frame, ETH_P_ARP));
    sent.expect("enter netns").expect("sending the frame");
    assert!(syn_ack_from(&raw, dst, Duration::from_secs(2)), "no SYN-ACK from {dst}");
}

#[test]
fn a_raw_bare_ack_from_a_meshed_pod_never_reaches_the_peer() {
    // An ACK scan: a peer answers an ACK of no connection with a reset, listener or not.
    let t = Attempt::new(false, 8875);
    let ack = tcp_segment(t.src, t.dst, ACK);
    t.raw.send_to(&ack, &t.dst.into()).expect("the kernel accepts the send");
    t.assert_unanswered(RST, "ACK");
}

#[test]
fn a_raw_fin_over_ipv6_from_a_meshed_pod_never_reaches_the_peer() {
    // A FIN scan: a peer's kernel answers a FIN with a reset where nothing listens (and drops
    // it silently where something does, which is what the scan learns).
    let t = Attempt::to_closed_port(true, 8876);
    let to = SocketAddr::new(t.dst.ip(), 0);
    t.raw.send_to(&tcp_segment(t.src, t.dst, FIN), &to.into()).expect("the kernel accepts it");
    t.assert_unanswered(RST, "FIN");
}

#[test]
fn the_ack_of_a_time_wait_socket_of_the_pod_still_leaves_it() {
    // The pod's kernel answers a segment for one of its TIME_WAIT sockets with an ACK from its
    // own raw TCP socket: it must pass (or a peer whose last ACK was lost waits out its FIN
    // retries). Pod a closes first, so its end waits in TIME_WAIT; then pod b sends a segment
    // of that connection from a raw socket, and pod a's ACK must arrive.
    let mesh = Mesh::capturing();
    let server = mesh.a(false, 8877);
    let listener = mesh.pods.a.listen(server).expect("listener in a");
    let client = mesh
        .pods
        .b
        .open()
        .expect("netns b")
        .run(|| TcpStream::connect(server))
        .expect("enter netns b")
        .expect("b connects to a");
    let client_addr = client.local_addr().expect("client address");
    let (accepted, _) = listener.accept().expect("accept");
    drop(accepted);
    let mut eof = [0u8; 1];
    assert_eq!(io::Read::read(&mut &client, &mut eof).expect("read to the end"), 0);
    drop(client);
    let in_time_wait = || {
        let ss =
            mesh.pods.a.open().expect("netns a").run(|| {
                std::fs::read_to_string("/proc/thread-self/net/tcp").expect("/proc/net/tcp")
            });
        // State 06: TIME_WAIT, on the server's port (hex).
        let port = format!(":{:04X} ", server.port());
        ss.expect("enter netns a").lines().any(|l| l.contains(&port) && l.contains(" 06 "))
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    while !in_time_wait() {
        assert!(Instant::now() < deadline, "pod a's end never reached TIME_WAIT");
        std::thread::sleep(Duration::from_millis(20));
    }
    let raw = raw_tcp(&mesh.pods.b, false);
    raw.send_to(&tcp_segment(client_addr, server, ACK), &server.into()).expect("send");
    assert!(
        answer_from(&raw, server, client_addr.port(), ACK, Duration::from_secs(2)),
        "pod a's TIME_WAIT socket's ACK did not leave it"
    );
    assert_eq!(dropped(&mesh), 0);
}

#[test]
fn a_reset_from_the_pods_kernel_still_leaves_it() {
    // The kernel answers a SYN to a closed port with a reset from its own raw TCP socket: it must
    // pass, or the client waits out its SYN retries instead of being refused.
    let mesh = Mesh::capturing();
    for ip in [IpAddr::from(mesh.pods.a_ip), IpAddr::from(mesh.pods.a_ip6)] {
        let closed = SocketAddr::new(ip, 8874);
        let err = mesh
            .pods
            .b
            .open()
            .expect("netns b")
            .run(|| TcpStream::connect_timeout(&closed, Duration::from_secs(3)))
            .expect("enter netns")
            .expect_err("nothing listens there");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{closed}: {err}");
    }
    assert_eq!(dropped(&mesh), 0);
}

/// A second network between the pods, as Multus adds one: `net1` in each, pod a and pod b at
/// these addresses.
const NET1: &str = "net1";
const NET1_A: Ipv4Addr = Ipv4Addr::new(10, 198, 0, 1);
const NET1_B: Ipv4Addr = Ipv4Addr::new(10, 198, 0, 2);

/// A hand-built SYN out of `net1` of `from` (on a packet socket: the kernel adds the Ethernet
/// header) to `dst` in the other pod, whose `net1` has MAC `to_mac`; a drop is fine.
fn syn_out_of_net1(from: &NetnsGuard, src: SocketAddr, dst: SocketAddr, to_mac: [u8; 6]) {
    let (IpAddr::V4(s), IpAddr::V4(d)) = (src.ip(), dst.ip()) else { panic!("IPv4 only") };
    let packet = ipv4(s, d, &tcp_syn(src, dst));
    let sent = from
        .open()
        .expect("netns")
        .run(|| send_on(c"net1", libc::SOCK_DGRAM, &packet, ETH_P_IP, Some(to_mac)));
    match sent.expect("enter netns") {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
        Err(e) => panic!("sending the SYN out of net1: {e}"),
    }
}

/// The attempt of `a_packet_socket_syn_…` over the pods' second network, which pod a had
/// when it was enrolled (`before_enrolment`) or got after it and the guard put on it then.
fn net1_attempt(port: u16, before_enrolment: bool) -> Attempt {
    let add = |pods: &meshpath_tests::PodPair| {
        pods.add_network(NET1, NET1_A, NET1_B).expect("a second network");
    };
    let opts = meshpath_loader::pods::EnrolOptions {
        capture_outbound: true,
        ..meshpath_loader::pods::EnrolOptions::default()
    };
    let mesh = if before_enrolment {
        Mesh::prepared(opts, add)
    } else {
        let mesh = Mesh::new(opts);
        add(&mesh.pods);
        let netns = mesh.pods.a.open().expect("netns a");
        let guarded = meshpath_loader::pods::guard_unguarded_interfaces(&mesh.datapath(), &netns)
            .expect("guarding the new interface");
        assert_eq!(guarded, [NET1], "eth0 has its guard since enrolment; net1 is new");
        mesh
    };
    let dst = SocketAddr::from((NET1_B, port));
    let _listener = Some(mesh.pods.b.listen(dst).expect("listener in b"));
    let raw = raw_tcp(&mesh.pods.a, false);
    let segs_before = tcp_in_segs(&mesh.pods.b);
    let src = SocketAddr::from((NET1_A, SRC_PORT));
    Attempt { mesh, dst, src, raw, segs_before, _listener }
}

#[test]
fn a_packet_socket_syn_from_outside_the_mesh_over_a_second_network_is_answered() {
    // The control for the two tests below: pod b (not enrolled) sends the same SYN out of its
    // net1 to a listener in pod a, and gets its SYN-ACK.
    let mesh = Mesh::prepared(meshpath_loader::pods::EnrolOptions::default(), |pods| {
        pods.add_network(NET1, NET1_A, NET1_B).expect("a second network")
    });
    let dst = SocketAddr::from((NET1_A, 8880));
    let _listener = mesh.pods.a.listen(dst).expect("listener in a");
    let raw = raw_tcp(&mesh.pods.b, false);
    let src = SocketAddr::from((NET1_B, SRC_PORT));
    syn_out_of_net1(&mesh.pods.b, src, dst, mac_of(&mesh.pods.a, NET1));
    assert!(syn_ack_from(&raw, dst, Duration::from_secs(2)), "no SYN-ACK from {dst}");
}

#[test]
fn a_packet_socket_syn_out_of_a_second_interface_never_reaches_the_peer() {
    let t = net1_attempt(8881, true);
    syn_out_of_net1(&t.mesh.pods.a, t.src, t.dst, mac_of(&t.mesh.pods.b, NET1));
    t.assert_never_reached();
}

#[test]
fn a_packet_socket_syn_out_of_an_interface_added_after_enrolment_never_reaches_the_peer() {
    let t = net1_attempt(8882, false);
    syn_out_of_net1(&t.mesh.pods.a, t.src, t.dst, mac_of(&t.mesh.pods.b, NET1));
    t.assert_never_reached();
}

#[test]
fn unenrolment_takes_the_guard_off_every_interface() {
    let t = net1_attempt(8883, true);
    let netns = t.mesh.pods.a.open().expect("netns a");
    meshpath_loader::pods::unenrol_netns(&t.mesh.datapath(), &netns).expect("unenrol");
    for iface in ["eth0", NET1] {
        let filters = meshpath_tests::egress_filters(&t.mesh.pods.a, iface).expect("tc");
        assert!(!filters.contains("bpf"), "a filter is left on {iface}: {filters}");
    }
}

/// A meshed pod with a link to a node, as a CNI gives one: the pod's `eth0` and the node's
/// end of it (`host0`), in a netns of its own that stands for the node's, with a real listener
/// there. The pod is enrolled from the node's netns, as the agent enrols it from the node's:
/// that is where the node-side guard finds the end. Field order is drop order.
struct NodeSide {
    /// What the test put on the node's end before the pod was enrolled (a CNI's program).
    _before: Option<std::os::fd::OwnedFd>,
    pod: NetnsGuard,
    node: NetnsGuard,
    root: meshpath_tests::PinRoot,
    /// The listener on the node that must see nothing.
    _listener: std::net::TcpListener,
    listening_at: SocketAddr,
    cookie: u64,
}

const NODE_SIDE_POD: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 2);
const NODE_SIDE_NODE: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 1);
/// The node's end of the pod's link.
const HOST_END: &str = "host0";

impl NodeSide {
    /// `from_node`: enrolled from the node's netns (the node-side guard on `host0`), or from the
    /// test's own, which has no end of the pod's link (the pod's own guard only).
    fn new(port: u16, opts: meshpath_loader::pods::EnrolOptions, from_node: bool) -> Self {
        Self::build(port, opts, from_node, |_| None)
    }

    /// Enrolled from the node, once `before` has run on the node's netns.
    fn with_before_enrolment(
        port: u16,
        before: impl FnOnce(&NetnsGuard) -> std::os::fd::OwnedFd,
    ) -> Self {
        let opts = meshpath_loader::pods::EnrolOptions {
            capture_outbound: true,
            ..meshpath_loader::pods::EnrolOptions::default()
        };
        Self::build(port, opts, true, |node| Some(before(node)))
    }

    fn build(
        port: u16,
        opts: meshpath_loader::pods::EnrolOptions,
        from_node: bool,
        before: impl FnOnce(&NetnsGuard) -> Option<std::os::fd::OwnedFd>,
    ) -> Self {
        meshpath_tests::require_root();
        let root = meshpath_tests::PinRoot::new();
        let pod = NetnsGuard::new("mpp").expect("pod netns");
        let node = NetnsGuard::new("mpn").expect("node netns");
        meshpath_tests::veth_between((&pod, "eth0"), (&node, HOST_END)).expect("veth");
        pod.ip(&["addr", "add", &format!("{NODE_SIDE_POD}/24"), "dev", "eth0"]).expect("addr");
        node.ip(&["addr", "add", &format!("{NODE_SIDE_NODE}/24"), "dev", HOST_END]).expect("addr");
        let listening_at = SocketAddr::from((NODE_SIDE_NODE, port));
        let _listener = node.listen(listening_at).expect("listener on the node");
        let _before = before(&node);
        let dp = root.datapath().expect("datapath");
        let netns = pod.open().expect("pod netns");
        let enrol = || meshpath_loader::pods::enrol(&dp, &netns, &opts);
        let cookie = if from_node {
            node.open().expect("node netns").run(enrol).expect("enter the node's netns")
        } else {
            enrol()
        }
        .expect("enrol");
        Self { _before, pod, node, root, _listener, listening_at, cookie }
    }

    fn capturing(port: u16, from_node: bool) -> Self {
        let opts = meshpath_loader::pods::EnrolOptions {
            capture_outbound: true,
            ..meshpath_loader::pods::EnrolOptions::default()
        };
        Self::new(port, opts, from_node)
    }

    /// A hand-built SYN from the pod to the node's listener, as a whole frame on a packet
    /// socket out of the pod's eth0 (`qdisc_bypass`: past the pod's side altogether). A drop
    /// on the pod's side is fine.
    fn send_syn(&self, qdisc_bypass: bool) {
        let src = SocketAddr::from((NODE_SIDE_POD, SRC_PORT));
        let frame = syn_frame(
            mac_of(&self.node, HOST_END),
            mac_of_eth0(&self.pod),
            src,
            self.listening_at,
            &[],
        );
        let sent = self
            .pod
            .open()
            .expect("pod netns")
            .run(|| send_with(c"eth0", libc::SOCK_RAW, &frame, ETH_P_IP, None, qdisc_bypass));
        match sent.expect("enter netns") {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
            Err(e) => panic!("sending the frame: {e}"),
        }
    }

    /// How many of the pod's TCP segments the node-side guard dropped (counted for the pod).
    fn dropped_at_the_node(&self) -> u64 {
        let dp = self.root.datapath().expect("datapath");
        decisions::of(&dp, self.cookie)
            .expect("decisions")
            .iter()
            .find(|d| d.hook == "tc node ingress" && d.decision == "dropped")
            .map_or(0, |d| d.count)
    }

    /// The node-side guard's filters on the node's end, as `tc filter show` lists them.
    fn host_end_filters(&self) -> String {
        let out = self
            .node
            .open()
            .expect("node netns")
            .run(|| {
                std::process::Command::new("tc")
                    .args(["filter", "show", "dev", HOST_END, "ingress"])
                    .output()
            })
            .expect("enter netns")
            .expect("tc");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

#[test]
fn a_packet_socket_syn_with_qdisc_bypass_gets_past_the_pods_own_guard() {
    // The control for the node-side tests: with no guard on the node's end (the pod enrolled
    // from a netns that has none of its link), PACKET_QDISC_BYPASS skips the pod's own guard
    // and the node's listener answers.
    let t = NodeSide::capturing(8890, false);
    let raw = raw_tcp(&t.pod, false);
    t.send_syn(true);
    assert!(syn_ack_from(&raw, t.listening_at, Duration::from_secs(2)), "no SYN-ACK");
}

#[test]
fn a_packet_socket_syn_with_qdisc_bypass_never_reaches_the_node() {
    let t = NodeSide::capturing(8891, true);
    let raw = raw_tcp(&t.pod, false);
    let segs_before = tcp_in_segs(&t.node);
    t.send_syn(true);
    assert!(!syn_ack_from(&raw, t.listening_at, Duration::from_secs(1)), "answered");
    assert_eq!(tcp_in_segs(&t.node), segs_before, "the node received TCP");
    assert_eq!(t.dropped_at_the_node(), 1, "the drop is counted for the pod");
}

#[test]
fn a_pod_that_took_its_own_guard_off_still_sends_no_syn_past_the_node() {
    // CAP_NET_ADMIN in the pod: it deletes its clsact qdisc, and the guard with it.
    let t = NodeSide::capturing(8892, true);
    let out = t
        .pod
        .open()
        .expect("pod netns")
        .run(|| {
            std::process::Command::new("tc")
                .args(["qdisc", "del", "dev", "eth0", "clsact"])
                .output()
        })
        .expect("enter netns")
        .expect("tc");
    assert!(out.status.success(), "tc qdisc del: {}", String::from_utf8_lossy(&out.stderr));
    let raw = raw_tcp(&t.pod, false);
    let segs_before = tcp_in_segs(&t.node);
    let src = SocketAddr::from((NODE_SIDE_POD, SRC_PORT));
    raw.send_to(&tcp_syn(src, t.listening_at), &t.listening_at.into()).expect("send");
    assert!(!syn_ack_from(&raw, t.listening_at, Duration::from_secs(1)), "answered");
    assert_eq!(tcp_in_segs(&t.node), segs_before, "the node received TCP");
    assert_eq!(t.dropped_at_the_node(), 1, "the drop is counted for the pod");
}

/// A third party's TCX program on ingress of `iface` in `ns` that passes every frame
/// (`TCX_PASS`: no program or filter after it runs), as a CNI's own program on the node's end
/// of a pod's veth decides (Cilium's, from Linux 6.6 on). Two instructions loaded and linked
/// with the bpf syscall; the link lasts as long as the descriptor.
fn tcx_pass_everything(ns: &NetnsGuard, iface: &str) -> std::os::fd::OwnedFd {
    // The link's interface index is taken in the caller's netns.
    ns.open().expect("netns").run(|| tcx_pass_everything_here(iface)).expect("enter netns")
}

fn tcx_pass_everything_here(iface: &str) -> std::os::fd::OwnedFd {
    let ifindex = nix::net::if_::if_nametoindex(iface).expect("ifindex");
    // mov64 r0, 0 (TCX_PASS); exit.
    let insns: [u64; 2] = [0xb7, 0x95];
    let license = c"GPL";
    // SAFETY: bpf(2) with attributes laid out as linux/bpf.h's union bpf_attr (the rest zero),
    // pointing at buffers that outlive the calls; each descriptor is owned at once.
    unsafe {
        let mut load = [0u8; 128];
        load[0..4].copy_from_slice(&3u32.to_ne_bytes()); // BPF_PROG_TYPE_SCHED_CLS
        load[4..8].copy_from_slice(&2u32.to_ne_bytes());
        load[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
        load[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
        let prog = libc::syscall(libc::SYS_bpf, 5, load.as_ptr(), load.len()); // BPF_PROG_LOAD
        assert!(prog >= 0, "loading the pass-everything program: {}", io::Error::last_os_error());
        let prog = std::os::fd::OwnedFd::from_raw_fd(prog as i32);
        let mut create = [0u8; 128];
        create[0..4].copy_from_slice(&(prog.as_raw_fd() as u32).to_ne_bytes());
        create[4..8].copy_from_slice(&ifindex.to_ne_bytes());
        create[8..12].copy_from_slice(&46u32.to_ne_bytes()); // BPF_TCX_INGRESS
        let link = libc::syscall(libc::SYS_bpf, 28, create.as_ptr(), create.len()); // LINK_CREATE
        assert!(link >= 0, "linking it to {iface}: {}", io::Error::last_os_error());
        std::os::fd::OwnedFd::from_raw_fd(link as i32)
    }
}

#[test]
fn a_cnis_tcx_program_on_the_node_end_does_not_pre_empt_the_node_side_guard() {
    // TCX programs run before every netlink filter, and one that passes a frame ends the hook:
    // on an end where the CNI has one (attached at its ADD, before meshpath-cni's), the guard
    // goes in front of it as a TCX link.
    if !meshpath_loader::pods::tcx_supported() {
        eprintln!("this kernel has no TCX (before 6.6): no CNI can attach such a program");
        return;
    }
    let t = NodeSide::with_before_enrolment(8896, |node| tcx_pass_everything(node, HOST_END));
    let raw = raw_tcp(&t.pod, false);
    let segs_before = tcp_in_segs(&t.node);
    t.send_syn(true);
    assert!(!syn_ack_from(&raw, t.listening_at, Duration::from_secs(1)), "answered");
    assert_eq!(tcp_in_segs(&t.node), segs_before, "the node received TCP");
    assert_eq!(t.dropped_at_the_node(), 1, "the drop is counted for the pod");
}

#[test]
fn the_node_side_guard_passes_every_segment_of_the_pods_own_connections() {
    // An excluded port each way, so the pod's kernel sockets talk to the node directly: the
    // connect, the accept (a SYN-ACK from a request socket), data, the close and TIME_WAIT.
    use std::io::{Read as _, Write as _};
    let opts = meshpath_loader::pods::EnrolOptions {
        capture_outbound: true,
        capture_inbound: true,
        exclude_outbound_ports: vec![8893],
        exclude_inbound_ports: vec![8894],
        ..meshpath_loader::pods::EnrolOptions::default()
    };
    let t = NodeSide::new(8893, opts, true);
    let out = t
        .pod
        .open()
        .expect("pod netns")
        .run(|| TcpStream::connect_timeout(&t.listening_at, Duration::from_secs(2)))
        .expect("enter netns");
    let mut out = out.expect("the pod connects to the node");
    let (mut accepted, _) = t._listener.accept().expect("accept");
    out.write_all(&[7u8; 100_000]).expect("write");
    out.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let mut got = Vec::new();
    accepted.read_to_end(&mut got).expect("read");
    assert_eq!(got, vec![7u8; 100_000], "the node got every byte");
    drop((out, accepted));

    let in_pod = SocketAddr::from((NODE_SIDE_POD, 8894));
    let listener = t.pod.listen(in_pod).expect("listener in the pod");
    let conn = t
        .node
        .open()
        .expect("node netns")
        .run(|| TcpStream::connect_timeout(&in_pod, Duration::from_secs(2)))
        .expect("enter netns");
    let mut conn = conn.expect("the node connects to the pod");
    let (mut served, _) = listener.accept().expect("accept");
    served.write_all(b"from the pod").expect("write");
    drop(served);
    let mut reply = String::new();
    conn.read_to_string(&mut reply).expect("read");
    assert_eq!(reply, "from the pod");
    assert_eq!(t.dropped_at_the_node(), 0, "nothing of the pod's own was dropped");
}

/// The program ids of what guards the node's end: its netlink filters (`tc filter show`'s
/// `id N`) and its TCX links pinned in the pod's directory.
fn node_guard_programs(t: &NodeSide) -> Vec<u32> {
    let filters = t.host_end_filters();
    let words: Vec<&str> = filters.split_whitespace().collect();
    let mut ids: Vec<u32> =
        words.windows(2).filter(|w| w[0] == "id").filter_map(|w| w[1].parse().ok()).collect();
    let dir = t.root.path().join("pods").join(t.cookie.to_string());
    for entry in std::fs::read_dir(dir).expect("the pod's directory").flatten() {
        if entry.file_name().to_string_lossy().starts_with("node_guard_") {
            let link = aya::programs::links::FdLink::from(
                aya::programs::links::PinnedLink::from_pin(entry.path()).expect("pinned link"),
            );
            ids.push(link.info().expect("link info").program_id());
        }
    }
    ids
}

/// An upgrade in place, by the loader in the node's netns (where the agent runs): the pins'
/// version cleared, as if another meshpath had pinned them, then `reconcile`.
fn upgrade_from_the_node(t: &NodeSide) {
    let pin = t.root.path().join("maps/DATAPATH_VERSION");
    let mut version = aya::maps::Array::<aya::maps::MapData, u64>::try_from(aya::maps::Map::Array(
        aya::maps::MapData::from_pin(pin).expect("version map"),
    ))
    .expect("an array");
    version.set(0, 0, 0).expect("clearing the version");
    // nsenter, not `ip netns exec`, which also gives the loader a mount namespace of its own
    // (another /sys, without the pins or cgroup v2).
    let out = std::process::Command::new(meshpath_tests::cni_node::nsenter())
        .arg(format!("--net={}", t.node.path().display()))
        .arg(meshpath_tests::loader_bin())
        .arg("--pin-root")
        .arg(t.root.path())
        .arg("reconcile")
        .env("RUST_LOG", "info")
        .output()
        .expect("the loader");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && log.contains("datapath upgraded in place"), "{log}");
}

#[test]
fn an_upgrade_replaces_the_node_side_guard_and_it_still_drops() {
    let t = NodeSide::capturing(8897, true);
    let before = node_guard_programs(&t);
    assert_eq!(before.len(), 1, "one guard on the node's end: {before:?}");
    upgrade_from_the_node(&t);
    let after = node_guard_programs(&t);
    assert_eq!(after.len(), 1, "one guard on the node's end after the upgrade: {after:?}");
    assert_ne!(before, after, "the node-side guard was not replaced");
    let raw = raw_tcp(&t.pod, false);
    t.send_syn(true);
    assert!(!syn_ack_from(&raw, t.listening_at, Duration::from_secs(1)), "answered");
}

#[test]
fn an_upgrade_replaces_the_node_side_guards_tcx_link_in_front_of_a_cnis_program() {
    if !meshpath_loader::pods::tcx_supported() {
        eprintln!("this kernel has no TCX (before 6.6): the guard is a filter there");
        return;
    }
    let t = NodeSide::with_before_enrolment(8898, |node| tcx_pass_everything(node, HOST_END));
    let before = node_guard_programs(&t);
    assert_eq!(before.len(), 1, "one guard on the node's end: {before:?}");
    upgrade_from_the_node(&t);
    let after = node_guard_programs(&t);
    assert_eq!(after.len(), 1, "one guard on the node's end after the upgrade: {after:?}");
    assert_ne!(before, after, "the node-side guard's TCX link still runs the old program");
    let raw = raw_tcp(&t.pod, false);
    t.send_syn(true);
    assert!(!syn_ack_from(&raw, t.listening_at, Duration::from_secs(1)), "answered");
}

#[test]
fn unenrolment_takes_the_node_side_guard_off_and_forgets_the_end() {
    let t = NodeSide::capturing(8895, true);
    assert!(t.host_end_filters().contains("tc_node_guard"), "no guard on the node's end");
    let dp = t.root.datapath().expect("datapath");
    let netns = t.pod.open().expect("pod netns");
    t.node
        .open()
        .expect("node netns")
        .run(|| meshpath_loader::pods::unenrol_netns(&dp, &netns))
        .expect("enter netns")
        .expect("unenrol");
    let filters = t.host_end_filters();
    assert!(!filters.contains("bpf"), "a filter is left on the node's end: {filters}");
    let left: Vec<_> = dp.host_ends().expect("HOST_ENDS").keys().flatten().collect();
    assert!(left.is_empty(), "HOST_ENDS keeps {left:?}");
}

/// eth0's MAC address in `ns`.
fn mac_of_eth0(ns: &NetnsGuard) -> [u8; 6] {
    mac_of(ns, "eth0")
}

/// The MAC address of `iface` in `ns`.
fn mac_of(ns: &NetnsGuard, iface: &str) -> [u8; 6] {
    let out = ns.ip(&["-o", "link", "show", iface]).expect("ip link");
    let text = String::from_utf8_lossy(&out.stdout);
    let hex = text
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .unwrap_or_else(|| panic!("no MAC in {text}"));
    let mut mac = [0u8; 6];
    for (m, h) in mac.iter_mut().zip(hex.split(':')) {
        *m = u8::from_str_radix(h, 16).expect("hex");
    }
    mac
}

/// Sends one whole Ethernet frame out of eth0 of the calling thread's netns on a `SOCK_RAW`
/// `AF_PACKET` socket bound to `protocol`.
fn send_raw_frame(frame: &[u8], protocol: u16) -> io::Result<()> {
    send_on_eth0(libc::SOCK_RAW, frame, protocol, None)
}

/// Sends one IPv4 packet out of eth0 of the calling thread's netns on an `AF_PACKET` socket
/// (the kernel adds the Ethernet header, to `mac`).
fn send_on_packet_socket(packet: &[u8], mac: [u8; 6]) -> io::Result<()> {
    send_on_eth0(libc::SOCK_DGRAM, packet, ETH_P_IP, Some(mac))
}

/// One `sendto` on an `AF_PACKET` socket of type `ty` and `protocol` out of eth0, to `mac`
/// when the kernel is to build the Ethernet header.
fn send_on_eth0(ty: i32, bytes: &[u8], protocol: u16, mac: Option<[u8; 6]>) -> io::Result<()> {
    send_on(c"eth0", ty, bytes, protocol, mac)
}

/// One `sendto` on an `AF_PACKET` socket of type `ty` and `protocol` out of `iface`, to `mac`
/// when the kernel is to build the Ethernet header.
fn send_on(
    iface: &std::ffi::CStr,
    ty: i32,
    bytes: &[u8],
    protocol: u16,
    mac: Option<[u8; 6]>,
) -> io::Result<()> {
    send_with(iface, ty, bytes, protocol, mac, false)
}

/// As [`send_on`], the socket set to `PACKET_QDISC_BYPASS` when `qdisc_bypass`: its frames go
/// straight to the interface's driver, past every qdisc and TC program of the sender's side.
fn send_with(
    iface: &std::ffi::CStr,
    ty: i32,
    bytes: &[u8],
    protocol: u16,
    mac: Option<[u8; 6]>,
    qdisc_bypass: bool,
) -> io::Result<()> {
    // SAFETY: plain socket calls on a descriptor this function owns (closed on return), with
    // a sockaddr_ll fully initialised here.
    unsafe {
        let fd = libc::socket(libc::AF_PACKET, ty, i32::from(protocol.to_be()));
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = std::os::fd::OwnedFd::from_raw_fd(fd);
        if qdisc_bypass {
            let on: libc::c_int = 1;
            let rc = libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_QDISC_BYPASS,
                std::ptr::addr_of!(on).cast(),
                std::mem::size_of::<libc::c_int>() as u32,
            );
            if rc < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        let mut addr: libc::sockaddr_ll = std::mem::zeroed();
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = protocol.to_be();
        addr.sll_ifindex = libc::if_nametoindex(iface.as_ptr()) as i32;
        if let Some(mac) = mac {
            addr.sll_halen = 6;
            addr.sll_addr[..6].copy_from_slice(&mac);
        }
        let n = libc::sendto(
            fd.as_raw_fd(),
            bytes.as_ptr().cast(),
            bytes.len(),
            0,
            std::ptr::addr_of!(addr).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        );
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}
