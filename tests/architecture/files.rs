//! File lengths, and ARCHITECTURE.md naming the files as they are.

use std::collections::BTreeSet;
use std::path::Path;

use crate::sources::*;

pub(crate) const MAX_LINES: usize = 650;

/// Files over [`MAX_LINES`] not yet split (issue 43).
pub(crate) const KNOWN_LONG: &[&str] = &[];

/// Where the repository's hand-written sources are, relative to its root.
const TREES: &[&str] =
    &["build.rs", "bench", "c_tests", "demo", "examples", "include", "libtorch", "python", "scripts", "src", "tests"];

const EXTENSIONS: &[&str] = &["rs", "py", "c", "cc", "cpp", "h", "hpp", "sh"];

/// Not written by hand: the header cbindgen generates (a bless test checks it) and the copy of
/// `include/` the Python package build makes.
const GENERATED: &[&str] = &["include/superoffload.h", "python/superoffload/include"];

/// Directories of fixtures (`c_tests/old_header/`: the previous release's header), build
/// outputs, virtual environments and tools' state, at any depth.
fn skipped_dir(name: &str) -> bool {
    name.starts_with('.')
        || name.starts_with("build")
        || name.contains("venv")
        || matches!(name, "fixtures" | "old_header" | "target" | "out" | "dist" | "__pycache__")
}

/// The repository's hand-written source files, in every language, with their line counts
/// (`src/` alone is what the other tests read, through [`source_files`]).
fn repository_sources() -> Vec<(String, usize)> {
    fn walk(root: &Path, rel: &str, out: &mut Vec<(String, usize)>) {
        let path = root.join(rel);
        if path.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap() {
                let name = entry.unwrap().file_name().to_string_lossy().into_owned();
                let child = format!("{rel}/{name}");
                let skipped = GENERATED.contains(&child.as_str()) || (path.join(&name).is_dir() && skipped_dir(&name));
                if !skipped {
                    walk(root, &child, out);
                }
            }
        } else if path.extension().is_some_and(|e| EXTENSIONS.iter().any(|x| e == *x)) {
            let text = std::fs::read(&path).unwrap();
            out.push((rel.to_owned(), String::from_utf8_lossy(&text).lines().count()));
        }
    }
    let mut out = Vec::new();
    for tree in TREES {
        walk(&root(), tree, &mut out);
    }
    out.sort();
    out
}

#[test]
fn no_source_file_is_too_long() {
    let lengths = repository_sources();
    let long: Vec<String> = lengths
        .iter()
        .filter(|(rel, lines)| *lines > MAX_LINES && !KNOWN_LONG.contains(&rel.as_str()))
        .map(|(rel, lines)| format!("{rel}: {lines} lines"))
        .collect();
    assert!(long.is_empty(), "source files over {MAX_LINES} lines (split them along a seam):\n  {}", long.join("\n  "));
    let split: Vec<&String> = lengths
        .iter()
        .filter(|(rel, lines)| KNOWN_LONG.contains(&rel.as_str()) && *lines <= MAX_LINES)
        .map(|(rel, _)| rel)
        .collect();
    assert!(split.is_empty(), "files listed in KNOWN_LONG are short now; take them off the list: {split:?}");
}

/// The backquoted names in ARCHITECTURE.md that end in `.rs` or `/`: files and directories.
pub(crate) fn architecture_names() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| (s.ends_with(".rs") || s.ends_with('/')) && !s.contains(' '))
        .map(str::to_owned)
        .collect()
}

#[test]
fn architecture_names_only_files_that_exist() {
    let files: Vec<String> = source_files().into_iter().map(|f| f.rel).collect();
    let missing: Vec<String> = architecture_names()
        .into_iter()
        .filter(|name| {
            let name = name.trim_start_matches("src/");
            !files.iter().any(|f| f.ends_with(&format!("/{name}")) || f.contains(&format!("/{name}")))
        })
        .filter(|name| !root().join(name).exists())
        .collect();
    assert!(missing.is_empty(), "ARCHITECTURE.md names files that do not exist: {missing:?}");
}

#[test]
fn architecture_names_every_file() {
    // A file is named by a path that ends in it (`finalize.rs`, `cuda/ptx.rs`); a `mod.rs`
    // by its directory (`session/`).
    let names = architecture_names();
    let named = |rel: &str| {
        let rel = rel.trim_start_matches("src/");
        let wanted = match rel.strip_suffix("mod.rs") {
            Some(dir) => dir.to_owned(),
            None => rel.to_owned(),
        };
        names.iter().any(|name| {
            let name = name.trim_start_matches("src/");
            wanted == name || wanted.ends_with(&format!("/{name}"))
        })
    };
    let unnamed: Vec<String> = source_files().into_iter().map(|f| f.rel).filter(|rel| !named(rel)).collect();
    assert!(unnamed.is_empty(), "ARCHITECTURE.md does not name these files of src/: {unnamed:?}");
}
