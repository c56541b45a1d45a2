//! `cargo xtask demo --cluster`: the demo on a real two-node Kubernetes cluster (cluster.rs,
//! the second node in cluster/node2.rs), meshpath installed the way users install it, with
//! kubectl: the agent and the proxy as DaemonSets that each node's kubelet runs, pods made with
//! Deployments pinned to a node, kubelet's probes passing through the probe bypass. Traffic
//! from `sleep` (first node) to `httpbin` (meshed, the same node: the proxy's node-local path,
//! under httpbin's policy, no TLS), to `backend` (meshed, the second node: HBONE with mutual TLS
//! between the two nodes' proxies over the cluster's pod routes) and to the unmeshed `legacy`
//! in plain TCP; each proxy's `istio_tcp_*` metrics, the annotation the agents write. istiod
//! cannot run here: the proxies run without it (deploy/offline, workloads from a ConfigMap the
//! demo writes once the pods have addresses) and mint the demo pods' certificates from a CA of
//! the demo's (xtask/cluster-demo/kustomization.yaml).

use std::{
    io::Write as _,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};

use crate::cluster::{self, node2};

const MESHED: &str = "demo";
const PLAIN: &str = "legacy";

fn kubectl(args: &[&str]) -> Result<String> {
    let out = cluster::kubectl().args(args).output()?;
    if !out.status.success() {
        bail!("kubectl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn apply(doc: &str) -> Result<()> {
    let mut child = cluster::kubectl()
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()?;
    child.stdin.take().context("stdin")?.write_all(doc.as_bytes())?;
    if !child.wait()?.success() {
        bail!("kubectl apply failed");
    }
    Ok(())
}

fn wait(what: &str, limit: Duration, mut f: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f().unwrap_or(false) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    bail!("waited {} s for {what}", limit.as_secs())
}

/// A Deployment of the test app as `name` in `ns`, its pod pinned to `node`.
fn app(ns: &str, name: &str, node: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: ServiceAccount
metadata: {{name: {name}, namespace: {ns}}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}, namespace: {ns}}}
spec:
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata: {{labels: {{app: {name}}}}}
    spec:
      serviceAccountName: {name}
      nodeSelector: {{kubernetes.io/hostname: {node}}}
      terminationGracePeriodSeconds: 1
      containers:
        - name: app
          image: {image}
          imagePullPolicy: Never
          command: ["/usr/local/bin/cluster-app", "serve"]
          readinessProbe: {{httpGet: {{path: /healthz, port: 8080}}, periodSeconds: 2}}
"#,
        image = crate::images::TESTAPP
    )
}

/// (name, uid, ip) of the Ready pod of `app` in `ns`.
fn pod(ns: &str, app: &str) -> Result<(String, String, String)> {
    let v: Value = serde_json::from_str(&kubectl(&[
        "get",
        "pods",
        "-n",
        ns,
        "-l",
        &format!("app={app}"),
        "-o",
        "json",
    ])?)?;
    let p = v["items"]
        .as_array()
        .and_then(|i| {
            i.iter().find(|p| {
                p["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
            })
        })
        .context("no Ready pod")?;
    let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    Ok((s(&p["metadata"]["name"]), s(&p["metadata"]["uid"]), s(&p["status"]["podIP"])))
}

/// Runs it; takes the cluster down at the end unless `keep`.
pub fn run(root: &std::path::Path, bin_dir: &std::path::Path, keep: bool) -> Result<()> {
    cluster::up(root, bin_dir, None, 2)?;
    let result = show(root, bin_dir);
    if keep {
        println!("demo: the cluster stays up: `cargo xtask cluster kubectl -- get pods -A`; `cargo xtask cluster down` when done");
    } else {
        cluster::down()?;
    }
    result
}

fn show(root: &std::path::Path, bin_dir: &std::path::Path) -> Result<()> {
    // The demo's CA, in the Secret the proxy mints from.
    let ca = std::env::temp_dir().join(format!("meshpath-demo-ca-{}", std::process::id()));
    crate::bootstrap::run(Command::new(bin_dir.join("meshpath-proxy")).arg("new-ca").arg(&ca))?;
    kubectl(&[
        "apply",
        "-f",
        &root.join("deploy/install/00-namespace.yaml").display().to_string(),
    ])?;
    let secret = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "meshpath-ca", "namespace": "meshpath-system"},
        "stringData": {
            "ca.pem": std::fs::read_to_string(ca.join("ca.pem"))?,
            "ca-key.pem": std::fs::read_to_string(ca.join("ca-key.pem"))?,
        },
    });
    apply(&secret.to_string())?;
    let _ = std::fs::remove_dir_all(&ca);
    println!(
        "demo: kubectl apply -k xtask/cluster-demo (deploy/offline with this cluster's image)"
    );
    kubectl(&["apply", "-k", &root.join("xtask/cluster-demo").display().to_string()])?;
    for ds in ["meshpath-agent", "meshpath-proxy"] {
        kubectl(&[
            "-n",
            "meshpath-system",
            "rollout",
            "status",
            &format!("ds/{ds}"),
            "--timeout=180s",
        ])?;
    }
    println!("demo: both DaemonSets Ready under kubelet");
    apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {MESHED}\n  labels:\n    istio.io/dataplane-mode: ambient\n---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: {PLAIN}\n"
    ))?;
    wait("the namespaces' ServiceAccounts", Duration::from_secs(60), || {
        Ok(kubectl(&["get", "sa", "default", "-n", MESHED]).is_ok()
            && kubectl(&["get", "sa", "default", "-n", PLAIN]).is_ok())
    })?;
    let first = cluster::NODE_NAME;
    let apps = [
        (MESHED, "sleep", first),
        (MESHED, "httpbin", first),
        (MESHED, "backend", node2::NAME),
        (PLAIN, "legacy", first),
    ];
    let docs: Vec<String> = apps.iter().map(|(ns, name, node)| app(ns, name, node)).collect();
    apply(&docs.join("---\n"))?;
    let mut pods = Vec::new();
    for (ns, name, node) in apps {
        wait(
            &format!("{ns}/{name} Ready on {node} (its readiness probe passing)"),
            Duration::from_secs(120),
            || Ok(pod(ns, name).is_ok()),
        )?;
        pods.push((ns, name, node, pod(ns, name)?));
    }
    // What istiod would tell the proxies: the meshed pods are HBONE workloads of their nodes.
    let workloads: Vec<Value> = pods
        .iter()
        .filter(|(ns, ..)| *ns == MESHED)
        .map(|(ns, name, node, (pod, uid, ip))| {
            json!({"uid": uid, "name": pod, "namespace": ns, "serviceAccount": name,
                   "workloadName": name, "workloadIps": [ip], "protocol": "HBONE", "node": node})
        })
        .collect();
    let cm = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "meshpath-workloads", "namespace": "meshpath-system"},
        "data": {"workloads.yaml": json!({"workloads": workloads}).to_string()},
    });
    apply(&cm.to_string())?;
    println!("demo: waiting for both proxies to read the workloads (kubelet updates the ConfigMap's volume)");
    let uids: Vec<String> =
        pods.iter().filter(|(ns, ..)| *ns == MESHED).map(|p| p.3 .1.clone()).collect();
    for node in [first, node2::NAME] {
        wait(&format!("{node}'s proxy to hold the workloads"), Duration::from_secs(90), || {
            let dump = on_node(node, "curl")?
                .args(["-sf", "--unix-socket", PROXY_ADMIN_SOCKET, "http://admin/config_dump"])
                .output()?;
            let dump: Value = serde_json::from_slice(&dump.stdout).unwrap_or(Value::Null);
            let held = dump["workloads"].as_array().cloned().unwrap_or_default();
            Ok(uids.iter().all(|u| held.iter().any(|w| w["uid"] == u.as_str())))
        })?;
    }
    for (ns, _, node, (pod, _, ip)) in &pods {
        let v: Value =
            serde_json::from_str(&kubectl(&["get", "pod", "-n", ns, pod, "-o", "json"])?)?;
        let a =
            v["metadata"]["annotations"]["ambient.istio.io/redirection"].as_str().unwrap_or("-");
        println!("demo: pod {ns}/{pod} {ip} on {node}: ambient.istio.io/redirection={a}");
    }
    let sleep_pod = pods[0].3 .0.clone();
    let exec = |args: &[&str]| {
        let mut all = vec!["exec", "-n", MESHED, &sleep_pod, "--", "/usr/local/bin/cluster-app"];
        all.extend_from_slice(args);
        kubectl(&all)
    };
    for (what, ip) in [
        ("httpbin (meshed, same node: the node-local path)", &pods[1].3 .2),
        ("backend (meshed, the other node: HBONE with mutual TLS)", &pods[2].3 .2),
        ("legacy (not meshed: plain TCP)", &pods[3].3 .2),
    ] {
        let started = Instant::now();
        let out = exec(&["send", &format!("{ip}:9000"), "--bytes", "200000000"])?;
        let secs = started.elapsed().as_secs_f64();
        println!(
            "demo: sleep → {what}: {} ({:.0} MB/s including kubectl exec)",
            out.trim(),
            200.0 / secs
        );
    }
    let (sleep_ip, backend_ip) = (&pods[0].3 .2, &pods[2].3 .2);
    let peer = exec(&["get", &format!("{backend_ip}:8080"), "/peer"])?;
    println!(
        "demo: the cross-node path, sleep ({sleep_ip}, {first}) → backend ({backend_ip}, {}):",
        node2::NAME
    );
    println!("  sleep's connect → {first}'s proxy at sleep's own address :15001 (the agent's eBPF, no iptables)");
    println!("  → HBONE (HTTP/2 CONNECT over mutual TLS) from sleep's netns to {backend_ip}:15008, over the pod routes between the nodes");
    println!(
        "  → {}'s proxy in backend's netns (sk_lookup) → backend :8080, which saw the client {}",
        node2::NAME,
        peer.trim()
    );
    for (node, ip, netns) in
        [(first, cluster::NODE_IP, cluster::NETNS), (node2::NAME, node2::IP, node2::NETNS)]
    {
        let metrics = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{netns}"))
            .args(["curl", "-sf", &format!("http://{ip}:15020/metrics")])
            .output()?;
        println!("demo: {node}'s proxy, istio_tcp_connections_opened_total:");
        for l in String::from_utf8_lossy(&metrics.stdout).lines() {
            if l.starts_with("istio_tcp_connections_opened_total{") {
                println!("  {l}");
            }
        }
    }
    Ok(())
}

/// The proxy's admin socket on a node (deploy/install mounts it from the host).
const PROXY_ADMIN_SOCKET: &str = "/var/run/meshpath/proxy/admin.sock";

/// `program` run on `node`: this machine's mounts for the first, the second's own namespaces.
fn on_node(node: &str, program: &str) -> Result<Command> {
    if node == node2::NAME {
        node2::command(program)
    } else {
        Ok(Command::new(program))
    }
}
