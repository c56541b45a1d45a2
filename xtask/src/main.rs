//! `cargo xtask`: the one entry point for building, testing, demonstrating and benchmarking
//! meshpath. It installs what a fresh machine lacks before it needs it (see bootstrap.rs).

mod bootstrap;

use std::{env, ffi::OsString, path::PathBuf, process::Command};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Build, test and run meshpath")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what this machine lacks (nightly rust-src, bpf-linker, Debian packages, bpffs).
    Setup,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Setup => {
            bootstrap::ensure(bootstrap::Needs { ebpf_toolchain: true, runtime: true })?;
        }
    }
    Ok(())
}
