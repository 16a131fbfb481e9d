//! The C surface, and nothing else: argument checks, handle casts, conversions between the
//! C structs and the core types, and the panic boundary around every exported function.
//! All behaviour lives in the layers below.
//!
//! One file per API noun, each holding its exports and the C structs only they take:
//! [`kernels`] (`so_adam_*`), [`pool`], [`session`] (a folder: the handle and its options,
//! groups, sub-groups, the step, checkpoints), [`tickets`], [`cuda`] (CUDA sessions, device
//! gradients, streams), [`xla`] (XLA FFI handlers over a host session) and [`version`]
//! (versions, status strings, the last error); the enums
//! are in [`types`]. The machinery they share: `boundary` (the panic boundary), `handle`
//! (opaque handle ⇄ the Rust value behind it), `args` (every check of a pointer, struct,
//! buffer, array or string argument) and `convert` (C struct and enum ⇄ core type,
//! generated from one field list).
//!
//! Conventions (see the header for the caller's side):
//! - every export is `#[unsafe(no_mangle)] pub extern "C"` and its body is
//!   `ffi_boundary!({ ... })`, a block returning `Result` of the export's value;
//! - every pointer is checked for NULL, every enum arrives as `uint32_t` and is validated;
//! - outputs are written only on success; on failure the thread's last error says why;
//! - every `unsafe` export says in a `# Safety` section what the caller guarantees, which is
//!   what the header documents for it.

#![allow(non_camel_case_types, reason = "the C names (so_session, so_dtype, ...) are the ABI")]

mod args;
mod boundary;
mod convert;
mod handle;

// In the order of the header (cbindgen follows it; rustfmt sorts only within a group).
pub mod types;

pub mod kernels;

pub mod pool;

pub mod session;

pub mod tickets;

pub mod cuda;

pub mod xla;

pub mod version;
