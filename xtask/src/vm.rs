//! The kernel matrix: boots Debian's own kernel packages under QEMU and runs the datapath's
//! capture tests inside, on this machine's build output.
//!
//! How a run works (facts in docs/kernels.md):
//! - The kernel package (`linux-image-<series>.*-cloud-amd64-unsigned`, newest the configured
//!   Debian repositories offer) is fetched once with `apt-get download`, extracted and indexed
//!   with `depmod` under the tool cache.
//! - A small initramfs (Debian's static busybox, and the virtio/virtiofs/overlay modules the
//!   kernel has as modules) mounts this machine's `/` over virtiofs, read-only, under an overlay
//!   whose upper layer is guest memory: the guest never writes the host.
//! - The guest then runs a script xtask wrote next to the build output: it mounts proc, sys,
//!   bpffs, cgroup2, the kernel's modules, runs `meshpath-loader doctor` and the test binaries
//!   `cargo test` built, and prints marked result lines on the serial console, which this side
//!   reads. `/dev/kvm` is not usable on these machines: pure emulation (TCG), so everything in
//!   the guest waits for readiness and never for a fixed time.

use std::{
    fs,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use crate::bootstrap::{cache_dir, output, run};

/// The kernel series the matrix knows, oldest first. 6.1 is the floor CI boots on every run.
pub const SERIES: &[&str] = &["6.1", "6.12"];
/// The series `cargo xtask test` boots when not told otherwise.
pub const FLOOR: &str = "6.1";

/// The test binaries (cargo test targets of meshpath-tests) run inside every VM, with the
/// filters passed to each (empty: all of its tests). They need no second machine: capture
/// outbound, inbound and DNS, fail closed, mark spoofing, unenrol, the TC counters (TCX or its
/// netlink fallback), doctor, the decision counters and monitor (ring buffer), and the agent's
/// start through the real CNI chain.
///
/// In [`LANES`] lanes, each running its suites one after the other, one test at a time, beside
/// the other lane (the guest has two CPUs; one suite at a time left one idle while its tests
/// waited on emulated timers): the suites are dealt to the lanes by the time each took on
/// Debian's 6.1 under TCG in CI (seconds, 2026-12-05), longest first.
const GUEST_SUITES: &[(&str, &[&str], u32)] = &[
    ("decisions", &[], 182),
    ("outbound_capture", &[], 179),
    ("inbound_capture", &[], 156),
    ("raw_sockets", &[], 83),
    ("pod_counters", &[], 59),
    ("dns_capture", &[], 47),
    ("upgrades", &[], 43),
    (
        "shared_maps",
        &[
            "a_pod_holding_its_share_of_pending_connections",
            "a_pod_holding_its_share_of_unaccepted_transparent_connects",
            "a_pod_accepting_connections_at_another_pods_address",
        ],
        30,
    ),
    ("cni", &["a_meshed_pod_is_captured_from_its_first_connection"], 11),
    ("doctor", &[], 1),
];

/// How many suites run at once in the guest.
const LANES: usize = 2;

/// Deals the suites (longest first) to the lane with the least time so far.
fn lanes<T: Clone>(suites: &[(T, u32)]) -> Vec<Vec<T>> {
    let mut lanes: Vec<(u32, Vec<T>)> = vec![(0, Vec::new()); LANES];
    let mut by_time: Vec<&(T, u32)> = suites.iter().collect();
    by_time.sort_by_key(|(_, secs)| std::cmp::Reverse(*secs));
    for (suite, secs) in by_time {
        if let Some(lane) = lanes.iter_mut().min_by_key(|(total, _)| *total) {
            lane.0 += secs;
            lane.1.push(suite.clone());
        }
    }
    lanes.into_iter().map(|(_, l)| l).collect()
}

/// A lane's console lines start with this and its number, then `| `.
const LANE_PREFIX: &str = "lane ";

/// How long one VM may run before it is stopped and reported as failed.
const VM_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// How long a boot may go without the guest's first line before it is stopped and tried again,
/// and how many boots. Under TCG a boot has hung before the guest printed anything (seen once:
/// 22 minutes of silence after the firmware's banner; the same kernel, initrd and script then
/// booted three times in a row, the first line within seconds).
const BOOT_TIMEOUT: Duration = Duration::from_secs(5 * 60);
const BOOT_ATTEMPTS: usize = 2;

/// Marks on the guest's console lines that this side reads.
const MARK: &str = "MESHPATH-VM";

/// A kernel fetched, extracted and ready to boot.
pub struct Kernel {
    /// The release string (`uname -r`), e.g. `6.1.0-57-cloud-amd64`.
    release: String,
    /// The extracted package: `boot/vmlinuz-<release>`, `lib/modules/<release>`.
    root: PathBuf,
}

impl Kernel {
    fn vmlinuz(&self) -> PathBuf {
        self.root.join("boot").join(format!("vmlinuz-{}", self.release))
    }
    fn modules(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.release)
    }
    fn initrd(&self) -> PathBuf {
        self.root.join("initrd.gz")
    }
}

/// The newest `linux-image-<series>.*-cloud-amd64-unsigned` package the repositories offer.
fn package_for(series: &str) -> Result<String> {
    let find = || -> Result<Option<String>> {
        let names = output("apt-cache", &["pkgnames", &format!("linux-image-{series}.")])?;
        let mut found: Vec<&str> =
            names.lines().filter(|n| n.ends_with("-cloud-amd64-unsigned")).collect();
        found.sort_by_key(|n| version_key(n));
        Ok(found.last().map(|s| (*s).to_owned()))
    };
    if let Some(p) = find()? {
        return Ok(p);
    }
    run(Command::new("apt-get").args(["update", "-qq"]).stdout(Stdio::null()))
        .context("apt-get update failed")?;
    find()?.with_context(|| {
        format!(
            "no linux-image-{series}.*-cloud-amd64-unsigned package in the configured Debian \
             repositories (apt-cache pkgnames linux-image-{series}.)"
        )
    })
}

/// Every run of digits in `s`, as numbers: orders `6.1.0-9` before `6.1.0-57`.
fn version_key(s: &str) -> Vec<u64> {
    s.split(|c: char| !c.is_ascii_digit()).filter_map(|d| d.parse().ok()).collect()
}

/// Fetches, extracts, indexes and wraps (initramfs) the kernel of `series`, once.
pub fn ensure_kernel(series: &str) -> Result<Kernel> {
    let package = package_for(series)?;
    let release = package
        .strip_prefix("linux-image-")
        .and_then(|r| r.strip_suffix("-unsigned"))
        .context("kernel package name")?
        .to_owned();
    let root = cache_dir().join("kernels").join(&release);
    let kernel = Kernel { release, root };
    if kernel.initrd().exists() {
        return Ok(kernel);
    }
    println!("vm: fetching {package} (once; cached in {})", kernel.root.display());
    let work = cache_dir().join("kernels").join(format!(".{}.partial", kernel.release));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    run(Command::new("apt-get").arg("download").arg(&package).current_dir(&work))
        .with_context(|| format!("apt-get download {package}"))?;
    let deb = fs::read_dir(&work)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .context("apt-get download left no .deb")?;
    let tree = work.join("root");
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tree))?;
    // The package's postinst would run depmod; the guest's modprobe needs its index.
    run(Command::new("depmod").arg("-b").arg(&tree).arg(&kernel.release))?;
    let staged = Kernel { release: kernel.release.clone(), root: tree.clone() };
    build_initrd(&staged, &work.join("initrd"))?;
    let _ = fs::remove_file(&deb);
    let _ = fs::remove_dir_all(&kernel.root);
    fs::rename(&tree, &kernel.root)
        .with_context(|| format!("moving the kernel into {}", kernel.root.display()))?;
    let _ = fs::remove_dir_all(&work);
    Ok(kernel)
}

/// Modules the initramfs loads (with what they depend on) to mount the host share; any the
/// kernel has built in is simply absent from modules.dep.
const INITRD_MODULES: &[&str] = &["virtio_pci", "virtiofs", "overlay"];

/// The initramfs's `/init`: mounts the host's `/` (virtiofs tag `host`) read-only under an
/// overlay kept in guest memory, then hands over to the script named by `mprun=` on the
/// kernel command line.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /lower /upper /newroot
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in /mods/*.ko; do insmod "$m"; done
fail() { echo "MESHPATH-VM-FAIL $*"; echo o > /proc/sysrq-trigger; poweroff -f; }
mount -t virtiofs -o ro host /lower || fail "mounting the host share (virtiofs) failed"
mount -t tmpfs -o size=75% upper /upper
mkdir -p /upper/u /upper/w
mount -t overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w overlay /newroot \
  || fail "mounting the overlay root failed"
for d in proc sys dev; do mount --move /$d /newroot/$d; done
exec switch_root /newroot /bin/sh "$mprun"
"#;

fn build_initrd(kernel: &Kernel, dir: &Path) -> Result<()> {
    let mods = dir.join("mods");
    fs::create_dir_all(dir.join("bin"))?;
    fs::create_dir_all(&mods)?;
    fs::copy("/bin/busybox", dir.join("bin/busybox"))
        .context("copying /bin/busybox (Debian's busybox-static)")?;
    let deps = fs::read_to_string(kernel.modules().join("modules.dep"))?;
    for (i, module) in load_order(&deps, INITRD_MODULES).iter().enumerate() {
        let src = kernel.modules().join(module);
        let name = Path::new(module)
            .file_name()
            .and_then(|n| n.to_str())
            .context("module name")?
            .trim_end_matches(".xz");
        let dst = mods.join(format!("{i:02}-{name}"));
        if module.ends_with(".xz") {
            let out = Command::new("xz").arg("-dc").arg(&src).output().context("running xz")?;
            if !out.status.success() {
                bail!("xz -dc {} failed", src.display());
            }
            fs::write(&dst, out.stdout)?;
        } else {
            fs::copy(&src, &dst).with_context(|| format!("copying {}", src.display()))?;
        }
    }
    let init = dir.join("init");
    fs::write(&init, INIT)?;
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(&init, fs::Permissions::from_mode(0o755))?;
    run(Command::new("sh")
        .arg("-c")
        .arg("find . | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1 > ../initrd.gz")
        .current_dir(dir))
    .context("packing the initramfs")?;
    fs::rename(dir.parent().context("initrd dir")?.join("initrd.gz"), kernel.initrd())?;
    Ok(())
}

/// The modules.dep paths to insmod, dependencies first, each once. modules.dep lists a module's
/// dependencies so that loading them right to left works (as modprobe does).
fn load_order(deps: &str, wanted: &[&str]) -> Vec<String> {
    let entry = |name: &str| {
        deps.lines().find_map(|l| {
            let (module, rest) = l.split_once(':')?;
            let file = module.rsplit('/').next()?;
            let stem = file.split(".ko").next()?;
            (stem == name || stem.replace('-', "_") == name).then(|| {
                (module.to_owned(), rest.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            })
        })
    };
    let mut order: Vec<String> = Vec::new();
    for name in wanted {
        let Some((module, needs)) = entry(name) else { continue };
        for dep in needs.iter().rev().chain(std::iter::once(&module)) {
            if !order.contains(dep) {
                order.push(dep.clone());
            }
        }
    }
    order
}

/// What one VM run reported.
pub struct Outcome {
    pub release: String,
    /// The guest's harness output, read as on the host.
    pub tests: crate::cargo::Totals,
    /// Suites whose binary exited non-zero (or never reported).
    pub failed_suites: Vec<String>,
}

/// The guest script: mounts what the tests need, runs doctor and each suite, reports, powers off.
fn guest_script(kernel: &Kernel, loader: &Path, suites: &[((String, &[&str]), u32)]) -> String {
    let workspace = crate::cargo::workspace_root();
    let modules = kernel.modules();
    let mut s = format!(
        r#"#!/bin/sh
# Written by `cargo xtask test --kernel …` (xtask/src/vm.rs); runs as the guest's PID 1.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
export MESHPATH_LOADER={loader} RUST_BACKTRACE=1
export {previous_var}={previous}
# Writes anywhere land in the overlay's upper layer (guest memory). The host's named network
# namespaces must not show; a fresh /tmp keeps the host's leftovers out, unless the workspace
# is under /tmp (a CI clone there was hidden by it).
mkdir -p /run/netns && mount -t tmpfs tmpfs /run/netns
mount -t bpf bpf /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mkdir -p /lib/modules/{release}
mount --bind {modules} /lib/modules/{release}
case {workspace}/ in /tmp/*) ;; *) mount -t tmpfs tmpfs /tmp ;; esac
ip link set lo up
cd {workspace} || {{ echo "{MARK}-FAIL the workspace {workspace} is not visible in the guest"; echo o > /proc/sysrq-trigger; }}
echo "{MARK}-KERNEL $(uname -r)"
echo "{MARK}: meshpath-loader doctor"
{loader} doctor
echo "{MARK}-DOCTOR $?"
"#,
        loader = loader.display(),
        previous_var = crate::previous::BIN_DIR_VAR,
        previous = std::env::var(crate::previous::BIN_DIR_VAR).unwrap_or_default(),
        release = kernel.release,
        modules = modules.display(),
        workspace = workspace.display(),
    );
    // Each lane in the background, its lines prefixed (GNU sed, unbuffered) so that this side
    // reads each lane's test output apart.
    for (i, lane) in lanes(suites).into_iter().enumerate() {
        s.push_str("(\n");
        for (bin, filters) in lane {
            let name = Path::new(&bin).file_name().and_then(|n| n.to_str()).unwrap_or("?");
            let name = name.rsplit_once('-').map_or(name, |(n, _)| n);
            s.push_str(&format!(
                "echo \"{MARK}: {name}\"\n{bin} --test-threads=1 {filters} 2>&1\necho \"{MARK}-SUITE {name} $?\"\n",
                filters = filters.join(" "),
            ));
        }
        s.push_str(&format!(") 2>&1 | sed -u 's/^/{LANE_PREFIX}{i}| /' &\n"));
    }
    s.push_str(&format!("wait\necho \"{MARK}-DONE\"\necho o > /proc/sysrq-trigger\npoweroff -f\n"));
    s
}

/// A child process killed (and reaped) when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Boots `series` and runs the capture suites in it. `test_bins` maps cargo test target names
/// to the executables `cargo test --no-run` built.
pub fn run_matrix_entry(
    series: &str,
    bin_dir: &Path,
    test_bins: &[(String, PathBuf)],
) -> Result<Outcome> {
    let kernel = ensure_kernel(series)?;
    let mut suites: Vec<((String, &[&str]), u32)> = Vec::new();
    for (target, filters, secs) in GUEST_SUITES {
        let exe = test_bins
            .iter()
            .find(|(t, _)| t == target)
            .map(|(_, p)| p)
            .with_context(|| format!("cargo test built no `{target}` test binary"))?;
        suites.push(((exe.display().to_string(), filters), *secs));
    }
    let vm_dir = crate::cargo::target_dir().join("vm").join(&kernel.release);
    fs::create_dir_all(&vm_dir)?;
    let script = vm_dir.join("run.sh");
    fs::write(&script, guest_script(&kernel, &bin_dir.join("meshpath-loader"), &suites))?;
    for attempt in 1..=BOOT_ATTEMPTS {
        match boot(series, &kernel, &vm_dir, &script)? {
            Boot::Ran(out) => return Ok(out),
            Boot::Silent => println!(
                "vm: the {} guest printed nothing for {BOOT_TIMEOUT:?} (boot {attempt} of {BOOT_ATTEMPTS}): stopped",
                kernel.release
            ),
        }
    }
    bail!("the {} guest never started in {BOOT_ATTEMPTS} boots", kernel.release)
}

/// How one boot went.
enum Boot {
    /// The guest started and ran (or was stopped at [`VM_TIMEOUT`]): what it reported.
    Ran(Outcome),
    /// Nothing from the guest for [`BOOT_TIMEOUT`].
    Silent,
}

/// Boots the guest once with `script` as its program and reads its console.
fn boot(series: &str, kernel: &Kernel, vm_dir: &Path, script: &Path) -> Result<Boot> {
    let sock = vm_dir.join("virtiofs.sock");
    let _ = fs::remove_file(&sock);
    // sandbox=chroot: the default pivot_root sandbox fails inside a container ("pivot_root(.,
    // .): Device or resource busy").
    let _virtiofsd = Reaped(
        Command::new("/usr/lib/qemu/virtiofsd")
            .arg(format!("--socket-path={}", sock.display()))
            .args(["-o", "source=/", "-o", "cache=always", "-o", "sandbox=chroot"])
            .stdout(Stdio::null())
            .stderr(fs::File::create(vm_dir.join("virtiofsd.log"))?)
            .spawn()
            .context("starting /usr/lib/qemu/virtiofsd (Debian's qemu-system-common)")?,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sock.exists() {
        if Instant::now() > deadline {
            bail!("virtiofsd made no socket at {} (see virtiofsd.log)", sock.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    let mem = "3G";
    println!("vm: booting {} under QEMU (TCG) and running the capture tests in it", kernel.release);
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args(["-accel", "tcg,thread=multi", "-cpu", "max", "-smp", "2", "-m", mem])
        .args(["-object", &format!("memory-backend-memfd,id=mem,size={mem},share=on")])
        .args(["-numa", "node,memdev=mem"])
        .arg("-kernel")
        .arg(kernel.vmlinuz())
        .arg("-initrd")
        .arg(kernel.initrd())
        .args(["-append", &format!("console=ttyS0 quiet panic=-1 mprun={}", script.display())])
        .args(["-nographic", "-no-reboot", "-nic", "none"])
        .args(["-chardev", &format!("socket,id=vfs,path={}", sock.display())])
        .args(["-device", "vhost-user-fs-pci,chardev=vfs,tag=host"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = Reaped(qemu.spawn().context("starting qemu-system-x86_64")?);
    let stdout = child.0.stdout.take().context("qemu stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });

    let mut out = Outcome {
        release: kernel.release.clone(),
        tests: crate::cargo::Totals::default(),
        failed_suites: Vec::new(),
    };
    // Each lane's libtest output read on its own (a reader keeps state across lines).
    let mut lane_tests = vec![crate::cargo::Totals::default(); LANES];
    let mut reported: Vec<String> = Vec::new();
    let (mut done, mut started) = (false, false);
    let booting = Instant::now() + BOOT_TIMEOUT;
    let deadline = Instant::now() + VM_TIMEOUT;
    loop {
        let until = if started { deadline } else { booting.min(deadline) };
        match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                let line = strip_escapes(&line);
                println!("[{series}] {line}");
                let (lane, line) = split_lane(&line);
                started |= line.starts_with(MARK);
                match lane.and_then(|i| lane_tests.get_mut(i)) {
                    Some(tests) => tests.read(line),
                    None => out.tests.read(line),
                }
                if let Some(rest) = line.strip_prefix(&format!("{MARK}-SUITE ")) {
                    let (name, rc) = rest.rsplit_once(' ').unwrap_or((rest, "?"));
                    reported.push(name.to_owned());
                    if rc != "0" {
                        out.failed_suites.push(name.to_owned());
                    }
                } else if let Some(why) = line.strip_prefix(&format!("{MARK}-FAIL ")) {
                    bail!("the {} guest failed to start: {why}", kernel.release);
                } else if line == format!("{MARK}-DONE") {
                    done = true;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) if !started => return Ok(Boot::Silent),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                out.failed_suites.push(format!("(VM stopped after {VM_TIMEOUT:?})"));
                break;
            }
        }
    }
    for tests in lane_tests {
        out.tests.merge(tests);
    }
    for (target, _, _) in GUEST_SUITES {
        if !reported.iter().any(|r| r == target) {
            out.failed_suites.push(format!("{target} (never reported)"));
        }
    }
    if !done && out.failed_suites.is_empty() {
        out.failed_suites.push("(the guest stopped before its last line)".into());
    }
    Ok(Boot::Ran(out))
}

/// A console line's lane (its `lane N| ` prefix) and the line without it.
fn split_lane(line: &str) -> (Option<usize>, &str) {
    line.strip_prefix(LANE_PREFIX)
        .and_then(|rest| rest.split_once("| "))
        .and_then(|(n, rest)| Some((n.parse().ok()?, rest)))
        .map_or((None, line), |(n, rest)| (Some(n), rest))
}

/// The console carries the firmware's terminal escapes; keep the text.
fn strip_escapes(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        if c != '\r' && (c == '\t' || !c.is_control()) {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{lanes, load_order, split_lane, strip_escapes, version_key};

    #[test]
    fn modules_load_dependencies_first_and_once() {
        let deps = "kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko\n\
                    kernel/drivers/virtio/virtio_ring.ko:\n\
                    kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio_pci_legacy_dev.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
                    kernel/fs/fuse/virtiofs.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko kernel/fs/fuse/fuse.ko\n";
        let order = load_order(deps, &["virtio_pci", "virtiofs", "overlay"]);
        let short: Vec<&str> =
            order.iter().map(|m| m.rsplit('/').next().unwrap_or_default()).collect();
        assert_eq!(
            short,
            [
                "virtio_ring.ko",
                "virtio.ko",
                "virtio_pci_legacy_dev.ko",
                "virtio_pci.ko",
                "fuse.ko",
                "virtiofs.ko"
            ]
        );
    }

    #[test]
    fn kernel_packages_order_by_number_not_text() {
        assert!(
            version_key("linux-image-6.1.0-57-cloud") > version_key("linux-image-6.1.0-9-cloud")
        );
    }

    #[test]
    fn suites_are_dealt_to_lanes_longest_first_by_time() {
        let suites = [("a", 100), ("b", 90), ("c", 60), ("d", 40), ("e", 5)];
        assert_eq!(lanes(&suites), vec![vec!["a", "d", "e"], vec!["b", "c"]]);
    }

    #[test]
    fn a_lanes_lines_are_read_apart() {
        assert_eq!(split_lane("lane 1| test result: ok."), (Some(1), "test result: ok."));
        assert_eq!(split_lane("MESHPATH-VM-DONE"), (None, "MESHPATH-VM-DONE"));
        assert_eq!(split_lane("lane x| y"), (None, "lane x| y"));
    }

    #[test]
    fn console_escapes_are_stripped() {
        assert_eq!(strip_escapes("\u{1b}[?7l\u{1b}[2JLinux 6.1\r"), "Linux 6.1");
    }
}
