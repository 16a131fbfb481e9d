//! Shared by the reliability tests (`session_fuzz`, `session_soak`, `checkpoint_crash`): an
//! adapter over the session's C API, a model of what the header says, a plain reference of
//! the optimizer state, and the fuzzer's operations and generator.
#![allow(dead_code)]
// The fuzzer drives the C ABI on purpose with raw pointers, NULLs and wrong lengths: every
// unsafe block here is one such call on a handle and buffers the adapter owns, and the
// checks after it are the point of the test, so a comment per block would repeat this one.
#![allow(clippy::undocumented_unsafe_blocks)]

pub mod api;
pub mod ckpt;
pub mod generate;
pub mod mem;
pub mod model;
pub mod ops;
pub mod reference;

/// A fresh directory for one test's files: under /dev/shm when it exists (no disk writes),
/// else the system's temporary directory.
pub fn scratch_dir(what: &str) -> std::path::PathBuf {
    let shm = std::path::Path::new("/dev/shm");
    let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
    let dir = base.join(format!("superoffload-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}
