//! The real Kubernetes API server the agent's tests run against, obtained once per machine:
//! etcd from Debian's `etcd-server` package, and `kube-apiserver` built from Debian's
//! `kubernetes` source package (its Go dependencies are vendored in it; nothing else is
//! downloaded), the way its debian/rules builds it. The binary is cached under the tool cache;
//! later runs find it and do nothing.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::bootstrap::{cache_dir, run};

/// Where the built `kube-apiserver` is kept.
pub fn kube_apiserver_path() -> PathBuf {
    cache_dir().join("kube-apiserver").join("kube-apiserver")
}

/// The Debian packages the build needs (Go, and what `make` and `apt-get source` use).
const BUILD_PACKAGES: &[&str] = &["golang-go", "rsync", "jq", "make", "dpkg-dev"];

/// Makes sure `kube-apiserver` is built and cached; returns its path.
pub fn ensure_kube_apiserver() -> Result<PathBuf> {
    let bin = kube_apiserver_path();
    if works(&bin) {
        return Ok(bin);
    }
    println!("bootstrap: building kube-apiserver from Debian's kubernetes source (about 5 minutes, once)");
    ensure_deb_src()?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(BUILD_PACKAGES)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdout(Stdio::null()))
    .context("installing the Go toolchain to build kube-apiserver")?;
    let work = cache_dir().join("kube-apiserver-build");
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
    // As debian/rules: a GOPATH in the tree whose k8s.io/kubernetes is the tree itself.
    let gopath = tree.join(".go");
    fs::create_dir_all(gopath.join("src/k8s.io"))?;
    let link = gopath.join("src/k8s.io/kubernetes");
    if !link.exists() {
        std::os::unix::fs::symlink("../../..", &link)?;
    }
    let make = || {
        Command::new("make")
            .arg("WHAT=cmd/kube-apiserver")
            .current_dir(&tree)
            .env("GOPATH", &gopath)
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
                "building kube-apiserver failed; run `make WHAT=cmd/kube-apiserver` in {} with \
                 GOPATH={} to see why",
                tree.display(),
                gopath.display()
            );
        }
    }
    let built = tree.join("_output/local/bin/linux/amd64/kube-apiserver");
    let dir = bin.parent().context("cache path")?;
    fs::create_dir_all(dir)?;
    fs::copy(&built, &bin).with_context(|| format!("copying {}", built.display()))?;
    let _ = fs::remove_dir_all(&work);
    if !works(&bin) {
        bail!("{} was built but does not run", bin.display());
    }
    Ok(bin)
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
