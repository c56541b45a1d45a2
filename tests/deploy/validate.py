#!/usr/bin/env python3
"""Offline, strict validation of meshpath's Kubernetes manifests (every YAML file under deploy/).

Needs only `pip install kubernetes-validate` (it ships the Kubernetes OpenAPI schemas; no cluster,
no network). For every YAML document:

1. schema: kubernetes-validate in strict mode (unknown fields are errors) against each Kubernetes
   version in VERSIONS: the oldest this deployment supports and the newest the package ships;
2. API-server rules the schema cannot express (pkg/apis/core/validation and apps/batch
   validation), the ones these manifests come near: Bidirectional mount propagation only in
   privileged containers, allowPrivilegeEscalation=false with privileged or CAP_SYS_ADMIN,
   volume mounts naming a volume, unique names and mount paths, host ports equal to container
   ports under hostNetwork, selectors matching the template, probes naming a declared port,
   Secret data that decodes, Job restart policy;
3. meshpath's own rules: namespace meshpath-system, a ServiceAccount token only for a pod
   that runs as a ServiceAccount defined under deploy/ (the agent's, for its API watch), every
   non-privileged container drops ALL capabilities, refuses privilege escalation and has a
   read-only root filesystem, a privileged container only as an init container, every
   absolute path in a container's args under one of its volume mounts (the root filesystem is
   read-only), every command a binary the Containerfile installs (or /bin/sh), every ConfigMap
   and Secret a pod uses defined under deploy/, and the workloads.yaml the ConfigMap carries in
   the shape proxy/src/config.rs reads.

YAML is read with duplicate keys rejected (PyYAML would silently keep the last one).

Before any file, a self-check feeds the validator documents that must be rejected (an unknown
field, a Bidirectional mount in an unprivileged container, a duplicate key) and one that must
pass, so it cannot silently accept everything.

Prints one line per document; exits non-zero on any error.

    python3 tests/deploy/validate.py            # from anywhere
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import sys
from pathlib import Path
from typing import IO, Any, Iterable

try:
    import kubernetes_validate
    import yaml
except ImportError as e:  # pragma: no cover - environment problem, said plainly
    sys.exit(f"validate: {e.name} is missing: pip install kubernetes-validate")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CONTAINERFILE = DEPLOY / "Containerfile"
NAMESPACE = "meshpath-system"
# 1.30: securityContext.appArmorProfile is GA (the manifests use it); the newest the package has.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
BINARIES = ("meshpath-loader", "meshpath-proxy", "meshpath-cni")
SHELL = "/bin/sh"
POD_TEMPLATE_KINDS = {"DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job"}


# ------------------------------------------------------------------------------------- YAML


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice."""


def _construct_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep)


UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def load_documents(source: str | IO[str]) -> list[Any]:
    """Every non-empty document of a (multi-document) YAML text or open file."""
    return [d for d in yaml.load_all(source, Loader=UniqueKeyLoader) if d is not None]


# ----------------------------------------------------------------------------------- schema


def schema_errors(doc: dict, version: str) -> list[str]:
    """kubernetes-validate, strict: unknown properties are errors."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path) or "(document)"
        return [f"schema {version}: {where}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"schema {version}: {e.message}"]
    except (kubernetes_validate.InvalidSchemaError, KeyError) as e:
        return [f"schema {version}: cannot validate: {e}"]
    return []


# ------------------------------------------------------------------------------ pod rules


def pod_spec_of(doc: dict) -> dict | None:
    if doc.get("kind") == "Pod":
        return doc.get("spec") or {}
    if doc.get("kind") in POD_TEMPLATE_KINDS:
        return ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
    return None


def containers_of(pod: dict) -> Iterable[tuple[str, dict]]:
    for c in pod.get("initContainers") or []:
        yield "initContainers", c
    for c in pod.get("containers") or []:
        yield "containers", c


def under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/") or "/"
    return path == prefix or path.startswith(prefix + "/") or prefix == "/"


def container_errors(pod: dict, field: str, c: dict) -> list[str]:
    name = c.get("name", "?")
    at = f"{field}[{name}]"
    errs: list[str] = []
    sc = c.get("securityContext") or {}
    privileged = sc.get("privileged") is True
    caps = sc.get("capabilities") or {}
    added = [str(a) for a in caps.get("add") or []]
    volumes = {v.get("name") for v in pod.get("volumes") or []}

    # API server: validateMountPropagation / validateVolumeMounts.
    paths: set[str] = set()
    for m in c.get("volumeMounts") or []:
        if m.get("name") not in volumes:
            errs.append(f"{at}: volumeMount {m.get('name')!r} names no volume of the pod")
        mp = m.get("mountPath")
        if mp in paths:
            errs.append(f"{at}: mountPath {mp} is used twice")
        paths.add(mp)
        if m.get("mountPropagation") == "Bidirectional" and not privileged:
            errs.append(
                f"{at}: mountPropagation Bidirectional on {mp} is allowed only in privileged "
                "containers (the API server refuses it)"
            )

    # API server: AllowPrivilegeEscalation=false conflicts.
    if sc.get("allowPrivilegeEscalation") is False:
        if privileged:
            errs.append(f"{at}: allowPrivilegeEscalation false with privileged true is refused")
        if "CAP_SYS_ADMIN" in added:
            errs.append(
                f"{at}: allowPrivilegeEscalation false with capability CAP_SYS_ADMIN is "
                "refused: spell it SYS_ADMIN"
            )

    # API server: host ports under hostNetwork; probes naming ports.
    port_names = set()
    for p in c.get("ports") or []:
        if "name" in p:
            port_names.add(p["name"])
        if pod.get("hostNetwork") and "hostPort" in p and p["hostPort"] != p["containerPort"]:
            errs.append(f"{at}: with hostNetwork, hostPort must equal containerPort {p}")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        handler = (c.get(probe) or {})
        for kind in ("httpGet", "tcpSocket", "grpc"):
            port = (handler.get(kind) or {}).get("port")
            if isinstance(port, str) and port not in port_names:
                errs.append(f"{at}: {probe} names port {port!r}, which the container lacks")

    # meshpath: least privilege.
    if privileged:
        if field != "initContainers":
            errs.append(f"{at}: only an init container may be privileged")
    else:
        if "ALL" not in (caps.get("drop") or []):
            errs.append(f"{at}: capabilities.drop must contain ALL")
        if sc.get("allowPrivilegeEscalation") is not False:
            errs.append(f"{at}: allowPrivilegeEscalation must be false")
        if sc.get("privileged") is not False:
            errs.append(f"{at}: privileged must be set to false explicitly")
    if sc.get("readOnlyRootFilesystem") is not True:
        errs.append(f"{at}: readOnlyRootFilesystem must be true")
    resources = c.get("resources") or {}
    if not (resources.get("requests") and resources.get("limits")):
        errs.append(f"{at}: resources.requests and resources.limits must be set")

    # meshpath: the image holds only the three binaries and Debian slim's shell.
    command = c.get("command") or []
    if not command:
        errs.append(f"{at}: command must name the binary (the image has no entrypoint)")
    elif command[0] != SHELL and command[0] not in {f"/usr/local/bin/{b}" for b in BINARIES}:
        errs.append(f"{at}: command {command[0]} is not a binary the image installs")

    # meshpath: paths in args are on a volume (the root filesystem is read-only and empty).
    mounts = [m.get("mountPath", "") for m in c.get("volumeMounts") or []]
    for a in c.get("args") or []:
        if isinstance(a, str) and a.startswith("/") and not any(under(a, m) for m in mounts):
            errs.append(f"{at}: argument {a} is on no volume mount of the container")
    return errs


def pod_errors(doc: dict, pod: dict) -> list[str]:
    errs: list[str] = []
    names = [c.get("name") for _, c in containers_of(pod)]
    for n in {n for n in names if names.count(n) > 1}:
        errs.append(f"container name {n!r} is used twice")
    vols = [v.get("name") for v in pod.get("volumes") or []]
    for n in {n for n in vols if vols.count(n) > 1}:
        errs.append(f"volume name {n!r} is used twice")
    if pod.get("automountServiceAccountToken") is not False and not pod.get("serviceAccountName"):
        errs.append(
            "automountServiceAccountToken must be false unless the pod runs as a ServiceAccount of its own"
        )
    if doc.get("kind") == "Job" and pod.get("restartPolicy") not in ("OnFailure", "Never"):
        errs.append("a Job's restartPolicy must be OnFailure or Never")
    for field, c in containers_of(pod):
        errs += container_errors(pod, field, c)
    return errs


def selector_errors(doc: dict) -> list[str]:
    if doc.get("kind") not in POD_TEMPLATE_KINDS - {"Job"}:
        return []
    spec = doc.get("spec") or {}
    match = (spec.get("selector") or {}).get("matchLabels") or {}
    labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    if not match:
        return ["spec.selector.matchLabels is empty"]
    if any(labels.get(k) != v for k, v in match.items()):
        return ["spec.selector does not match spec.template.metadata.labels"]
    return []


def secret_errors(doc: dict) -> list[str]:
    if doc.get("kind") != "Secret":
        return []
    errs = []
    for key, value in (doc.get("data") or {}).items():
        try:
            base64.b64decode(value or "", validate=True)
        except (binascii.Error, TypeError):
            errs.append(f"data.{key} is not valid base64")
    return errs


def workload_store_errors(text: str) -> list[str]:
    """The shape proxy/src/config.rs reads (WorkloadStore, deny_unknown_fields at the top)."""
    try:
        store = yaml.load(text, Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        return [f"workloads.yaml does not parse: {e}"]
    if not isinstance(store, dict):
        return ["workloads.yaml must be a mapping"]
    errs = [f"workloads.yaml: unknown top-level field {k!r}" for k in store
            if k not in ("workloads", "services", "policies")]
    for i, w in enumerate(store.get("workloads") or []):
        at = f"workloads.yaml workloads[{i}]"
        for required in ("uid", "namespace", "serviceAccount"):
            if not isinstance(w.get(required), str) or not w.get(required):
                errs.append(f"{at}: {required} is required")
        if w.get("protocol", "TCP") not in ("HBONE", "TCP"):
            errs.append(f"{at}: protocol must be HBONE or TCP")
        for ip in w.get("workloadIps") or []:
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                errs.append(f"{at}: workloadIps entry {ip!r} is not an IP address")
    uids = [w.get("uid") for w in store.get("workloads") or []]
    for u in sorted({u for u in uids if uids.count(u) > 1}, key=str):
        errs.append(f"workloads.yaml: uid {u!r} is used twice")
    for i, s in enumerate(store.get("services") or []):
        for v in s.get("vips") or []:
            try:
                ipaddress.ip_address(str(v).rsplit("/", 1)[-1])
            except ValueError:
                errs.append(f"workloads.yaml services[{i}]: vip {v!r} is not NETWORK/IP or IP")
    return errs


# Values the OpenAPI schema types only as strings; the API server (or, for capabilities, the
# container runtime at start) refuses anything else. Keyed by (parent field, field).
ENUMS = {
    (None, "mountPropagation"): {"None", "HostToContainer", "Bidirectional"},
    (None, "dnsPolicy"): {"ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"},
    (None, "imagePullPolicy"): {"Always", "IfNotPresent", "Never"},
    (None, "restartPolicy"): {"Always", "OnFailure", "Never"},
    ("ports", "protocol"): {"TCP", "UDP", "SCTP"},
    ("hostPath", "type"): {"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File",
                           "Socket", "CharDevice", "BlockDevice"},
    ("seccompProfile", "type"): {"RuntimeDefault", "Unconfined", "Localhost"},
    ("appArmorProfile", "type"): {"RuntimeDefault", "Unconfined", "Localhost"},
    ("updateStrategy", "type"): {"RollingUpdate", "OnDelete"},
    ("tolerations", "operator"): {"Exists", "Equal"},
}
# Linux capability names (capability(7)), as Kubernetes spells them (CAP_ prefix optional).
CAPABILITIES = {
    "ALL", "AUDIT_CONTROL", "AUDIT_READ", "AUDIT_WRITE", "BLOCK_SUSPEND", "BPF",
    "CHECKPOINT_RESTORE", "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID",
    "IPC_LOCK", "IPC_OWNER", "KILL", "LEASE", "LINUX_IMMUTABLE", "MAC_ADMIN", "MAC_OVERRIDE",
    "MKNOD", "NET_ADMIN", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_RAW", "PERFMON", "SETFCAP",
    "SETGID", "SETPCAP", "SETUID", "SYSLOG", "SYS_ADMIN", "SYS_BOOT", "SYS_CHROOT", "SYS_MODULE",
    "SYS_NICE", "SYS_PACCT", "SYS_PTRACE", "SYS_RAWIO", "SYS_RESOURCE", "SYS_TIME",
    "SYS_TTY_CONFIG", "WAKE_ALARM",
}


def enum_errors(node: Any, where: str = "", parent: str | None = None) -> list[str]:
    errs: list[str] = []
    if isinstance(node, list):
        for i, item in enumerate(node):
            errs += enum_errors(item, f"{where}[{i}]", parent)
    elif isinstance(node, dict):
        for key, value in node.items():
            at = f"{where}.{key}" if where else str(key)
            allowed = ENUMS.get((parent, key)) or ENUMS.get((None, key))
            if allowed is not None and isinstance(value, str) and value not in allowed:
                errs.append(f"{at}: {value!r} is not one of {sorted(allowed)}")
            if parent == "capabilities" and key in ("add", "drop"):
                for cap in value or []:
                    if str(cap).removeprefix("CAP_") not in CAPABILITIES:
                        errs.append(f"{at}: {cap!r} is not a Linux capability")
            errs += enum_errors(value, at, key)
    return errs


def document_errors(doc: Any, versions: Iterable[str] = VERSIONS) -> list[str]:
    """Every error of one document: schema (each version), API-server rules, meshpath rules."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return ["not a Kubernetes object (apiVersion and kind are required)"]
    errs: list[str] = []
    for v in versions:
        errs += schema_errors(doc, v)
    meta = doc.get("metadata") or {}
    cluster_scoped = doc["kind"] in ("Namespace", "ClusterRole", "ClusterRoleBinding")
    if not cluster_scoped and meta.get("namespace") != NAMESPACE:
        errs.append(f"metadata.namespace must be {NAMESPACE}")
    errs += enum_errors(doc)
    errs += selector_errors(doc)
    errs += secret_errors(doc)
    pod = pod_spec_of(doc)
    if pod is not None:
        errs += pod_errors(doc, pod)
    if doc["kind"] == "ConfigMap" and "workloads.yaml" in (doc.get("data") or {}):
        errs += workload_store_errors(doc["data"]["workloads.yaml"])
    return errs


# Objects a pod may use that something else defines: istiod writes its root certificate into
# every namespace as this ConfigMap (the proxy verifies istiod with it, as ztunnel does).
EXTERNAL = {("ConfigMap", "istio-ca-root-cert")}


def reference_errors(docs: list[dict]) -> list[str]:
    """ConfigMaps, Secrets and ServiceAccounts the pods use must be defined under deploy/
    (or be one of EXTERNAL)."""
    defined = {(d.get("kind"), (d.get("metadata") or {}).get("name")) for d in docs} | EXTERNAL
    errs = []
    for d in docs:
        pod = pod_spec_of(d)
        if pod is None:
            continue
        meta = d.get("metadata") or {}
        who = f"{d['kind']} {meta.get('name') or meta.get('generateName')}"
        sa = pod.get("serviceAccountName")
        if sa and ("ServiceAccount", sa) not in defined:
            errs.append(f"{who}: ServiceAccount {sa} is not defined under deploy/")
        for v in pod.get("volumes") or []:
            sources = [v] + list((v.get("projected") or {}).get("sources") or [])
            for s in sources:
                if "configMap" in s:
                    name = s["configMap"].get("name")
                    if ("ConfigMap", name) not in defined:
                        errs.append(f"{who}: ConfigMap {name} is not defined under deploy/")
                if "secret" in s:
                    name = s["secret"].get("secretName") or s["secret"].get("name")
                    if ("Secret", name) not in defined:
                        errs.append(f"{who}: Secret {name} is not defined under deploy/")
    return errs


def containerfile_errors() -> list[str]:
    if not CONTAINERFILE.is_file():
        return [f"{CONTAINERFILE.relative_to(ROOT)} is missing"]
    text = CONTAINERFILE.read_text()
    return [f"Containerfile does not install {b}" for b in BINARIES
            if f"/out/{b}" not in text or "/usr/local/bin/" not in text]


# ------------------------------------------------------------------------------ self-check


_GOOD_DAEMONSET = """
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: selfcheck, namespace: meshpath-system}
spec:
  selector: {matchLabels: {app: selfcheck}}
  template:
    metadata: {labels: {app: selfcheck}}
    spec:
      automountServiceAccountToken: false
      hostNetwork: true
      containers:
        - name: c
          image: example.invalid/x:1
          command: [/usr/local/bin/meshpath-loader]
          resources: {requests: {cpu: 1m}, limits: {memory: 1Mi}}
          securityContext:
            privileged: false
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {drop: [ALL]}
          volumeMounts: [{name: v, mountPath: /sys/fs/bpf}]
      volumes: [{name: v, hostPath: {path: /sys/fs/bpf}}]
"""


def self_check() -> None:
    """Documents the validator must reject, and one it must accept; exits if it is wrong."""
    problems = []
    good = load_documents(_GOOD_DAEMONSET)[0]
    if errs := document_errors(good):
        problems.append(f"a valid DaemonSet was rejected: {errs}")

    unknown = load_documents(_GOOD_DAEMONSET)[0]
    unknown["spec"]["template"]["spec"]["hostNetwrok"] = True
    errs = document_errors(unknown)
    if not any("schema" in e and "hostNetwrok" in e for e in errs):
        problems.append(f"a DaemonSet with the unknown field hostNetwrok was not rejected: {errs}")

    bidi = load_documents(_GOOD_DAEMONSET)[0]
    mount = bidi["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]
    mount["mountPropagation"] = "Bidirectional"
    if not any("Bidirectional" in e for e in document_errors(bidi)):
        problems.append("a Bidirectional mount in an unprivileged container was not rejected")

    try:
        load_documents("a: 1\na: 2\n")
        problems.append("a duplicate YAML key was not rejected")
    except yaml.YAMLError:
        pass

    if problems:
        for p in problems:
            print(f"validate: SELF-CHECK FAILED: {p}", file=sys.stderr)
        sys.exit(2)
    print("self-check: valid DaemonSet accepted; unknown field, Bidirectional without privileged, "
          "duplicate key rejected")


# ------------------------------------------------------------------------------------- main


def main() -> int:
    print(f"kubernetes-validate {kubernetes_validate.__version__}, strict, Kubernetes "
          + " and ".join(VERSIONS))
    self_check()
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    if not files:
        print(f"validate: no YAML file under {DEPLOY}", file=sys.stderr)
        return 1
    passed = failed = 0
    all_docs: list[dict] = []
    for path in files:
        rel = path.relative_to(ROOT)
        try:
            with path.open() as f:  # the file's name appears in YAML error marks
                docs = load_documents(f)
        except yaml.YAMLError as e:
            print(f"FAIL {rel}: YAML: {e}")
            failed += 1
            continue
        if not docs:
            print(f"FAIL {rel}: no document")
            failed += 1
            continue
        for i, doc in enumerate(docs, 1):
            errs = document_errors(doc)
            obj = doc if isinstance(doc, dict) else {}
            meta = obj.get("metadata") or {}
            name = meta.get("name") or f"{meta.get('generateName', '?')}*"
            what = f"{rel} [{i}/{len(docs)}] {obj.get('kind', '?')} {name}"
            if errs:
                failed += 1
                print(f"FAIL {what}")
                for e in errs:
                    print(f"     - {e}")
            else:
                passed += 1
                print(f"ok   {what}")
            if isinstance(doc, dict):
                all_docs.append(doc)
    cross = reference_errors(all_docs) + containerfile_errors()
    for e in cross:
        print(f"FAIL cross-file: {e}")
    if cross:
        failed += 1
    print(f"validate: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
