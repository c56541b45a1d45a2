//! ZDS as the proxy receives it from the node agent: a sequence of messages (each: a byte for
//! how many descriptors came with it, a length byte, then protobuf), decoded and fed to the
//! proxy's session state machine against a model of the pods served. Invariants: an add needs
//! one descriptor (more only with held listeners); a keep only for a pod served; a
//! handed-over connection only with its two descriptors, for a pod named in the session; a snapshot removes exactly the served pods not
//! named since the session began, so afterwards every pod served was named.
#![no_main]

use std::collections::HashSet;

use libfuzzer_sys::fuzz_target;
use meshpath_proxy::inpod::zds::{Session, Step};
use meshpath_zds::proto::{WorkloadRequest, WorkloadResponse, ZdsHello};
use prost::Message as _;

fuzz_target!(|data: &[u8]| {
    let mut session = Session::default();
    let mut served: HashSet<String> = HashSet::new();
    let mut rest = data;
    while let [fds, len, tail @ ..] = rest {
        let len = usize::from(*len).min(tail.len());
        let (msg, next) = tail.split_at(len);
        rest = next;
        // The agent's other messages decode without panicking too.
        let _ = WorkloadResponse::decode(msg);
        let _ = ZdsHello::decode(msg);
        let Ok(req) = WorkloadRequest::decode(msg) else { continue };
        let fds = usize::from(fds % 3);
        match session.step(req, fds, &served) {
            Ok(Step::Add { uid, hold_listeners, .. }) => {
                // The netns, and listeners after it only where the agent holds them.
                assert!(fds == 1 || (hold_listeners && (1..=9).contains(&fds)), "{fds}");
                assert!(!uid.is_empty());
                served.insert(uid);
            }
            Ok(Step::Keep) => {}
            Ok(Step::Take(held)) => {
                // A handed-over connection: its two sockets (a paused stream: its app's side),
                // for a pod of this session.
                assert_eq!(fds, if held.stream.is_some() { 1 } else { 2 });
                assert!(session.named().contains(&held.uid));
            }
            Ok(Step::Remove(uid)) => {
                served.remove(&uid);
            }
            Ok(Step::Sweep(gone)) => {
                for uid in &gone {
                    assert!(served.remove(uid), "swept a pod not served: {uid}");
                    assert!(!session.named().contains(uid), "swept a pod named: {uid}");
                }
                assert!(served.iter().all(|u| session.named().contains(u)), "kept a pod not named");
            }
            Err(_) => {}
        }
    }
    let ack = WorkloadResponse::ack(Err(String::from_utf8_lossy(data).into_owned()));
    assert_eq!(WorkloadResponse::decode(ack.encode_to_vec().as_slice()).ok(), Some(ack));
});
