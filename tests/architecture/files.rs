//! File lengths, and ARCHITECTURE.md naming the files as they are.

use std::collections::BTreeSet;

use crate::sources::*;

pub(crate) const MAX_LINES: usize = 650;

/// Files over [`MAX_LINES`] not yet split (issue 43).
pub(crate) const KNOWN_LONG: &[&str] = &[];

#[test]
fn no_source_file_is_too_long() {
    let lengths: Vec<(String, usize)> = source_files().into_iter().map(|f| (f.rel, f.text.lines().count())).collect();
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
