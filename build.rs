//! Generates the C header (into OUT_DIR; `tests/header.rs` compares it with the committed
//! `include/superoffload.h`) and gives the shared library its SONAME.

use std::env;
use std::path::PathBuf;

fn main() {
    let major = env::var("CARGO_PKG_VERSION_MAJOR").unwrap();
    let minor = env::var("CARGO_PKG_VERSION_MINOR").unwrap();
    let patch = env::var("CARGO_PKG_VERSION_PATCH").unwrap();

    // Every 0.x minor release changes the ABI, so its SONAME carries the minor version too:
    // the dynamic loader then refuses a program built against another one. CMake's so_soname
    // (cmake/SuperOffloadHelpers.cmake) gives the same name; c_tests/build_symbols.c checks it.
    let soname =
        if major == "0" { format!("libsuperoffload.so.0.{minor}") } else { format!("libsuperoffload.so.{major}") };
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    }

    let abi = if major == "0" { minor.to_string() } else { format!("({major} << 16)") };
    let after_includes = format!(
        r#"
/** Version of the header, from Cargo.toml. */
#define SO_VERSION_MAJOR {major}
#define SO_VERSION_MINOR {minor}
#define SO_VERSION_PATCH {patch}
/** `(major << 16) | (minor << 8) | patch`. */
#define SO_VERSION_NUMBER ((SO_VERSION_MAJOR << 16) | (SO_VERSION_MINOR << 8) | SO_VERSION_PATCH)
/**
 * The ABI this header describes; compare with `so_abi_version()` at start-up.
 *
 * The `so_*_default()` functions return their struct by value at the size this library was
 * built with, which no `struct_size` check can catch: a program must be built against the
 * header of the library it runs with. The library's SONAME, {soname} (major.minor
 * while the major version is 0), makes the dynamic loader refuse any other.
 */
#define SO_ABI_VERSION {abi}

/** A CUDA stream: the same type as `cudaStream_t` and `CUstream` (no CUDA header needed). */
typedef struct CUstream_st *so_cuda_stream_t;

/** XLA's FFI call frame and error, as XLA's `xla/ffi/api/c_api.h` declares them (no XLA header
 *  needed): the `so_xla_*` handlers are `XLA_FFI_Handler`s. */
typedef struct XLA_FFI_CallFrame *so_xla_call_frame_t;
typedef struct XLA_FFI_Error *so_xla_error_t;

/** Marks functions whose status must be checked. */
#if defined(__GNUC__) || defined(__clang__)
#define SO_NODISCARD __attribute__((warn_unused_result))
#else
#define SO_NODISCARD
#endif
"#
    );

    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let mut config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    config.after_includes = Some(after_includes);
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("superoffload.h");
    cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen failed to generate the header")
        .write_to_file(&out);

    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=build.rs");
}
