//! Compiles the eBPF crate with the nightly (via aya-build) and leaves the object in OUT_DIR,
//! from where src/datapath.rs embeds it.
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
    )
}
