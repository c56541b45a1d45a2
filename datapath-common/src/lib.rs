//! Facts shared by meshpath's eBPF programs and its userspace: map keys and values
//! (`#[repr(C)]`, laid out identically on both sides), map and program names, ports, marks and
//! pin paths. This is the only place any of them is defined.
//!
//! `no_std` so the eBPF crate can use it; the `user` feature implements [`aya::Pod`] so userspace
//! can read and write the same types through aya's typed maps.

#![no_std]

pub mod consts;
pub mod decisions;
pub mod maps;

pub use maps::*;
