//! Kubernetes' server binaries, built once per machine from Debian's `kubernetes` source package
//! (v1.20, its Go dependencies vendored in it: nothing else is downloaded), the way its
//! debian/rules builds them: kube-apiserver (the agent's tests and `demo --kube`), and
//! kube-controller-manager, kube-scheduler and kubelet (the cluster, cluster.rs).
//! They are cached under the tool cache; later runs find them and do nothing.
//!
//! One fix is applied to the source before building: the vendored modern-go/reflect2 v1.0.1 is
//! not safe on Go >= 1.18 (Debian's Go is 1.19) and makes the API server die with `fatal error:
//! fault` in json-iterator whenever it pretty-prints an answer (any client that does not look
//! like kubectl, a plain `curl` GET for one). Debian's own reflect2 v1.0.2 replaces it.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::bootstrap::{cache_dir, ensure_debian_packages, run};

/// The binaries, by name under `_output/local/bin/linux/amd64/`.
pub const BINARIES: &[&str] =
    &["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet"];

/// Bumped whenever the recipe changes what is built: a cache made by an older recipe (the API
/// server alone, without the reflect2 fix) is rebuilt.
const RECIPE: &str = "2: four server binaries, reflect2 v1.0.2";

/// Where the built binaries are kept.
pub fn bin_dir() -> PathBuf {
    cache_dir().join("kubernetes")
}

/// One built binary's path (it may not exist yet: [`ensure`] builds it).
pub fn binary(name: &str) -> PathBuf {
    bin_dir().join(name)
}

/// The Debian packages the build needs: Go, what `make` and `apt-get source` use, and Debian's
/// reflect2 whose source replaces the vendored one.
const BUILD_PACKAGES: &[(&str, &str)] = &[
    ("golang-go", "go"),
    ("rsync", "rsync"),
    ("jq", "jq"),
    ("make", "make"),
    ("dpkg-dev", "dpkg-source"),
    ("golang-github-modern-go-reflect2-dev", "/usr/share/gocode/src/github.com/modern-go/reflect2"),
];

/// Where Debian's reflect2 source is.
const REFLECT2: &str = "/usr/share/gocode/src/github.com/modern-go/reflect2";

fn stamp() -> PathBuf {
    bin_dir().join("RECIPE")
}

fn cached() -> bool {
    fs::read_to_string(stamp()).is_ok_and(|s| s.trim() == RECIPE)
        && BINARIES.iter().all(|b| works(&binary(b)))
}

/// Makes sure every binary is built and cached.
pub fn ensure() -> Result<()> {
    if cached() {
        return Ok(());
    }
    let started = std::time::Instant::now();
    println!(
        "bootstrap: building {} from Debian's kubernetes source (about 6 minutes on 2 cores, once)",
        BINARIES.join(", ")
    );
    ensure_deb_src()?;
    ensure_debian_packages(BUILD_PACKAGES)?;
    let work = cache_dir().join("kubernetes-build");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    run(Command::new("apt-get")
        .args(["source", "-qq", "kubernetes"])
        .current_dir(&work)
        .stdout(Stdio::null()))
    .context("apt-get source kubernetes (needs the deb-src lists added above)")?;
    let tree = fs::read_dir(&work)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.is_dir())
        .context("apt-get source unpacked no directory")?;
    replace_reflect2(&tree)?;
    // As debian/rules: a GOPATH in the tree whose k8s.io/kubernetes is the tree itself.
    let gopath = tree.join(".go");
    fs::create_dir_all(gopath.join("src/k8s.io"))?;
    let link = gopath.join("src/k8s.io/kubernetes");
    if !link.exists() {
        std::os::unix::fs::symlink("../../..", &link)?;
    }
    let what: Vec<String> = BINARIES.iter().map(|b| format!("cmd/{b}")).collect();
    let what = format!("WHAT={}", what.join(" "));
    let make = || {
        Command::new("make")
            .arg(&what)
            .current_dir(&tree)
            .env("GOPATH", &gopath)
            // Static binaries: the kubelet runs on the host, the others anywhere.
            .env("CGO_ENABLED", "0")
            // Everything is vendored: never reach for a module proxy or another toolchain.
            .env("GOPROXY", "off")
            .env("GOTOOLCHAIN", "local")
            .env("GOFLAGS", "-mod=vendor")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    // A first make that fails can leave empty generator binaries behind: start over once.
    if !make() {
        let _ = fs::remove_dir_all(tree.join("_output"));
        if !make() {
            bail!(
                "building Kubernetes failed; run `make '{what}'` in {} with GOPATH={} to see why",
                tree.display(),
                gopath.display()
            );
        }
    }
    let out = tree.join("_output/local/bin/linux/amd64");
    let dir = bin_dir();
    fs::create_dir_all(&dir)?;
    for b in BINARIES {
        let built = out.join(b);
        // Written aside and renamed: a running binary (the cluster's kubelet) is never truncated.
        let tmp = dir.join(format!(".{b}.tmp"));
        fs::copy(&built, &tmp).with_context(|| format!("copying {}", built.display()))?;
        fs::rename(&tmp, binary(b))?;
        if !works(&binary(b)) {
            bail!("{} was built but does not run", binary(b).display());
        }
    }
    fs::write(stamp(), RECIPE)?;
    let _ = fs::remove_dir_all(&work);
    println!("bootstrap: Kubernetes built in {} s", started.elapsed().as_secs());
    Ok(())
}

/// Replaces the vendored modern-go/reflect2 with Debian's v1.0.2 (its `*.go` and `*.s`; the
/// vendored build checks no hashes, so go.mod and vendor/modules.txt stay as they are).
fn replace_reflect2(tree: &Path) -> Result<()> {
    let vendored = tree.join("vendor/github.com/modern-go/reflect2");
    if !vendored.is_dir() {
        bail!("{} is missing: is this Debian's kubernetes 1.20 source?", vendored.display());
    }
    let is_source = |p: &Path| p.extension().is_some_and(|e| e == "go" || e == "s") && p.is_file();
    for e in fs::read_dir(&vendored)?.flatten() {
        if is_source(&e.path()) {
            fs::remove_file(e.path())?;
        }
    }
    let mut copied = 0;
    for e in fs::read_dir(REFLECT2).with_context(|| format!("reading {REFLECT2}"))?.flatten() {
        let p = e.path();
        if is_source(&p) && !p.to_string_lossy().ends_with("_test.go") {
            fs::copy(&p, vendored.join(e.file_name()))?;
            copied += 1;
        }
    }
    if copied == 0 {
        bail!("no reflect2 source in {REFLECT2}");
    }
    Ok(())
}

fn works(bin: &Path) -> bool {
    Command::new(bin)
        .arg("--version")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Adds a `deb-src` twin of each configured Debian `deb` source (deb822 format), once.
fn ensure_deb_src() -> Result<()> {
    let ours = Path::new("/etc/apt/sources.list.d/meshpath-deb-src.sources");
    if ours.exists() {
        return Ok(());
    }
    let dir = Path::new("/etc/apt/sources.list.d");
    let mut twin = String::new();
    for entry in fs::read_dir(dir)?.flatten() {
        let p = entry.path();
        if p.extension().is_none_or(|e| e != "sources") {
            continue;
        }
        let text = fs::read_to_string(&p)?;
        for stanza in text.split("\n\n") {
            if stanza.lines().any(|l| l.trim() == "Types: deb") {
                twin.push_str(&stanza.replace("Types: deb", "Types: deb-src"));
                twin.push_str("\n\n");
            }
        }
    }
    if twin.is_empty() {
        bail!("no deb822 Debian source in {} to add a deb-src twin of", dir.display());
    }
    fs::write(ours, twin)?;
    run(Command::new("apt-get").args(["update", "-qq"]).stdout(Stdio::null()))
        .context("apt-get update after adding deb-src")
}
