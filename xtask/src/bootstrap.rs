//! Makes a fresh machine ready to build and test meshpath, once.
//!
//! Every step first checks whether its piece is already there and does nothing if so, so running
//! it again is cheap. Each step prints one line when it installs something. When a piece cannot be
//! installed the error is one sentence that says what to do.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

/// The bpf-linker release that works with the nightly's LLVM 22 (see docs/toolchain.md).
const BPF_LINKER_VERSION: &str = "0.13.0";
/// bpf-linker's cargo feature for the LLVM major version the nightly ships.
const BPF_LINKER_LLVM_FEATURE: &str = "llvm-22";
/// The toolchain that compiles the eBPF crate (aya-build's default).
const NIGHTLY: &str = "nightly";

/// Debian packages the tests, the demo and the benches run: (package, a command it provides).
pub const DEBIAN_PACKAGES: &[(&str, &str)] = &[
    ("iproute2", "ip"),
    ("iperf3", "iperf3"),
    ("bpftool", "bpftool"),
    ("util-linux", "nsenter"),
    ("procps", "ps"),
    // Only to show, in tests, that capture writes no netfilter rule.
    ("iptables", "iptables-save"),
    ("nftables", "nft"),
    // The real CNI plugins the CNI chain runs (bridge, host-local, loopback in /usr/lib/cni).
    ("containernetworking-plugins", "/usr/lib/cni/bridge"),
    // A CA made outside meshpath (RSA key) in the proxy's tests.
    ("openssl", "openssl"),
    // The real Kubernetes API server's store, and its readiness check, in the agent's tests.
    ("etcd-server", "etcd"),
    ("curl", "curl"),
    // The proxy benchmark's count of the proxies' system calls per round trip.
    ("linux-perf", "perf"),
];

/// Debian packages the kernel-matrix VMs need (`cargo xtask test --kernel …`): the emulator and
/// its virtiofs daemon, a static busybox for the guest's initramfs, and depmod for the guest
/// kernel's module index.
pub const VM_PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86", "qemu-system-x86_64"),
    ("busybox-static", "/bin/busybox"),
    ("kmod", "depmod"),
];

/// What `ensure` should make sure of.
#[derive(Debug, Clone, Copy)]
pub struct Needs {
    /// The nightly with rust-src and bpf-linker (anything that compiles the eBPF crate).
    pub ebpf_toolchain: bool,
    /// Debian packages and a mounted bpffs (anything that runs programs or traffic).
    pub runtime: bool,
    /// What booting Debian's kernels under QEMU needs (packages only; kernels are fetched by
    /// vm.rs when a run asks for them).
    pub vm: bool,
    /// Kubernetes' server binaries built from Debian's source (kubernetes.rs): the agent's
    /// tests, `demo --kube` and the cluster.
    pub kubernetes: bool,
}

impl Needs {
    pub const NOTHING: Self =
        Self { ebpf_toolchain: false, runtime: false, vm: false, kubernetes: false };
}

/// Brings the machine to what `needs` asks for, Kubernetes aside (`main.rs`'s `ensure`
/// builds it after this, with kubernetes.rs, which uses what this module installs). Returns the directory to put first on PATH so
/// that cargo finds bpf-linker.
pub fn ensure(needs: Needs) -> Result<Option<PathBuf>> {
    let mut path_dir = None;
    if needs.ebpf_toolchain {
        ensure_nightly_rust_src()?;
        path_dir = Some(ensure_bpf_linker()?);
    }
    if needs.runtime {
        ensure_debian_packages(DEBIAN_PACKAGES)?;
        ensure_bpffs()?;
        ensure_kubernetes_validate()?;
    }
    if needs.vm {
        ensure_debian_packages(VM_PACKAGES)?;
    }
    Ok(path_dir)
}

fn ensure_nightly_rust_src() -> Result<()> {
    let installed = output("rustup", &["component", "list", "--installed", "--toolchain", NIGHTLY])
        .context(
            "the nightly Rust toolchain is missing; it must be preinstalled on this machine \
             (rustup cannot fetch another one here)",
        )?;
    if installed.lines().any(|l| l.starts_with("rust-src")) {
        return Ok(());
    }
    println!("bootstrap: adding rust-src to the nightly toolchain (for -Z build-std=core)");
    run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", NIGHTLY]))
        .context("could not add rust-src to the nightly: run `rustup component add rust-src --toolchain nightly` and read its error")
}

/// Where bpf-linker is built and kept: survives `cargo clean` and checkouts.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = env::var_os("MESHPATH_TOOL_CACHE") {
        return PathBuf::from(dir);
    }
    let base = env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/var/cache"));
    base.join("meshpath")
}

/// Finds the nightly's own libLLVM shared object (its exact name varies by release).
fn nightly_libllvm() -> Result<PathBuf> {
    let sysroot = output("rustc", &[&format!("+{NIGHTLY}"), "--print", "sysroot"])?;
    let lib = Path::new(sysroot.trim()).join("lib");
    let mut candidates: Vec<PathBuf> = fs::read_dir(&lib)
        .with_context(|| format!("reading {}", lib.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM") && n.contains(".so"))
        })
        .collect();
    // Prefer the versioned soname (libLLVM.so.22.1-…), which is what the linker records.
    candidates.sort_by_key(|p| !p.to_string_lossy().contains("libLLVM.so."));
    candidates
        .into_iter()
        .next()
        .with_context(|| format!("the nightly ships no libLLVM shared object in {}", lib.display()))
}

fn bpf_linker_works(bin: &Path) -> bool {
    Command::new(bin)
        .arg("--version")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER_VERSION)
        })
}

fn ensure_bpf_linker() -> Result<PathBuf> {
    let root = cache_dir().join("bpf-linker");
    let bin_dir = root.join("bin");
    let bin = bin_dir.join("bpf-linker");
    let llvm_prefix = root.join("llvm");
    let libllvm = nightly_libllvm()?;
    let lib_dir = llvm_prefix.join("lib");
    // bpf-linker's build links against lib/libLLVM.so; the binary then loads the library by its
    // soname (the file's own name) through an rpath to lib/. Both names must point at the
    // nightly's current library (a nightly update changes it).
    let soname = libllvm.file_name().context("libLLVM path has no file name")?;
    let links = [lib_dir.join("libLLVM.so"), lib_dir.join(soname)];
    let links_ok = links.iter().all(|l| fs::read_link(l).is_ok_and(|t| t == libllvm));
    if links_ok && bpf_linker_works(&bin) {
        return Ok(bin_dir);
    }
    fs::create_dir_all(&lib_dir)?;
    for link in &links {
        if fs::read_link(link).is_ok_and(|t| t == libllvm) {
            continue;
        }
        let _ = fs::remove_file(link);
        std::os::unix::fs::symlink(&libllvm, link)
            .with_context(|| format!("linking {} to {}", link.display(), libllvm.display()))?;
    }
    if bpf_linker_works(&bin) {
        return Ok(bin_dir);
    }
    println!(
        "bootstrap: building bpf-linker {BPF_LINKER_VERSION} against {} (about 3 minutes, once)",
        libllvm.display()
    );
    run(Command::new("cargo")
        .args(["install", "--locked", "bpf-linker", "--version", BPF_LINKER_VERSION])
        .args(["--no-default-features", "--features", BPF_LINKER_LLVM_FEATURE, "--force"])
        .arg("--root")
        .arg(&root)
        .env("LLVM_PREFIX", &llvm_prefix)
        .stdout(Stdio::null()))
    .context(
        "could not build bpf-linker from crates.io; run the command above by hand to see why",
    )?;
    if !bpf_linker_works(&bin) {
        bail!(
            "bpf-linker was built at {} but `bpf-linker --version` does not run; \
             remove {} and try again",
            bin.display(),
            root.display()
        );
    }
    Ok(bin_dir)
}

fn package_installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

/// The PyPI package the manifest test validates deploy/ with, offline.
const KUBERNETES_VALIDATE: &str = "kubernetes-validate";

fn python_has(module: &str) -> bool {
    Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn ensure_kubernetes_validate() -> Result<()> {
    if python_has("kubernetes_validate") {
        return Ok(());
    }
    println!("setup: pip install {KUBERNETES_VALIDATE}");
    let pip = |extra: &[&str]| {
        Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", KUBERNETES_VALIDATE])
            .args(extra)
            .status()
            .is_ok_and(|s| s.success())
    };
    if pip(&[]) || pip(&["--break-system-packages"]) {
        return Ok(());
    }
    // Debian's python3 comes without pip.
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "python3-pip"])
        .stdout(Stdio::null()))
    .context("installing python3-pip")?;
    if pip(&["--break-system-packages"]) {
        return Ok(());
    }
    bail!("could not install {KUBERNETES_VALIDATE}: run `python3 -m pip install {KUBERNETES_VALIDATE}`")
}

pub fn ensure_debian_packages(packages: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&str> =
        packages.iter().filter(|(pkg, _)| !package_installed(pkg)).map(|(pkg, _)| *pkg).collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!(
            "Debian packages {} are missing; install them as root (apt-get install {})",
            missing.join(", "),
            missing.join(" ")
        );
    }
    println!("bootstrap: installing Debian packages {}", missing.join(" "));
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if install() {
        return Ok(());
    }
    // A fresh machine has empty package lists: update once, then try again.
    run(Command::new("apt-get").args(["update", "-qq"]).stdout(Stdio::null()))
        .context("apt-get update failed")?;
    if !install() {
        bail!(
            "apt-get could not install {}; run `apt-get install {}` to see why",
            missing.join(" "),
            missing.join(" ")
        );
    }
    Ok(())
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn ensure_bpffs() -> Result<()> {
    let mounts = fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    if mounts.lines().any(|l| {
        let mut f = l.split_whitespace();
        let (_, dir, fstype) = (f.next(), f.next(), f.next());
        dir == Some("/sys/fs/bpf") && fstype == Some("bpf")
    }) {
        return Ok(());
    }
    println!("bootstrap: mounting bpffs at /sys/fs/bpf");
    run(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]))
        .context("could not mount bpffs at /sys/fs/bpf (needs root)")
}

pub fn output(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("could not run `{program}`"))?;
    if !out.status.success() {
        bail!("`{program} {}` failed with {}", args.join(" "), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("could not start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}
