//! The deployment manifests under deploy/ pass strict offline schema validation
//! (PyPI `kubernetes-validate`, several Kubernetes versions) and the API server's and
//! meshpath's own rules, as checked by tests/deploy/validate.py; the script first proves it
//! rejects broken documents.

use std::process::Command;

#[test]
fn every_manifest_validates_strictly() {
    // This checkout's, as `cargo test` names it (see meshpath_tests::cluster::repo_root).
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or(env!("CARGO_MANIFEST_DIR").into());
    let script = format!("{dir}/deploy/validate.py");
    let out = Command::new("python3").arg(&script).output().expect("running python3");
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "validation failed:\n{text}");
    assert!(text.contains("self-check"), "the validator did not run its self-check:\n{text}");
    assert!(text.contains("0 failed"), "{text}");
}
