//! Table-driven cases written from ztunnel's documented evaluation (its `rbac.rs`, and Istio's
//! AuthorizationPolicy reference for the DENY/ALLOW order). Each case is one policy set, one
//! destination workload, one connection and the verdict.

use super::*;
use crate::state::store::WorkloadStore;

/// The destination workloads every case can pick from: `b` (prod, lists `prod/sel` and
/// `other/listed`), `c` (prod, lists nothing), `d` (other namespace).
const WORKLOADS: &str = "workloads:\n\
- {uid: b, namespace: prod, serviceAccount: b, authorizationPolicies: [prod/sel, other/listed]}\n\
- {uid: c, namespace: prod, serviceAccount: c}\n\
- {uid: d, namespace: other, serviceAccount: d}\n";

/// A connection: peer identity `ns/sa` (None: plaintext), source IP, destination IP:port.
struct Peer(Option<(&'static str, &'static str)>, &'static str, &'static str);

const SLEEP: Peer = Peer(Some(("dev", "sleep")), "10.1.0.5", "10.0.0.2:80");
const SLEEP_81: Peer = Peer(Some(("dev", "sleep")), "10.1.0.5", "10.0.0.2:81");
const PROD_WEB: Peer = Peer(Some(("prod", "web")), "10.1.0.6", "10.0.0.2:80");
const PLAIN: Peer = Peer(None, "10.1.0.7", "10.0.0.2:80");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    Allow,
    Deny,
}
use Want::{Allow, Deny};

struct Case {
    name: &'static str,
    /// YAML list items under `policies:`.
    policies: String,
    dst: &'static str,
    peer: Peer,
    want: Want,
}

fn run(cases: &[Case]) {
    let mut failed = Vec::new();
    for c in cases {
        let store = WorkloadStore::parse(&format!("{WORKLOADS}policies:\n{}", c.policies))
            .unwrap_or_else(|e| panic!("{}: policies do not parse: {e}", c.name));
        let id = c.peer.0.map(|(ns, sa)| Identity::new("cluster.local", ns, sa));
        let conn = Connection {
            src_identity: id.as_ref(),
            src: c.peer.1.parse().expect("src"),
            dst: c.peer.2.parse().expect("dst"),
        };
        let dst = store.by_uid(c.dst).expect("workload");
        let got = if check(&store.policies_for(dst), &conn).is_ok() { Allow } else { Deny };
        if got != c.want {
            failed.push(format!("{}: want {:?}, got {got:?}", c.name, c.want));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} cases failed:\n{}",
        failed.len(),
        cases.len(),
        failed.join("\n")
    );
}

/// A NAMESPACE-scoped DENY in prod with a single match.
fn deny_one(m: &str) -> String {
    format!("- {{name: p, namespace: prod, scope: Namespace, action: Deny, rules: [[[{m}]]]}}\n")
}

macro_rules! case {
    ($name:literal, $pol:expr, $dst:literal, $peer:expr, $want:expr) => {
        Case { name: $name, policies: $pol.to_string(), dst: $dst, peer: $peer, want: $want }
    };
}

#[test]
fn allow_and_deny_are_combined_as_istio_documents() {
    const DENY_DEV: &str = "- {name: no-dev, namespace: prod, scope: Namespace, action: Deny, rules: [[[{namespaces: [dev]}]]]}\n";
    const ALLOW_DEV: &str = "- {name: dev, namespace: prod, scope: Namespace, action: Allow, rules: [[[{namespaces: [dev]}]]]}\n";
    const BOTH: &str = "- {name: dev, namespace: prod, scope: Namespace, action: Allow, rules: [[[{namespaces: [dev]}]]]}\n\
                        - {name: no-80, namespace: prod, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [80]}]]]}\n";
    const TWO_ALLOWS: &str = "- {name: dev, namespace: prod, scope: Namespace, action: Allow, rules: [[[{namespaces: [dev]}]]]}\n\
                              - {name: prod, namespace: prod, scope: Namespace, action: Allow, rules: [[[{namespaces: [prod]}]]]}\n";
    run(&[
        case!("no policy allows", "  []\n", "b", PLAIN, Allow),
        case!("a matching DENY denies", DENY_DEV, "b", SLEEP, Deny),
        case!("a DENY that does not match allows", DENY_DEV, "b", PROD_WEB, Allow),
        case!("a matching ALLOW allows", ALLOW_DEV, "b", SLEEP, Allow),
        case!("an ALLOW makes what it does not match denied", ALLOW_DEV, "b", PROD_WEB, Deny),
        case!("DENY is checked before ALLOW", BOTH, "b", SLEEP, Deny),
        case!("ALLOW still applies where DENY does not match", BOTH, "b", SLEEP_81, Allow),
        case!("any one of several ALLOWs suffices", TWO_ALLOWS, "b", PROD_WEB, Allow),
        case!("none of several ALLOWs matching denies", TWO_ALLOWS, "b", PLAIN, Deny),
    ]);
}

#[test]
fn scope_decides_which_workloads_a_policy_applies_to() {
    const NS_PROD: &str =
        "- {name: deny-all, namespace: prod, scope: Namespace, action: Deny, rules: [[]]}\n";
    const GLOBAL: &str =
        "- {name: deny-all, namespace: istio-system, scope: Global, action: Deny, rules: [[]]}\n";
    const SEL: &str =
        "- {name: sel, namespace: prod, scope: WorkloadSelector, action: Deny, rules: [[]]}\n";
    const LISTED_NS: &str =
        "- {name: listed, namespace: other, scope: Namespace, action: Deny, rules: [[]]}\n";
    const ALLOW_ON_C: &str = "- {name: c-only, namespace: prod, scope: WorkloadSelector, action: Allow, rules: [[[{namespaces: [nobody]}]]]}\n";
    run(&[
        case!("NAMESPACE applies in its namespace", NS_PROD, "c", SLEEP, Deny),
        case!("NAMESPACE does not apply in another", NS_PROD, "d", SLEEP, Allow),
        case!("GLOBAL applies in every namespace", GLOBAL, "d", SLEEP, Deny),
        case!("WORKLOAD_SELECTOR applies to a workload listing it", SEL, "b", SLEEP, Deny),
        case!("WORKLOAD_SELECTOR does not apply to one that does not", SEL, "c", SLEEP, Allow),
        case!("a listed policy applies whatever its scope", LISTED_NS, "b", SLEEP, Deny),
        case!(
            "an ALLOW selecting another workload leaves this one open",
            ALLOW_ON_C,
            "c",
            SLEEP,
            Allow
        ),
    ]);
}

#[test]
fn empty_rules_clauses_and_matches_follow_ztunnel() {
    run(&[
        case!("a policy with no rules matches nothing (ALLOW: denies)",
            "- {name: p, namespace: prod, scope: Namespace, action: Allow, rules: []}\n", "b", SLEEP, Deny),
        case!("a policy with no rules matches nothing (DENY: allows)",
            "- {name: p, namespace: prod, scope: Namespace, action: Deny}\n", "b", SLEEP, Allow),
        case!("a rule with no clauses matches everything",
            "- {name: p, namespace: prod, scope: Namespace, action: Deny, rules: [[]]}\n", "b", PLAIN, Deny),
        case!("an empty clause matches, the other clause decides (hit)",
            "- {name: p, namespace: prod, scope: Namespace, action: Allow, rules: [[[], [{destinationPorts: [81]}]]]}\n", "b", SLEEP_81, Allow),
        case!("an empty clause matches, the other clause decides (miss)",
            "- {name: p, namespace: prod, scope: Namespace, action: Allow, rules: [[[], [{destinationPorts: [81]}]]]}\n", "b", SLEEP, Deny),
        case!("an empty match is skipped, not a wildcard (DENY)",
            "- {name: p, namespace: prod, scope: Namespace, action: Deny, rules: [[[{}]]]}\n", "b", SLEEP, Allow),
        case!("an empty match is skipped, not a wildcard (ALLOW)",
            "- {name: p, namespace: prod, scope: Namespace, action: Allow, rules: [[[{}]]]}\n", "b", SLEEP, Deny),
        case!("an empty match beside another: the other decides",
            "- {name: p, namespace: prod, scope: Namespace, action: Allow, rules: [[[{}, {destinationPorts: [80]}]]]}\n", "b", SLEEP, Allow),
        case!("a clause matches when any of its matches does",
            "- {name: p, namespace: prod, scope: Namespace, action: Allow, rules: [[[{destinationPorts: [79]}, {destinationPorts: [81]}]]]}\n", "b", SLEEP_81, Allow),
        case!("a rule needs every clause",
            "- {name: p, namespace: prod, scope: Namespace, action: Allow, rules: [[[{destinationPorts: [81]}], [{namespaces: [prod]}]]]}\n", "b", SLEEP_81, Deny),
        case!("a policy matches when any rule does",
            "- {name: p, namespace: prod, scope: Namespace, action: Allow, rules: [[[{namespaces: [x]}]], [[{namespaces: [dev]}]]]}\n", "b", SLEEP, Allow),
        case!("a match needs every field it sets",
            "- {name: p, namespace: prod, scope: Namespace, action: Allow, rules: [[[{namespaces: [dev], destinationPorts: [81]}]]]}\n", "b", SLEEP, Deny),
    ]);
}

#[test]
fn namespaces_take_every_string_match_form() {
    run(&[
        case!("exact", deny_one("{namespaces: [dev]}"), "b", SLEEP, Deny),
        case!("exact is not a prefix", deny_one("{namespaces: [de]}"), "b", SLEEP, Allow),
        case!("prefix", deny_one("{namespaces: [\"de*\"]}"), "b", SLEEP, Deny),
        case!("suffix", deny_one("{namespaces: [\"*ev\"]}"), "b", SLEEP, Deny),
        case!("presence matches any identity", deny_one("{namespaces: [\"*\"]}"), "b", SLEEP, Deny),
        case!(
            "presence does not match plaintext",
            deny_one("{namespaces: [\"*\"]}"),
            "b",
            PLAIN,
            Allow
        ),
        case!("ztunnel's Exact", deny_one("{namespaces: [{Exact: dev}]}"), "b", SLEEP, Deny),
        case!("ztunnel's Prefix", deny_one("{namespaces: [{Prefix: d}]}"), "b", SLEEP, Deny),
        case!("ztunnel's Suffix", deny_one("{namespaces: [{Suffix: v}]}"), "b", SLEEP, Deny),
        case!("ztunnel's Presence", deny_one("{namespaces: [{Presence: []}]}"), "b", SLEEP, Deny),
        case!("notNamespaces hit", deny_one("{notNamespaces: [prod]}"), "b", SLEEP, Deny),
        case!("notNamespaces miss", deny_one("{notNamespaces: [dev]}"), "b", SLEEP, Allow),
        case!(
            "plaintext's namespace is empty: every notNamespaces matches it",
            deny_one("{notNamespaces: [prod]}"),
            "b",
            PLAIN,
            Deny
        ),
    ]);
}

#[test]
fn principals_and_service_accounts_need_a_verified_identity() {
    run(&[
        case!(
            "principal exact",
            deny_one("{principals: [cluster.local/ns/dev/sa/sleep]}"),
            "b",
            SLEEP,
            Deny
        ),
        case!(
            "principal written with spiffe://",
            deny_one("{principals: [\"spiffe://cluster.local/ns/dev/sa/sleep\"]}"),
            "b",
            SLEEP,
            Deny
        ),
        case!(
            "ztunnel's Exact is matched without the scheme",
            deny_one("{principals: [{Exact: \"spiffe://cluster.local/ns/dev/sa/sleep\"}]}"),
            "b",
            SLEEP,
            Allow
        ),
        case!(
            "principal prefix",
            deny_one("{principals: [\"cluster.local/ns/dev/*\"]}"),
            "b",
            SLEEP,
            Deny
        ),
        case!("principal suffix", deny_one("{principals: [\"*/sa/sleep\"]}"), "b", SLEEP, Deny),
        case!(
            "principal of another account",
            deny_one("{principals: [cluster.local/ns/dev/sa/other]}"),
            "b",
            SLEEP,
            Allow
        ),
        case!(
            "plaintext matches no principal, not even *",
            deny_one("{principals: [\"*\"]}"),
            "b",
            PLAIN,
            Allow
        ),
        case!(
            "STRICT mTLS: notPrincipals * denies plaintext",
            deny_one("{notPrincipals: [\"*\"]}"),
            "b",
            PLAIN,
            Deny
        ),
        case!(
            "STRICT mTLS: notPrincipals * admits mTLS",
            deny_one("{notPrincipals: [\"*\"]}"),
            "b",
            SLEEP,
            Allow
        ),
        case!(
            "service account NS/SA",
            deny_one("{serviceAccounts: [dev/sleep]}"),
            "b",
            SLEEP,
            Deny
        ),
        case!(
            "service account in ztunnel's form",
            deny_one("{serviceAccounts: [{namespace: dev, serviceAccount: sleep}]}"),
            "b",
            SLEEP,
            Deny
        ),
        case!(
            "service account of another namespace",
            deny_one("{serviceAccounts: [prod/sleep]}"),
            "b",
            SLEEP,
            Allow
        ),
        case!(
            "plaintext has no service account",
            deny_one("{serviceAccounts: [dev/sleep]}"),
            "b",
            PLAIN,
            Allow
        ),
        case!(
            "notServiceAccounts hit",
            deny_one("{notServiceAccounts: [prod/web]}"),
            "b",
            SLEEP,
            Deny
        ),
        case!(
            "notServiceAccounts miss",
            deny_one("{notServiceAccounts: [dev/sleep]}"),
            "b",
            SLEEP,
            Allow
        ),
    ]);
}

#[test]
fn addresses_and_ports_match_source_and_destination() {
    const V6: Peer = Peer(None, "fd00::5", "[fd00::2]:80");
    const MAPPED: Peer = Peer(None, "::ffff:10.1.0.7", "[::ffff:10.0.0.2]:80");
    run(&[
        case!("source prefix", deny_one("{sourceIps: [10.1.0.0/16]}"), "b", PLAIN, Deny),
        case!("source host", deny_one("{sourceIps: [10.1.0.7]}"), "b", PLAIN, Deny),
        case!("source outside", deny_one("{sourceIps: [10.2.0.0/16]}"), "b", PLAIN, Allow),
        case!("source v6", deny_one("{sourceIps: [\"fd00::/8\"]}"), "b", V6, Deny),
        case!(
            "a v4-mapped source is its v4 address",
            deny_one("{sourceIps: [10.1.0.0/16]}"),
            "b",
            MAPPED,
            Deny
        ),
        case!("notSourceIps hit", deny_one("{notSourceIps: [10.1.0.7]}"), "b", SLEEP, Deny),
        case!("notSourceIps miss", deny_one("{notSourceIps: [10.1.0.7]}"), "b", PLAIN, Allow),
        case!("destination address", deny_one("{destinationIps: [10.0.0.2/32]}"), "b", PLAIN, Deny),
        case!(
            "destination address elsewhere",
            deny_one("{destinationIps: [10.0.0.3]}"),
            "b",
            PLAIN,
            Allow
        ),
        case!(
            "a v4-mapped destination is its v4 address",
            deny_one("{destinationIps: [10.0.0.0/24]}"),
            "b",
            MAPPED,
            Deny
        ),
        case!("notDestinationIps", deny_one("{notDestinationIps: [10.0.0.3]}"), "b", PLAIN, Deny),
        case!("destination port", deny_one("{destinationPorts: [80]}"), "b", PLAIN, Deny),
        case!(
            "destination port elsewhere",
            deny_one("{destinationPorts: [81]}"),
            "b",
            PLAIN,
            Allow
        ),
        case!("notDestinationPorts", deny_one("{notDestinationPorts: [81]}"), "b", PLAIN, Deny),
        case!(
            "positive and negative together",
            deny_one("{sourceIps: [10.1.0.0/16], notSourceIps: [10.1.0.7]}"),
            "b",
            PLAIN,
            Allow
        ),
    ]);
}

#[test]
fn dry_run_policies_are_reported_but_never_enforced() {
    let store = WorkloadStore::parse(&format!(
        "{WORKLOADS}policies:\n\
         - {{name: would-deny, namespace: prod, scope: Namespace, action: Deny, dryRun: true, rules: [[[{{namespaces: [dev]}}]]]}}\n\
         - {{name: would-allow, namespace: other, scope: Namespace, action: Allow, dryRun: true, rules: [[[{{namespaces: [prod]}}]]]}}\n"
    ))
    .expect("parse");
    let sleep = Identity::new("cluster.local", "dev", "sleep");
    let conn = Connection {
        src_identity: Some(&sleep),
        src: "10.1.0.5".parse().expect("ip"),
        dst: "10.0.0.2:80".parse().expect("dst"),
    };
    let on_b = decide(&store.policies_for(store.by_uid("b").expect("b")), &conn);
    assert_eq!(on_b.enforced, Ok(()), "a dry-run DENY denied");
    assert_eq!(on_b.dry_run, Some(Err(Denied::ByPolicy("prod/would-deny".into()))));
    let on_d = decide(&store.policies_for(store.by_uid("d").expect("d")), &conn);
    assert_eq!(on_d.enforced, Ok(()), "a dry-run ALLOW switched the workload to allow-list mode");
    assert_eq!(on_d.dry_run, Some(Err(Denied::NotAllowed("other/would-allow".into()))));
    let on_c_without = decide(&[], &conn);
    assert_eq!(on_c_without.dry_run, None, "no dry-run policy, yet a dry-run verdict");
}

#[test]
fn a_policy_as_ztunnel_serialises_it_is_read() {
    // What ztunnel's serde writes for an Authorization (its config dump, its local config).
    let json = r#"{"workloads": [{"uid": "b", "namespace": "prod", "serviceAccount": "b"}],
      "policies": [{"name": "p", "namespace": "prod", "scope": "Namespace", "action": "Deny",
        "rules": [[[{"namespaces": [{"Exact": "dev"}], "serviceAccounts": [{"namespace": "dev", "serviceAccount": "sleep"}],
                     "principals": [{"Prefix": "cluster.local/"}], "notPrincipals": [{"Suffix": "/sa/x"}],
                     "sourceIps": ["10.1.0.0/16"], "destinationIps": ["10.0.0.0/8"], "destinationPorts": [80],
                     "notNamespaces": [{"Presence": []}], "notDestinationPorts": [81]}]]],
        "dryRun": false}]}"#;
    let store = WorkloadStore::parse(json).expect("ztunnel's form");
    let m = &store.policies()[0].rules[0][0][0];
    assert_eq!(m.namespaces, vec![StringMatch::Exact("dev".into())]);
    assert_eq!(m.not_namespaces, vec![StringMatch::Presence()]);
    assert_eq!(m.service_accounts[0].service_account, "sleep");
    // And written back the same way.
    let again = serde_json::to_value(&store.policies()[0]).expect("serialise");
    assert_eq!(again["rules"][0][0][0]["notNamespaces"], serde_json::json!([{"Presence": []}]));
    assert_eq!(
        again["rules"][0][0][0]["principals"],
        serde_json::json!([{"Prefix": "cluster.local/"}])
    );
}

#[test]
fn bad_policies_are_errors_that_name_the_place() {
    for (yaml, want) in [
        ("{sourceIps: [10.0.0.0/33]}", "10.0.0.0/33"),
        ("{destinationIps: [nonsense]}", "nonsense"),
        ("{serviceAccounts: [just-an-account]}", "just-an-account"),
        ("{sourceIP: [10.0.0.1]}", "sourceIP"),
        ("{namespaces: [{Regex: x}]}", "namespaces"),
    ] {
        let text =
            format!("policies:\n- {{name: p, scope: Global, action: Deny, rules: [[[{yaml}]]]}}\n");
        let err = WorkloadStore::parse(&text).expect_err(yaml);
        assert!(err.contains("policies[0]") && err.contains(want), "{yaml}: {err}");
    }
}

#[test]
fn policies_written_back_as_yaml_read_back_the_same() {
    // Found by fuzz/fuzz_targets/workloads_file.rs: string matches were written as YAML tags
    // (`!Exact dev`), which the reader refused, so a config dump could not be read back.
    let text = format!(
        "{WORKLOADS}policies:\n- {{name: p, namespace: prod, scope: Namespace, action: Deny, \
         rules: [[[{{namespaces: [dev, \"pro*\", \"*od\", \"*\"], serviceAccounts: [dev/sleep], sourceIps: [10.0.0.0/8]}}]]]}}\n"
    );
    let store = WorkloadStore::parse(&text).expect("parse");
    let yaml = serde_yaml::to_string(&store).expect("write");
    let again = WorkloadStore::parse(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    assert_eq!(again.policies()[0].rules, store.policies()[0].rules, "{yaml}");
}
