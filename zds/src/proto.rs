//! The messages of `zds.proto` (package `istio.workload.zds`), with Istio's field numbers.

/// Protocol version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Version {
    NotUsed = 0,
    V1 = 1,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ZdsHello {
    #[prost(enumeration = "Version", tag = "1")]
    pub version: i32,
    /// meshpath's extension (`crate::listeners`): this proxy gives its pods' listening sockets
    /// to the agent and takes them back. Istio's agent ignores the field; ztunnel never sets it.
    #[prost(bool, tag = "1000")]
    pub meshpath_held_listeners: bool,
    /// meshpath's extension (`crate::connections`): this proxy takes the open connections a
    /// previous one handed over (`TakeConnection`).
    #[prost(bool, tag = "1001")]
    pub meshpath_takes_connections: bool,
    /// meshpath's extension (`crate::connections`): this connection is not a proxy's session
    /// but a draining proxy handing its open connections over (`HeldConnection`s, each acked).
    /// Sent only to an agent that said `hold_connections`.
    #[prost(bool, tag = "1002")]
    pub meshpath_hand_over: bool,
    /// meshpath's extension (`crate::connections`): this proxy also takes paused HBONE streams
    /// (`HeldConnection::stream`, one descriptor each) and resumes them with their peer.
    #[prost(bool, tag = "1003")]
    pub meshpath_takes_streams: bool,
    /// meshpath's extension (`crate::connections`): this proxy also takes node-local
    /// connections (`HeldConnection::peer_uid`: one socket in each of two pods' netns).
    #[prost(bool, tag = "1004")]
    pub meshpath_takes_node_local: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadInfo {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(string, tag = "3")]
    pub service_account: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AddWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
    /// meshpath's extension, sent only to a proxy that said `meshpath_held_listeners`: the
    /// descriptors after the netns are the pod's listeners the agent held (use them rather than
    /// binding new ones), and the ack is to carry a duplicate of each listener the pod has.
    #[prost(bool, tag = "1000")]
    pub hold_listeners: bool,
    /// meshpath's extension, sent only to a proxy that said `meshpath_takes_connections`: on
    /// SIGTERM the proxy may hand this pod's open connections to the agent, which gives them to
    /// the next proxy (`crate::connections`).
    #[prost(bool, tag = "1001")]
    pub hold_connections: bool,
    /// meshpath's extension, sent only to a proxy that said `meshpath_takes_streams`: the
    /// agent also holds the pod's paused HBONE streams (`HeldConnection::stream`).
    #[prost(bool, tag = "1002")]
    pub hold_streams: bool,
    /// meshpath's extension, sent only to a proxy that said `meshpath_takes_node_local`: the
    /// agent also holds the connections the proxy carries between two of its pods
    /// (`HeldConnection::peer_uid`).
    #[prost(bool, tag = "1003")]
    pub hold_node_local: bool,
}

/// Which side of the proxy a handed-over connection came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum ConnectionDirection {
    Unspecified = 0,
    /// The pod's app opened it (captured on 15001), to a destination outside the mesh.
    Outbound = 1,
    /// A client outside the mesh opened it to the pod (captured on 15006).
    Inbound = 2,
}

/// meshpath's extension: one open plain-TCP connection a draining proxy hands over, with two
/// descriptors: the socket the proxy accepted, then the one it opened. Both are sockets of the
/// pod's netns. The proxy has stopped reading both and written out all it had read: every byte
/// not yet carried is in the kernel's buffers of these sockets.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeldConnection {
    /// The pod it belongs to.
    #[prost(string, tag = "1")]
    pub uid: String,
    #[prost(enumeration = "ConnectionDirection", tag = "2")]
    pub direction: i32,
    /// The client's address (the app's, or the outside client's).
    #[prost(string, tag = "3")]
    pub src: String,
    /// The destination the client asked for.
    #[prost(string, tag = "4")]
    pub dst: String,
    /// Bytes carried so far, client to destination and back (for telemetry).
    #[prost(uint64, tag = "5")]
    pub sent: u64,
    #[prost(uint64, tag = "6")]
    pub received: u64,
    /// Milliseconds since the Unix epoch at which the first proxy accepted it.
    #[prost(uint64, tag = "7")]
    pub opened_unix_ms: u64,
    /// Set for a paused HBONE stream between two meshpath proxies: then the one descriptor is
    /// the app's side (the socket the proxy accepted, or opened to the app); the other side is
    /// the peer proxy's, which resumes the stream with the next proxy.
    #[prost(message, optional, tag = "8")]
    pub stream: Option<HeldStream>,
    /// Set for a node-local connection (between two pods of the node, carried by the proxy
    /// with no HBONE between them): the pod whose netns the second descriptor (the opened
    /// socket, to the destination's app) is of. The first is of `uid`'s, the source pod's.
    #[prost(string, tag = "9")]
    pub peer_uid: String,
}

/// What resumes a paused HBONE stream (`meshpath_proxy::proxy::resume`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeldStream {
    /// The stream's resume token, issued by the server side.
    #[prost(bytes = "vec", tag = "1")]
    pub token: Vec<u8>,
    /// This side opened the stream (it dials the peer again); otherwise it waits for the peer.
    #[prost(bool, tag = "2")]
    pub client: bool,
    /// Client side: the HBONE address to dial.
    #[prost(string, tag = "3")]
    pub gateway: String,
    /// The identity at the other end (SPIFFE URI): the only one the stream resumes with.
    #[prost(string, tag = "4")]
    pub peer_identity: String,
    /// Bytes carried since the stream opened, client to server and server to client: both ends
    /// must agree on them to resume.
    #[prost(uint64, tag = "5")]
    pub to_server: u64,
    #[prost(uint64, tag = "6")]
    pub to_client: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeepWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DelWorkload {
    #[prost(string, tag = "2")]
    pub uid: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotSent {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Ack {
    #[prost(string, tag = "1")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadRequest {
    #[prost(oneof = "workload_request::Payload", tags = "1, 5, 2, 3, 1000")]
    pub payload: Option<workload_request::Payload>,
}

pub mod workload_request {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Payload {
        #[prost(message, tag = "1")]
        Add(super::AddWorkload),
        #[prost(message, tag = "5")]
        Keep(super::KeepWorkload),
        #[prost(message, tag = "2")]
        Del(super::DelWorkload),
        #[prost(message, tag = "3")]
        SnapshotSent(super::SnapshotSent),
        /// meshpath's extension: serve this connection a previous proxy handed over (its two
        /// descriptors attached), for a pod added earlier in the session.
        #[prost(message, tag = "1000")]
        TakeConnection(super::HeldConnection),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadResponse {
    #[prost(oneof = "workload_response::Payload", tags = "1")]
    pub payload: Option<workload_response::Payload>,
}

pub mod workload_response {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Payload {
        #[prost(message, tag = "1")]
        Ack(super::Ack),
    }
}

impl WorkloadResponse {
    /// An ack: success, or the error text.
    pub fn ack(result: Result<(), String>) -> Self {
        Self {
            payload: Some(workload_response::Payload::Ack(Ack {
                error: result.err().unwrap_or_default(),
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;

    #[test]
    fn field_numbers_are_istios() {
        // DelWorkload{uid: "u"} is field 2 of the request, its uid field 2: 0x12 len 0x12 len "u".
        let del = WorkloadRequest {
            payload: Some(workload_request::Payload::Del(DelWorkload { uid: "u".into() })),
        };
        assert_eq!(del.encode_to_vec(), vec![0x12, 0x03, 0x12, 0x01, b'u']);
        // KeepWorkload is field 5 of the request, its uid field 1.
        let keep = WorkloadRequest {
            payload: Some(workload_request::Payload::Keep(KeepWorkload { uid: "u".into() })),
        };
        assert_eq!(keep.encode_to_vec(), vec![0x2a, 0x03, 0x0a, 0x01, b'u']);
        // SnapshotSent is field 3, empty.
        let snap = WorkloadRequest {
            payload: Some(workload_request::Payload::SnapshotSent(SnapshotSent {})),
        };
        assert_eq!(snap.encode_to_vec(), vec![0x1a, 0x00]);
        let istio_hello = ZdsHello { version: Version::V1 as i32, ..Default::default() };
        assert_eq!(istio_hello.encode_to_vec(), vec![0x08, 0x01]);
    }

    #[test]
    fn the_held_listeners_extension_is_invisible_to_istio_and_read_back_by_meshpath() {
        // Field 1000, varint: key (1000 << 3) = 8000 = 0xc0 0x3e. Istio's decoder skips it.
        let hello = ZdsHello {
            version: Version::V1 as i32,
            meshpath_held_listeners: true,
            ..Default::default()
        };
        let bytes = hello.encode_to_vec();
        assert_eq!(bytes, vec![0x08, 0x01, 0xc0, 0x3e, 0x01]);
        assert_eq!(ZdsHello::decode(bytes.as_slice()).expect("decode"), hello);
        // An Istio agent's add (no field 1000) asks for nothing.
        let add = AddWorkload { uid: "u".into(), ..Default::default() };
        assert!(
            !AddWorkload::decode(add.encode_to_vec().as_slice()).expect("decode").hold_listeners
        );
    }

    #[test]
    fn an_add_round_trips() {
        let add = WorkloadRequest {
            payload: Some(workload_request::Payload::Add(AddWorkload {
                uid: "pod-uid".into(),
                workload_info: Some(WorkloadInfo {
                    name: "web-0".into(),
                    namespace: "prod".into(),
                    service_account: "web".into(),
                }),
                hold_listeners: true,
                hold_connections: true,
                hold_streams: true,
                hold_node_local: true,
            })),
        };
        let back = WorkloadRequest::decode(add.encode_to_vec().as_slice()).expect("decode");
        assert_eq!(back, add);
    }
}
