//! Empty on purpose: the programs are in the `meshpath-datapath` binary (src/main.rs). This
//! library exists so the loader can build-depend on the crate and be rebuilt when it changes.
#![no_std]
