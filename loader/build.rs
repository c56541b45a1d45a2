//! Compiles the eBPF crate with the nightly (via aya-build) and leaves the object in OUT_DIR,
//! from where src/datapath/mod.rs embeds it; and hands the crate the object's hash
//! (`MESHPATH_DATAPATH_VERSION`, src/datapath/upgrade.rs), computed here once rather than at
//! every open of the datapath (1.7 MB hashed each time cost a CNI ADD and DEL 3.5 ms).
use std::path::PathBuf;

use anyhow::Context as _;
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    let manifest_dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?);
    let root_dir = manifest_dir.join("..").join("datapath-ebpf");
    let root_dir = root_dir.to_str().context("non-UTF-8 path to datapath-ebpf")?;
    aya_build::build_ebpf(
        [Package { name: "datapath-ebpf", root_dir, ..Default::default() }],
        Toolchain::default(),
    )?;
    let out = PathBuf::from(std::env::var("OUT_DIR").context("OUT_DIR")?);
    let object = std::fs::read(out.join("meshpath-datapath")).context("the eBPF object")?;
    // FNV-1a, 64 bits; never 0, which the pins read as "no version".
    let hash = object
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
        .max(1);
    println!("cargo:rustc-env=MESHPATH_DATAPATH_VERSION={hash}");
    Ok(())
}
