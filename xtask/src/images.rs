//! Container images with no registry: built here from Debian's packages and this workspace's
//! binaries, kept as OCI archives, imported into the cluster's containerd (cluster.rs).
//!
//! - `localhost/meshpath-pause`: the pod sandbox image, a small static C program (sleeps until
//!   TERM, reaps children), as Kubernetes' own pause image is.
//! - `docker.io/library/debian:bookworm-slim`, in buildah's storage only: a Debian 12 root
//!   made by `mmdebstrap --variant=minbase` from the machine's Debian sources, standing in for
//!   the image of that name, so that deploy/Containerfile builds unchanged.
//! - `localhost/meshpath`: deploy/Containerfile's runtime stage, built by buildah with
//!   `--build-arg BINARIES=prebuilt` (the binaries this workspace just built, instead of its
//!   source stage, whose Rust image no registry here serves).
//! - `localhost/meshpath-testapp`: the cluster tests' workload (tests/src/bin/cluster-app.rs) on
//!   the same Debian base.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::bootstrap::{cache_dir, ensure_debian_packages, run};

pub const PAUSE: &str = "localhost/meshpath-pause:3.4";
pub const DEBIAN_SLIM: &str = "docker.io/library/debian:bookworm-slim";
/// The repository of meshpath's image in the cluster (the shipped manifests say
/// `registry.example.invalid/meshpath`; the cluster's kustomize overlay renames it).
pub const MESHPATH: &str = "localhost/meshpath";
pub const TESTAPP: &str = "localhost/meshpath-testapp:1";

/// What building images needs from Debian.
const PACKAGES: &[(&str, &str)] = &[
    ("buildah", "buildah"),
    ("mmdebstrap", "mmdebstrap"),
    ("gcc", "cc"),
    ("libc6-dev", "/usr/lib/x86_64-linux-gnu/libc.a"),
    ("binutils", "strip"),
];

/// The pause program: PID 1 of every pod sandbox.
const PAUSE_C: &str = r#"#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void stop(int s) { (void)s; _exit(0); }
static void reap(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
    struct sigaction a = {0};
    a.sa_handler = stop;
    sigaction(SIGINT, &a, 0);
    sigaction(SIGTERM, &a, 0);
    a.sa_handler = reap;
    a.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &a, 0);
    for (;;) pause();
}
"#;

fn images_dir() -> PathBuf {
    cache_dir().join("images")
}

/// buildah with its own storage under the tool cache (vfs: no overlay mounts to leave behind),
/// and its network configuration there too: left to its defaults it creates /etc/cni/net.d,
/// the node's CNI directory.
fn buildah() -> Command {
    let conf = cache_dir().join("buildah/containers.conf");
    if !conf.exists() {
        let _ = fs::create_dir_all(cache_dir().join("buildah/cni"));
        let _ = fs::write(
            &conf,
            format!(
                "[network]\nnetwork_config_dir = \"{}\"\n",
                cache_dir().join("buildah/cni").display()
            ),
        );
    }
    let mut c = Command::new("buildah");
    c.env("CONTAINERS_CONF", &conf);
    c.arg("--root")
        .arg(cache_dir().join("buildah/storage"))
        .arg("--runroot")
        .arg("/run/meshpath-buildah")
        .args(["--storage-driver", "vfs"]);
    c
}

fn buildah_has(image: &str) -> bool {
    buildah()
        .args(["images", "-q", image])
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success() && !o.stdout.is_empty())
}

/// Drops `tags` from buildah's storage once their archives are written, with the untagged
/// images a build leaves (its stages, the tags' previous images) and the working containers
/// of a build that failed: vfs keeps a full copy of every layer, and without this the
/// storage grew by the size of every image at every `cluster up`, some 20 GB on one machine.
fn forget(tags: &[String]) {
    let quiet = |c: &mut Command| {
        let _ = c.stdout(Stdio::null()).stderr(Stdio::null()).status();
    };
    quiet(buildah().arg("rmi").arg("-f").args(tags));
    quiet(buildah().args(["rm", "--all"]));
    quiet(buildah().args(["rmi", "--prune"]));
}

/// An image built from `context` with `containerfile`, written as an OCI archive.
fn build(containerfile: &Path, context: &Path, tag: &str, args: &[&str], out: &Path) -> Result<()> {
    run(buildah()
        .args(["bud", "--pull=never", "--layers=false", "--quiet", "-f"])
        .arg(containerfile)
        .args(args.iter().flat_map(|a| ["--build-arg", a]))
        .args(["-t", tag])
        .arg(context)
        .stdout(Stdio::null()))
    .with_context(|| format!("buildah could not build {tag}"))?;
    let tmp = out.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    run(buildah()
        .arg("push")
        .arg("--quiet")
        .arg(tag)
        .arg(format!("oci-archive:{}:{tag}", tmp.display())))
    .with_context(|| format!("buildah push {tag}"))?;
    fs::rename(&tmp, out)?;
    Ok(())
}

/// The Debian base in buildah's storage, made once.
fn ensure_debian_slim() -> Result<()> {
    if buildah_has(DEBIAN_SLIM) {
        return Ok(());
    }
    println!("images: making {DEBIAN_SLIM} from Debian's packages with mmdebstrap (once)");
    let tar = images_dir().join("debian-slim.tar");
    fs::create_dir_all(images_dir())?;
    // As Debian's slim images: no documentation, manual pages or translations.
    run(Command::new("mmdebstrap")
        .args(["--variant=minbase", "--mode=root", "--format=tar", "--quiet"])
        .args([
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            "--dpkgopt=path-exclude=/usr/share/info/*",
        ])
        .arg("bookworm")
        .arg(&tar))
    .context("mmdebstrap could not make a Debian root from this machine's apt sources")?;
    let out = buildah().arg("from").arg("scratch").output()?;
    if !out.status.success() {
        bail!("buildah from scratch: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let ctr = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let done = (|| -> Result<()> {
        run(buildah().args(["add", &ctr]).arg(&tar).arg("/").stdout(Stdio::null()))?;
        run(buildah().args(["config", "--cmd", "/bin/bash", &ctr]))?;
        run(buildah().args(["commit", "--quiet", &ctr, DEBIAN_SLIM]).stdout(Stdio::null()))
    })();
    let _ = buildah().args(["rm", &ctr]).stdout(Stdio::null()).status();
    let _ = fs::remove_file(&tar);
    done
}

/// The pause image's archive, built once.
pub fn pause() -> Result<PathBuf> {
    let out = images_dir().join("pause.tar");
    if out.exists() {
        return Ok(out);
    }
    ensure_debian_packages(PACKAGES)?;
    let ctx = tempdir("pause")?;
    fs::write(ctx.join("pause.c"), PAUSE_C)?;
    run(Command::new("cc")
        .args(["-static", "-Os", "-o"])
        .arg(ctx.join("pause"))
        .arg(ctx.join("pause.c")))
    .context("compiling the pause program (gcc, libc6-dev)")?;
    run(Command::new("strip").arg(ctx.join("pause")))?;
    fs::write(
        ctx.join("Containerfile"),
        "FROM scratch\nCOPY pause /pause\nENTRYPOINT [\"/pause\"]\n",
    )?;
    build(&ctx.join("Containerfile"), &ctx, PAUSE, &[], &out)?;
    let _ = fs::remove_dir_all(&ctx);
    Ok(out)
}

fn tempdir(what: &str) -> Result<PathBuf> {
    let d = images_dir().join(format!("ctx-{what}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d)?;
    Ok(d)
}

/// Copies `bins` from `bin_dir` into `ctx/target/release/`, stripped (debug builds carry
/// hundreds of megabytes of debug information).
fn stage_binaries(bin_dir: &Path, bins: &[&str], ctx: &Path) -> Result<()> {
    let dst = ctx.join("target/release");
    fs::create_dir_all(&dst)?;
    for b in bins {
        let from = bin_dir.join(b);
        fs::copy(&from, dst.join(b)).with_context(|| format!("copying {}", from.display()))?;
        run(Command::new("strip").arg(dst.join(b)))?;
    }
    Ok(())
}

/// meshpath's image from deploy/Containerfile and the binaries in `bin_dir`; the archive holds
/// it under `localhost/meshpath:TAG` for each of `tags`.
pub fn meshpath(root: &Path, bin_dir: &Path, tags: &[&str]) -> Result<PathBuf> {
    ensure_debian_packages(PACKAGES)?;
    ensure_debian_slim()?;
    let ctx = tempdir("meshpath")?;
    stage_binaries(bin_dir, &["meshpath-loader", "meshpath-proxy", "meshpath-cni"], &ctx)?;
    // The Containerfile is copied into the context: the ignore file beside the shipped one
    // (deploy/Containerfile.dockerignore) keeps target/ out, as it should for a source build.
    fs::copy(root.join("deploy/Containerfile"), ctx.join("Containerfile"))?;
    let first = format!("{MESHPATH}:{}", tags.first().context("no tag")?);
    let out = images_dir().join(format!("meshpath-{}.tar", tags[0]));
    build(&ctx.join("Containerfile"), &ctx, &first, &["BINARIES=prebuilt"], &out)?;
    // The other tags name the same image: the archive gets one manifest per tag.
    for t in &tags[1..] {
        let tag = format!("{MESHPATH}:{t}");
        run(buildah().args(["tag", &first, &tag]))?;
        run(buildah().arg("push").arg("--quiet").arg(&tag).arg(format!(
            "oci-archive:{}:{tag}",
            images_dir().join(format!("meshpath-{t}.tar")).display()
        )))?;
    }
    forget(&tags.iter().map(|t| format!("{MESHPATH}:{t}")).collect::<Vec<_>>());
    let _ = fs::remove_dir_all(&ctx);
    Ok(out)
}

/// The tests' workload image from the `cluster-app` binary in `bin_dir`.
pub fn testapp(bin_dir: &Path) -> Result<PathBuf> {
    ensure_debian_packages(PACKAGES)?;
    ensure_debian_slim()?;
    let ctx = tempdir("testapp")?;
    stage_binaries(bin_dir, &["cluster-app"], &ctx)?;
    fs::write(
        ctx.join("Containerfile"),
        format!(
            "FROM {DEBIAN_SLIM}\nCOPY target/release/cluster-app /usr/local/bin/cluster-app\n\
             CMD [\"/usr/local/bin/cluster-app\", \"serve\"]\n"
        ),
    )?;
    let out = images_dir().join("testapp.tar");
    build(&ctx.join("Containerfile"), &ctx, TESTAPP, &[], &out)?;
    forget(&[TESTAPP.to_string()]);
    let _ = fs::remove_dir_all(&ctx);
    Ok(out)
}
