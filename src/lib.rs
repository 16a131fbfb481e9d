//! superoffload: CPU Adam for offloaded optimizer state, with speculative sub-group steps,
//! behind a stable C ABI.
//!
//! Layers, each depending only on the ones before it: [`kernels`] (math, instruction-set
//! paths, thread pool), [`session`] (speculation logic, transport-agnostic), [`cuda`]
//! (the CUDA transport) and [`ffi`] (the C surface only).

#![deny(unsafe_op_in_unsafe_fn)]
// Module docs name the private modules that hold each part, for maintainers reading the
// private docs (`cargo doc --document-private-items`), where those links resolve.
#![allow(rustdoc::private_intra_doc_links)]

pub mod cuda;
pub mod error;
pub mod ffi;
pub mod kernels;
pub mod session;
