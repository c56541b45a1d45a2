//! Resuming a paused HBONE stream (`proxy/src/proxy/resume.rs`), spoken to node 2's proxy (the
//! stream's server side) by a test client that plays the other meshpath proxy, from pod a with a
//! certificate of the mesh's CA: the protocol, and who may resume a stream. The upgrades that
//! pause streams are in connection_handover.rs.

use std::time::Duration;

use bytes::Bytes;
use h2::{RecvStream, SendStream};
use meshpath_proxy::{
    identity::WorkloadCert,
    proxy::hbone::{self, HboneError, StreamHeaders},
};
use meshpath_tests::two_nodes::{sa, Setup, TwoNodes, MESHED};

fn cert(nodes: &TwoNodes, name: &str) -> WorkloadCert {
    nodes.ca.issue(&sa(name), Duration::from_secs(600)).expect("cert")
}

type Opened = (SendStream<Bytes>, RecvStream, http::HeaderMap);

/// A CONNECT to `dst` from pod a as `cert`, offering a resumable stream, with `extra` headers.
async fn connect(
    nodes: &TwoNodes,
    cert: &WorkloadCert,
    dst: std::net::SocketAddr,
    extra: Vec<(&'static str, String)>,
) -> Result<Opened, HboneError> {
    let conn = nodes.hbone_conn_from_a(cert).await.expect("HBONE from pod a");
    let headers = StreamHeaders { extra, ..Default::default() };
    hbone::open_stream_answered(conn, nodes.b(false, 15008), dst, &headers).await
}

fn offer() -> (&'static str, String) {
    (hbone::RESUMABLE, "1".into())
}

fn resume_header(token: &str, to_server: u64, to_client: u64) -> (&'static str, String) {
    (hbone::RESUME, format!("{token}; to-server={to_server}; to-client={to_client}"))
}

/// Sends `msg` and reads its echo.
async fn echo_on(send: &mut SendStream<Bytes>, recv: &mut RecvStream, msg: &[u8]) {
    send.send_data(Bytes::copy_from_slice(msg), false).expect("send");
    let mut back = Vec::new();
    while back.len() < msg.len() {
        let chunk = tokio::time::timeout(Duration::from_secs(10), recv.data())
            .await
            .expect("no echo within 10 s")
            .expect("the stream ended")
            .expect("data");
        let _ = recv.flow_control().release_capacity(chunk.len());
        back.extend_from_slice(&chunk);
    }
    assert_eq!(back, msg);
}

/// Opens a resumable stream to `dst` as `cert`, echoes `hello`, and pauses it as a proxy going
/// away does; checks that the server paused its side too. Returns the stream's token.
async fn open_and_pause(
    nodes: &TwoNodes,
    cert: &WorkloadCert,
    dst: std::net::SocketAddr,
) -> String {
    let (mut send, mut recv, answer) = connect(nodes, cert, dst, vec![offer()]).await.expect("200");
    let token = answer
        .get(hbone::STREAM_TOKEN)
        .expect("a meshpath server answers a resumable CONNECT with a token")
        .to_str()
        .expect("ascii")
        .to_owned();
    echo_on(&mut send, &mut recv, b"hello").await;
    let mut paused = http::HeaderMap::new();
    paused.insert(hbone::PAUSED, http::HeaderValue::from(5u64));
    send.send_trailers(paused).expect("trailers");
    let more = tokio::time::timeout(Duration::from_secs(10), recv.data()).await.expect("paused");
    assert!(more.is_none(), "the server sent data after the pause: {more:?}");
    let trailers = recv.trailers().await.expect("trailers").expect("the server's trailers");
    assert!(trailers.contains_key(hbone::PAUSED), "the server ended its side: {trailers:?}");
    token
}

fn status(r: Result<Opened, HboneError>) -> u16 {
    match r {
        Ok(_) => 200,
        Err(HboneError::Status { status, .. }) => status.as_u16(),
        Err(e) => panic!("no status: {e}"),
    }
}

#[tokio::test]
async fn a_paused_stream_resumes_on_a_new_connection_onto_the_same_app_connection() {
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8090);
    // One connection only: an echo after the resume proves the app's connection was kept.
    let server = nodes.echo_in_b(dst);
    let a = cert(&nodes, "sa-a");
    let token = open_and_pause(&nodes, &a, dst).await;
    let (mut send, mut recv, answer) =
        connect(&nodes, &a, dst, vec![offer(), resume_header(&token, 5, 5)]).await.expect("200");
    let next = answer.get(hbone::STREAM_TOKEN).expect("a token for the next pause");
    assert_ne!(next.to_str().expect("ascii"), token, "a token is used once");
    echo_on(&mut send, &mut recv, b"after the resume").await;
    send.send_data(Bytes::new(), true).expect("end");
    let from = tokio::task::spawn_blocking(move || server.join())
        .await
        .expect("join")
        .expect("server")
        .expect("the app's one connection");
    assert_eq!(from.ip(), nodes.a(false, 0).ip(), "the app saw {from}, not pod a");
}

#[tokio::test]
async fn another_identity_or_another_source_cannot_resume_a_stream_and_its_own_still_can() {
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8091);
    let _server = nodes.echo_in_b(dst);
    let a = cert(&nodes, "sa-a");
    let token = open_and_pause(&nodes, &a, dst).await;
    let resume = || vec![offer(), resume_header(&token, 5, 5)];
    // The token alone is not enough: another workload of the mesh is refused.
    let other = cert(&nodes, "sa-other");
    assert_eq!(status(connect(&nodes, &other, dst, resume()).await), 403);
    // Nor the same identity from another address (pod b's, not pod a's).
    let conn = nodes.hbone_conn_to_b(&a).await.expect("HBONE from pod b");
    let headers = StreamHeaders { extra: resume(), ..Default::default() };
    let elsewhere = hbone::open_stream_answered(conn, nodes.b(false, 15008), dst, &headers).await;
    assert_eq!(status(elsewhere), 403);
    // Refusals leave it waiting for the one that held it.
    let (mut send, mut recv, _) = connect(&nodes, &a, dst, resume()).await.expect("200");
    echo_on(&mut send, &mut recv, b"still mine").await;
}

#[tokio::test]
async fn a_resume_that_disagrees_on_the_bytes_carried_ends_the_stream() {
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8092);
    let server = nodes.echo_in_b(dst);
    let a = cert(&nodes, "sa-a");
    let token = open_and_pause(&nodes, &a, dst).await;
    // One byte fewer than the server received: a byte lost, which no app may see.
    assert_eq!(status(connect(&nodes, &a, dst, vec![resume_header(&token, 4, 5)]).await), 409);
    // The app's connection is closed (the echo server sees its end), and the token is gone.
    let ended = tokio::task::spawn_blocking(move || server.join()).await.expect("join");
    assert!(ended.expect("server").is_ok(), "the app's connection did not end cleanly");
    assert_eq!(status(connect(&nodes, &a, dst, vec![resume_header(&token, 5, 5)]).await), 404);
}

#[tokio::test]
async fn a_paused_stream_not_resumed_within_the_window_is_closed_and_its_token_forgotten() {
    let window = 3;
    let nodes = TwoNodes::start(Setup {
        args: vec!["--resume-within-seconds".into(), window.to_string()],
        ..Setup::default()
    });
    let dst = nodes.b(false, 8095);
    let server = nodes.echo_in_b(dst);
    let a = cert(&nodes, "sa-a");
    let token = open_and_pause(&nodes, &a, dst).await;
    // Within the window the app's connection is held open for the stream's owner...
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!server.is_finished(), "the app's connection ended before the window passed");
    // ...and once it has passed, closed: the echo server sees its end (not a reset).
    let ended = tokio::time::timeout(
        Duration::from_secs(window + 10),
        tokio::task::spawn_blocking(move || server.join()),
    )
    .await
    .expect("the app's connection still open 10 s after the window")
    .expect("join");
    assert!(ended.expect("server").is_ok(), "the app's connection did not end cleanly");
    // Nothing is left to resume.
    assert_eq!(status(connect(&nodes, &a, dst, vec![resume_header(&token, 5, 5)]).await), 404);
}

#[tokio::test]
async fn a_token_never_issued_is_not_found_and_a_malformed_one_is_a_bad_request() {
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8093);
    let _server = nodes.echo_in_b(dst);
    let a = cert(&nodes, "sa-a");
    let never = "0123456789abcdef0123456789abcdef";
    assert_eq!(status(connect(&nodes, &a, dst, vec![resume_header(never, 0, 0)]).await), 404);
    let malformed = vec![(hbone::RESUME, "not a token".to_string())];
    assert_eq!(status(connect(&nodes, &a, dst, malformed).await), 400);
}

#[tokio::test]
async fn a_client_that_does_not_offer_resuming_gets_no_token_as_from_ztunnel() {
    let nodes = TwoNodes::new(MESHED);
    let dst = nodes.b(false, 8094);
    let _server = nodes.echo_in_b(dst);
    let (mut send, mut recv, answer) =
        connect(&nodes, &cert(&nodes, "sa-a"), dst, vec![]).await.expect("200");
    assert!(answer.get(hbone::STREAM_TOKEN).is_none(), "{answer:?}");
    echo_on(&mut send, &mut recv, b"plain HBONE").await;
}
