//! The node agent against a real Kubernetes API server (etcd + kube-apiserver run here): it
//! watches the Pods of its node and the Namespaces, meshes exactly the pods Istio ambient would
//! (`istio.io/dataplane-mode`), through the real CNI chain or by finding a running pod's network
//! namespace, writes `ambient.istio.io/redirection` back, releases pods that leave, and rides
//! out the API server going away. Namespaces and Pods are made with kube-rs, as a user would
//! with kubectl; there is no kubelet, so tests write `status.podIPs` themselves.

use std::{net::IpAddr, time::Duration};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use meshpath_tests::{
    cni_node::{CniNode, CniPod},
    kube_api::KubeApi,
    wait_until_async,
};
use serde_json::json;

/// How long a test waits for the agent to act on what the API server says.
const API_WAIT: Duration = Duration::from_secs(20);

const NODE: &str = "node-a";

struct Cluster {
    api: KubeApi,
    node: CniNode,
    client: kube::Client,
}

/// A node in kube mode on pod subnet 10.`subnet`.0.0/24 (one per test: the agent finds running
/// pods by address, and tests run side by side).
async fn cluster(subnet: u8, start_agent: bool) -> Cluster {
    let api = KubeApi::start().expect("API server");
    let client = api.client().await.expect("client");
    let mut node = CniNode::bare("workloads: []\n").expect("node");
    node.subnet = subnet;
    if start_agent {
        node.start_agent_kube(&api.kubeconfig, NODE).expect("agent");
        node.start_proxy().expect("proxy");
    }
    Cluster { api, node, client }
}

async fn namespace(c: &Cluster, name: &str, ambient: bool) {
    let mut ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": name}})).expect("ns");
    if ambient {
        ns.metadata.labels = Some([("istio.io/dataplane-mode".into(), "ambient".into())].into());
    }
    Api::<Namespace>::all(c.client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("create ns");
}

async fn label_namespace(c: &Cluster, name: &str, value: Option<&str>) {
    let patch = json!({"metadata": {"labels": {"istio.io/dataplane-mode": value}}});
    Api::<Namespace>::all(c.client.clone())
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("label ns");
}

/// A Pod object on this node (as the scheduler would have placed it).
async fn pod(c: &Cluster, ns: &str, name: &str, labels: serde_json::Value) -> Pod {
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": NODE, "serviceAccountName": name, "containers": [{"name": "app", "image": "app"}]}
    }))
    .expect("pod");
    Api::<Pod>::namespaced(c.client.clone(), ns)
        .create(&PostParams::default(), &p)
        .await
        .expect("create pod")
}

/// Writes the pod's address, as the kubelet does once its sandbox is up.
async fn set_ip(c: &Cluster, ns: &str, name: &str, ip: IpAddr) {
    let patch = json!({"status": {"podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}]}});
    Api::<Pod>::namespaced(c.client.clone(), ns)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("status");
}

async fn redirection(c: &Cluster, ns: &str, name: &str) -> Option<String> {
    let p = Api::<Pod>::namespaced(c.client.clone(), ns).get(name).await.expect("get pod");
    p.metadata.annotations.and_then(|a| a.get("ambient.istio.io/redirection").cloned())
}

/// The pod's sandbox made by the CNI chain without meshpath-cni (a pod that ran before the
/// agent, or before its namespace was labelled).
fn plain_sandbox(c: &Cluster, name: &str) -> CniPod {
    let mut list = c.node.conflist(&c.node.cni_socket());
    list["plugins"].as_array_mut().expect("plugins").retain(|p| p["type"] != "meshpath-cni");
    c.node.add_pod_with(name, &list).expect("sandbox")
}

fn enrolled(c: &Cluster) -> usize {
    c.node.enrolled().len()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_of_an_ambient_namespace_is_captured_through_the_cni_chain_and_annotated() {
    let c = cluster(81, true).await;
    namespace(&c, "shop", true).await;
    pod(&c, "shop", "web", json!({})).await;
    let web = tokio::task::block_in_place(|| c.node.add_pod_in("shop", "web")).expect("ADD");
    assert_eq!(enrolled(&c), 1, "the pod was not enrolled");
    assert!(c.node.proxy_pods().expect("proxy").iter().any(|u| !u.is_empty()));
    assert!(
        wait_until_async(API_WAIT, || async {
            redirection(&c, "shop", "web").await.as_deref() == Some("enabled")
        })
        .await
    );
    drop(web);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_opting_out_or_in_an_unlabelled_namespace_is_left_alone() {
    let c = cluster(82, true).await;
    namespace(&c, "shop", true).await;
    namespace(&c, "plain", false).await;
    pod(&c, "shop", "batch", json!({"istio.io/dataplane-mode": "none"})).await;
    pod(&c, "plain", "web", json!({})).await;
    tokio::task::block_in_place(|| {
        c.node.add_pod_in("shop", "batch").expect("ADD batch");
        c.node.add_pod_in("plain", "web").expect("ADD web");
    });
    assert_eq!(enrolled(&c), 0, "an opted-out or unlabelled pod was enrolled");
    assert_eq!(redirection(&c, "shop", "batch").await, None);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_running_before_the_agent_started_is_enrolled_when_it_starts() {
    let mut c = cluster(83, false).await;
    namespace(&c, "shop", true).await;
    pod(&c, "shop", "web", json!({})).await;
    let sandbox = tokio::task::block_in_place(|| plain_sandbox(&c, "web"));
    set_ip(&c, "shop", "web", sandbox.ip).await;
    tokio::task::block_in_place(|| {
        c.node.start_agent_kube(&c.api.kubeconfig, NODE).expect("agent");
        c.node.start_proxy().expect("proxy");
    });
    assert!(
        wait_until_async(API_WAIT, || async { enrolled(&c) == 1 }).await,
        "the running pod was not found"
    );
    assert!(
        wait_until_async(API_WAIT, || async {
            redirection(&c, "shop", "web").await.as_deref() == Some("enabled")
        })
        .await
    );
    let _ = &mut c;
}

#[tokio::test(flavor = "multi_thread")]
async fn labelling_a_namespace_meshes_its_running_pods_and_unlabelling_releases_them() {
    let c = cluster(84, true).await;
    namespace(&c, "shop", false).await;
    pod(&c, "shop", "web", json!({})).await;
    let sandbox = tokio::task::block_in_place(|| plain_sandbox(&c, "web"));
    set_ip(&c, "shop", "web", sandbox.ip).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(enrolled(&c), 0);
    label_namespace(&c, "shop", Some("ambient")).await;
    assert!(
        wait_until_async(API_WAIT, || async { enrolled(&c) == 1 }).await,
        "not meshed after the label"
    );
    assert!(
        wait_until_async(API_WAIT, || async {
            redirection(&c, "shop", "web").await.as_deref() == Some("enabled")
        })
        .await
    );
    label_namespace(&c, "shop", None).await;
    assert!(
        wait_until_async(API_WAIT, || async { enrolled(&c) == 0 }).await,
        "not released after the label went"
    );
    assert!(
        wait_until_async(API_WAIT, || async { redirection(&c, "shop", "web").await.is_none() })
            .await,
        "annotation left"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_malformed_annotation_leaves_the_pod_out_and_says_so_in_an_event() {
    let c = cluster(85, true).await;
    namespace(&c, "shop", true).await;
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "shop",
                     "annotations": {"meshpath.io/exclude-outbound-ports": "90x"}},
        "spec": {"nodeName": NODE, "containers": [{"name": "app", "image": "app"}]}
    }))
    .expect("pod");
    Api::<Pod>::namespaced(c.client.clone(), "shop")
        .create(&PostParams::default(), &p)
        .await
        .expect("pod");
    let sandbox = tokio::task::block_in_place(|| plain_sandbox(&c, "web"));
    set_ip(&c, "shop", "web", sandbox.ip).await;
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(c.client.clone(), "shop");
    assert!(
        wait_until_async(API_WAIT, || async {
            events.list(&Default::default()).await.is_ok_and(|l| {
                l.items.iter().any(|e| {
                    e.message.as_deref().is_some_and(|m| m.contains("exclude-outbound-ports"))
                })
            })
        })
        .await,
        "no Event on the pod"
    );
    assert_eq!(enrolled(&c), 0, "a pod with a malformed annotation was enrolled");
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_api_server_gone_the_agent_keeps_its_pods_and_reconciles_when_it_returns() {
    let mut c = cluster(86, true).await;
    namespace(&c, "shop", true).await;
    pod(&c, "shop", "web", json!({})).await;
    tokio::task::block_in_place(|| c.node.add_pod_in("shop", "web")).expect("ADD");
    assert_eq!(enrolled(&c), 1);
    c.api.stop_apiserver();
    // Not ready while it cannot watch; the pod keeps its capture.
    assert!(
        wait_until_async(API_WAIT, || async { c.node.agent_ready() == Some(false) }).await,
        "still ready"
    );
    assert_eq!(enrolled(&c), 1, "a pod was dropped while the API was away");
    tokio::task::block_in_place(|| c.api.start_apiserver()).expect("restart");
    assert!(
        wait_until_async(API_WAIT, || async { c.node.agent_ready() == Some(true) }).await,
        "not ready again"
    );
    assert_eq!(enrolled(&c), 1, "enrolled twice or dropped after the API came back");
    // And it follows the API again.
    label_namespace(&c, "shop", None).await;
    assert!(
        wait_until_async(API_WAIT, || async { enrolled(&c) == 0 }).await,
        "not released after the API came back"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_deleted_from_the_api_leaves_the_mesh() {
    let c = cluster(87, true).await;
    namespace(&c, "shop", true).await;
    pod(&c, "shop", "web", json!({})).await;
    let sandbox = tokio::task::block_in_place(|| plain_sandbox(&c, "web"));
    set_ip(&c, "shop", "web", sandbox.ip).await;
    assert!(
        wait_until_async(API_WAIT, || async { enrolled(&c) == 1 }).await,
        "the running pod was not found"
    );
    // Deleted at once (no kubelet here to finish a graceful deletion).
    let now = kube::api::DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    Api::<Pod>::namespaced(c.client.clone(), "shop").delete("web", &now).await.expect("delete");
    assert!(
        wait_until_async(API_WAIT, || async { enrolled(&c) == 0 }).await,
        "a deleted pod stayed in the mesh"
    );
}

/// Writes the pod's phase and address, as the kubelet does.
async fn set_phase(c: &Cluster, ns: &str, name: &str, phase: &str, ip: IpAddr) {
    let patch = json!({"status": {
        "phase": phase, "podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}]
    }});
    Api::<Pod>::namespaced(c.client.clone(), ns)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("status");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_pods_old_address_does_not_mesh_the_pod_that_has_it_now() {
    let c = cluster(88, true).await;
    namespace(&c, "shop", true).await;
    namespace(&c, "plain", false).await;
    // A running pod outside the mesh…
    pod(&c, "plain", "other", json!({})).await;
    let other = tokio::task::block_in_place(|| plain_sandbox(&c, "other"));
    set_ip(&c, "plain", "other", other.ip).await;
    // …holds the address a finished Job pod of an ambient namespace still lists in its status
    // (Kubernetes keeps a finished pod's podIPs; IPAM gave the address out again).
    pod(&c, "shop", "job", json!({})).await;
    set_phase(&c, "shop", "job", "Succeeded", other.ip).await;
    // The agent reconciles every 2 s: several passes, none may take `other` in as `job`.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(enrolled(&c), 0, "a pod outside the mesh was captured as a finished pod");
    // The same pod while it runs is found by that address: the phase alone kept it out.
    set_phase(&c, "shop", "job", "Running", other.ip).await;
    assert!(
        wait_until_async(API_WAIT, || async { enrolled(&c) == 1 }).await,
        "a running pod was not found"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_served_pod_the_cache_lacks_keeps_its_capture_until_the_api_server_says_it_is_gone() {
    let c = cluster(89, true).await;
    namespace(&c, "shop", true).await;
    // A pod the agent's cache never holds: its watch selects this node's pods, and this one
    // names another node. Its CNI ADD asks the API server and enrols it, as it does for a pod
    // whose watch event has not come in yet.
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"nodeName": "node-elsewhere", "containers": [{"name": "app", "image": "app"}]}
    }))
    .expect("pod");
    let pods = Api::<Pod>::namespaced(c.client.clone(), "shop");
    pods.create(&PostParams::default(), &p).await.expect("create pod");
    let web = tokio::task::block_in_place(|| c.node.add_pod_in("shop", "web")).expect("ADD");
    assert_eq!(enrolled(&c), 1, "the pod was not enrolled");
    // The agent reconciles every 2 s: the API server still has the pod, so it stays captured.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(enrolled(&c), 1, "a pod the API server still has was taken out of the mesh");
    // Gone from the API server: it leaves.
    let now = kube::api::DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    pods.delete("web", &now).await.expect("delete");
    assert!(
        wait_until_async(API_WAIT, || async { enrolled(&c) == 0 }).await,
        "a deleted pod stayed in the mesh"
    );
    drop(web);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_api_server_that_stops_answering_turns_the_agent_unready_and_no_add_waits_on_it() {
    let c = cluster(90, true).await;
    namespace(&c, "shop", true).await;
    pod(&c, "shop", "web", json!({})).await;
    // Its watch event comes in within milliseconds.
    tokio::time::sleep(Duration::from_secs(2)).await;
    c.api.pause_apiserver().expect("pause");
    assert!(
        wait_until_async(API_WAIT, || async { c.node.agent_ready() == Some(false) }).await,
        "the agent stayed ready with an API server that does not answer"
    );
    // A pod the cache holds needs nothing of the API server to be added…
    let web = tokio::task::block_in_place(|| c.node.add_pod_in("shop", "web"));
    let web = web.expect("ADD of a pod the cache holds");
    assert_eq!(enrolled(&c), 1);
    // …one it does not is asked of the API server, and refused saying why, not left hanging
    // (the plugin's own timeout would say only that the agent did not answer).
    let db = tokio::task::block_in_place(|| c.node.add_pod_in("shop", "db"));
    let Err(err) = db else { panic!("ADD of a pod nobody could look up succeeded") };
    let err = format!("{err:#}");
    assert!(err.contains("API server did not answer"), "{err}");
    c.api.resume_apiserver().expect("resume");
    assert!(
        wait_until_async(API_WAIT, || async { c.node.agent_ready() == Some(true) }).await,
        "not ready again"
    );
    assert!(
        wait_until_async(API_WAIT, || async {
            redirection(&c, "shop", "web").await.as_deref() == Some("enabled")
        })
        .await,
        "the annotation left out while the API server hung was never written"
    );
    drop(web);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_add_for_a_recreated_pod_is_not_decided_by_the_cached_object_of_the_pod_it_replaced() {
    let c = cluster(91, true).await;
    namespace(&c, "shop", true).await;
    // The cache's web opted out of the mesh.
    pod(&c, "shop", "web", json!({"istio.io/dataplane-mode": "none"})).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The runtime sets up a sandbox for a web with another uid (a StatefulSet's pod recreated)
    // while the API server does not answer: the old object must not decide for it.
    c.api.pause_apiserver().expect("pause");
    let added = tokio::task::block_in_place(|| c.node.add_pod_as("shop", "web", "uid-new-web"));
    let Err(err) = added else { panic!("ADD decided by the replaced pod's object") };
    let err = format!("{err:#}");
    assert!(err.contains("API server did not answer"), "{err}");
    assert_eq!(enrolled(&c), 0);
    // Answered, the API server has only the old web: that uid is no pod it has.
    c.api.resume_apiserver().expect("resume");
    let again = tokio::task::block_in_place(|| c.node.add_pod_as("shop", "web", "uid-new-web"));
    let Err(err) = again else { panic!("ADD for a pod the API server does not have") };
    let err = format!("{err:#}");
    assert!(err.contains("replaced"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pretty_printed_answer_does_not_bring_the_api_server_down() {
    // A plain curl GET gets pretty-printed JSON; the API server built with the vendored
    // reflect2 1.0.1 died on it (`fatal error: fault`). Any client may ask that.
    let mut c = cluster(92, false).await;
    namespace(&c, "shop", true).await;
    pod(&c, "shop", "web", json!({})).await;
    for path in ["/api/v1/namespaces", "/api/v1/pods", "/api/v1/namespaces/shop/pods/web"] {
        let status = tokio::task::block_in_place(|| c.api.curl_get(path)).expect("curl");
        assert_eq!(status, "200", "GET {path}");
    }
    assert!(c.api.apiserver_alive(), "the API server died answering a pretty-printed GET");
    let status = tokio::task::block_in_place(|| c.api.curl_get("/readyz")).expect("curl");
    assert_eq!(status, "200");
}
