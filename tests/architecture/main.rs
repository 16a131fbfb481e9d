//! The shape of `src/`, read from the sources: the module graph has no cycle, no struct's
//! restricted fields are read from another file, no file grows past a reader's patience,
//! ARCHITECTURE.md names the files as they are, and a C ABI value type's fields are
//! documented once, on the C struct.
//!
//! A module is a file (`mod.rs` stands for its directory). Its dependencies are the paths
//! it names through `crate::`, `super::`, `self::` or a child module, in `use` declarations
//! and in code; a name a module only re-exports (`pub use`, or a `use` its children reach
//! through `super::`) leads on to the module that defines it. Unit tests (`#[cfg(test)]`
//! modules) are left out: they may reach across the layers they test.

mod abi_docs;
mod fields;
mod files;
mod graph;
mod sources;
