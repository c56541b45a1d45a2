//! `meshpath-cni`: the chained CNI plugin. ADD hands the pod to the node agent and returns the
//! previous result unchanged once the pod is enrolled and the proxy acknowledged it; the agent
//! unreachable fails ADD (fail closed: the pod does not start outside the mesh). DEL is
//! idempotent, accepts an empty `CNI_NETNS`, and succeeds when the agent is down (its
//! reconcile removes what a vanished netns leaves). CHECK asks the agent. VERSION answers the
//! supported versions. Errors are the spec's error result on stdout with exit code 1.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::unix::net::UnixStream,
    process::ExitCode,
    time::Duration,
};

use meshpath_cni::{
    agent::{self, Command, Request, Response},
    spec::{code, parse_args, ErrorResult, NetConf, SUPPORTED_VERSIONS},
};

/// How long the agent may take to enrol a pod and hear the proxy's ack.
const AGENT_TIMEOUT: Duration = Duration::from_secs(30);

struct Failure {
    code: u32,
    msg: String,
    details: String,
}

fn fail(code: u32, msg: impl Into<String>) -> Failure {
    Failure { code, msg: msg.into(), details: String::new() }
}

fn env(name: &str) -> Result<String, Failure> {
    std::env::var(name).map_err(|_| fail(code::INVALID_ENV, format!("{name} is not set")))
}

fn main() -> ExitCode {
    let mut stdin = String::new();
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    let version = |stdin: &str| {
        serde_json::from_str::<serde_json::Value>(stdin)
            .ok()
            .and_then(|v| v.get("cniVersion").and_then(|v| v.as_str()).map(str::to_owned))
            .unwrap_or_else(|| "1.0.0".into())
    };
    if command == "VERSION" {
        let _ = std::io::stdin().read_to_string(&mut stdin);
        let out = serde_json::json!({"cniVersion": version(&stdin), "supportedVersions": SUPPORTED_VERSIONS});
        println!("{out}");
        return ExitCode::SUCCESS;
    }
    let result = std::io::stdin()
        .read_to_string(&mut stdin)
        .map_err(|e| fail(code::IO_FAILURE, format!("reading the network configuration: {e}")))
        .and_then(|_| run(&command, &stdin));
    match result {
        Ok(out) => {
            if !out.is_empty() {
                println!("{out}");
            }
            ExitCode::SUCCESS
        }
        Err(f) => {
            let err = ErrorResult {
                cni_version: version(&stdin),
                code: f.code,
                msg: f.msg,
                details: f.details,
            };
            println!("{}", serde_json::to_string(&err).unwrap_or_default());
            ExitCode::FAILURE
        }
    }
}

fn run(command: &str, stdin: &str) -> Result<String, Failure> {
    let conf: NetConf = serde_json::from_str(stdin)
        .map_err(|e| fail(code::INVALID_CONFIG, format!("network configuration: {e}")))?;
    if !SUPPORTED_VERSIONS.contains(&conf.cni_version.as_str()) {
        return Err(fail(
            code::INCOMPATIBLE_VERSION,
            format!(
                "cniVersion {} is not one of {}",
                conf.cni_version,
                SUPPORTED_VERSIONS.join(", ")
            ),
        ));
    }
    let command = match command {
        "ADD" => Command::Add,
        "DEL" => Command::Del,
        "CHECK" => Command::Check,
        "" => return Err(fail(code::INVALID_ENV, "CNI_COMMAND is not set")),
        other => {
            return Err(fail(
                code::INVALID_ENV,
                format!("CNI_COMMAND {other:?} is not ADD, DEL, CHECK or VERSION"),
            ))
        }
    };
    let args = parse_args(&std::env::var("CNI_ARGS").unwrap_or_default())
        .map_err(|e| fail(code::INVALID_ENV, e))?;
    let arg =
        |k: &str| args.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone()).unwrap_or_default();
    let container_id = env("CNI_CONTAINERID")?;
    let netns = std::env::var("CNI_NETNS").unwrap_or_default();
    let ips = match command {
        Command::Del => conf.pod_ips().unwrap_or_default(),
        _ => {
            if netns.is_empty() {
                return Err(fail(code::INVALID_ENV, "CNI_NETNS is not set"));
            }
            env("CNI_IFNAME")?;
            conf.pod_ips().map_err(|e| fail(code::INVALID_CONFIG, e))?
        }
    };
    let (pod_name, pod_namespace) = (arg("K8S_POD_NAME"), arg("K8S_POD_NAMESPACE"));
    if command != Command::Del && (pod_name.is_empty() || pod_namespace.is_empty()) {
        return Err(fail(code::INVALID_ENV, "CNI_ARGS lacks K8S_POD_NAME or K8S_POD_NAMESPACE"));
    }
    let req = Request {
        command,
        container_id,
        netns,
        pod_name,
        pod_namespace,
        pod_uid: arg("K8S_POD_UID"),
        ips,
    };
    let socket = conf.agent_socket.clone().unwrap_or_else(|| agent::DEFAULT_SOCKET.into());
    match ask(&socket, &req) {
        // The agent enrolled the pod (its datapath entries and its netns' reply routing) and
        // the proxy acknowledged it.
        Ok(resp) if resp.error.is_empty() => {}
        Ok(resp) => {
            return Err(Failure {
                code: code::AGENT_REFUSED,
                msg: "meshpath agent refused the pod".into(),
                details: resp.error,
            });
        }
        Err(e) if command == Command::Del => {
            // Nothing the agent could not clean up itself: its reconcile removes what a deleted
            // netns leaves behind.
            eprintln!("meshpath-cni: DEL: agent at {socket} not reachable ({e}); leaving cleanup to its reconcile");
        }
        Err(e) => {
            return Err(Failure {
                code: code::TRY_AGAIN_LATER,
                msg: format!("meshpath agent not reachable at {socket}"),
                details: e,
            });
        }
    }
    // Chained: pass the previous result through unchanged (only the version is ours to set).
    match (command, conf.prev_result) {
        (Command::Add, Some(mut prev)) => {
            if let Some(o) = prev.as_object_mut() {
                o.insert("cniVersion".into(), conf.cni_version.clone().into());
            }
            Ok(prev.to_string())
        }
        _ => Ok(String::new()),
    }
}

fn ask(socket: &str, req: &Request) -> Result<Response, String> {
    let mut conn = UnixStream::connect(socket).map_err(|e| e.to_string())?;
    conn.set_read_timeout(Some(AGENT_TIMEOUT)).map_err(|e| e.to_string())?;
    let mut line = serde_json::to_string(req).map_err(|e| e.to_string())?;
    line.push('\n');
    conn.write_all(line.as_bytes()).map_err(|e| e.to_string())?;
    let mut answer = String::new();
    BufReader::new(conn).read_line(&mut answer).map_err(|e| e.to_string())?;
    if answer.is_empty() {
        return Err("the agent closed the connection without answering".into());
    }
    serde_json::from_str(&answer).map_err(|e| format!("the agent's answer does not parse: {e}"))
}
