//! A C ABI value type's fields documented once, on the C struct.

use std::collections::{BTreeMap, BTreeSet};

use crate::sources::*;

/// A struct's doc comment and its named fields, each with whether a doc comment precedes it.
pub(crate) struct DocumentedStruct {
    pub(crate) file: String,
    pub(crate) doc: String,
    pub(crate) fields: Vec<(String, bool)>,
}

/// The named-field structs declared in `text`, by name, read line by line as rustfmt lays
/// them out: doc lines (`///`, `#[doc`) and attributes before a `struct Name {` line or a
/// `name: Type` line at the body's own depth.
pub(crate) fn documented_structs(file: &str, text: &str) -> Vec<(String, DocumentedStruct)> {
    let mut out: Vec<(String, DocumentedStruct)> = Vec::new();
    let mut doc: Vec<&str> = Vec::new();
    // The struct whose body is open and the brace depth within it.
    let mut open: Option<usize> = None;
    let mut depth = 0i32;
    for line in text.lines() {
        let line = line.trim();
        if let Some(d) = line.strip_prefix("///") {
            doc.push(d.trim());
            continue;
        }
        if line.starts_with("#[doc") {
            doc.push(line);
            continue;
        }
        if line.starts_with("#[") {
            continue;
        }
        let code = line.split("//").next().unwrap_or("");
        if let Some(at) = open {
            if depth == 1
                && let Some((name, _)) = code.split_once(':')
            {
                let name = name.trim();
                let name = name.strip_prefix("pub(crate) ").or(name.strip_prefix("pub(super) ")).unwrap_or(name);
                let name = name.strip_prefix("pub ").unwrap_or(name);
                if !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_') {
                    out[at].1.fields.push((name.to_owned(), !doc.is_empty()));
                }
            }
            depth += code.matches(['{', '(', '[']).count() as i32 - code.matches(['}', ')', ']']).count() as i32;
            if depth <= 0 {
                open = None;
            }
        } else {
            let words: Vec<&str> = code.split_whitespace().collect();
            if let Some(k) = words.iter().position(|w| *w == "struct")
                && words.get(k + 2) == Some(&"{")
                && words[..k].iter().all(|w| w.starts_with("pub"))
            {
                let name = words[k + 1].to_owned();
                out.push((name, DocumentedStruct { file: file.to_owned(), doc: doc.join(" "), fields: Vec::new() }));
                open = Some(out.len() - 1);
                depth = 1;
            }
        }
        doc.clear();
    }
    out
}

/// The `(C struct, core struct)` pairs the `abi_struct!` invocations in `toks` declare.
pub(crate) fn abi_struct_pairs(toks: &[Tok]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (i, t) in toks.iter().enumerate() {
        if *t != Tok::Ident("abi_struct".into())
            || toks.get(i + 1) != Some(&Tok::Punct('!'))
            || !matches!(toks.get(i + 2), Some(Tok::Punct('(' | '{')))
        {
            continue;
        }
        // `so_x <=> Core`, `so_x => Core` or `so_x <= Core`: the names around the arrow.
        let Some(c) = ident(toks.get(i + 3)).filter(|c| !c.starts_with('$')) else { continue };
        let Some(core) = toks[i + 4..].iter().find_map(|t| ident(Some(t))) else { continue };
        out.push((c.to_owned(), core.to_owned()));
    }
    out
}

/// Where a core struct that an `abi_struct!` ties to a C struct documents a field the C
/// struct documents too, or does not name the C struct (whose docs are its fields' docs).
pub(crate) fn duplicated_field_docs(files: &[(String, String)]) -> Vec<String> {
    let mut structs: BTreeMap<String, Vec<DocumentedStruct>> = BTreeMap::new();
    let mut pairs = Vec::new();
    for (rel, text) in files {
        for (name, s) in documented_structs(rel, text) {
            structs.entry(name).or_default().push(s);
        }
        pairs.extend(abi_struct_pairs(&non_test_tokens(text)));
    }
    let mut problems = Vec::new();
    if pairs.is_empty() {
        problems.push("no abi_struct! invocation found: the reader no longer sees them".to_owned());
    }
    for (c, core) in pairs {
        let (Some([c_struct]), Some([core_struct])) =
            (structs.get(&c).map(Vec::as_slice), structs.get(&core).map(Vec::as_slice))
        else {
            problems.push(format!("abi_struct!({c} <-> {core}): each must be declared exactly once in src/"));
            continue;
        };
        let c_documented: BTreeSet<&str> =
            c_struct.fields.iter().filter(|(_, documented)| *documented).map(|(f, _)| f.as_str()).collect();
        for (field, documented) in &core_struct.fields {
            if *documented && c_documented.contains(field.as_str()) {
                problems.push(format!(
                    "{}: {core}::{field} has a doc comment; {c}::{field} ({}) documents it",
                    core_struct.file, c_struct.file
                ));
            }
        }
        if !core_struct.doc.contains(&format!("[`{c}`]")) {
            problems.push(format!(
                "{}: {core}'s doc does not link to [`{c}`], which documents its fields",
                core_struct.file
            ));
        }
    }
    problems
}

/// Each field of a C ABI value type is documented once, on the C struct (the header's
/// contract): the core struct its `abi_struct!` converts to links there instead of
/// rewording it (issue 43). A field of the core struct alone keeps its doc.
#[test]
fn abi_struct_fields_are_documented_once() {
    let files: Vec<(String, String)> = source_files().into_iter().map(|f| (f.rel, f.text)).collect();
    let problems = duplicated_field_docs(&files);
    assert!(
        problems.is_empty(),
        "field docs written twice (keep the C struct's, merged with anything better; the core struct \
         links to it and documents only what the C struct lacks):\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_field_doc_check_finds_a_duplicate() {
    let c = "/// C.\n#[repr(C)]\npub struct so_x {\n    /// `sizeof(so_x)`.\n    pub struct_size: usize,\n    \
             /// Learning rate.\n    pub lr: f64,\n    pub step: u64,\n}\nabi_struct!(so_x <=> X { lr, step });\n";
    let file = |core: &str| vec![("src/ffi/x.rs".to_owned(), c.to_owned()), ("src/x.rs".to_owned(), core.to_owned())];
    let once = "/// Fields as [`so_x`](crate::so_x) documents them.\n#[derive(Clone)]\npub struct X {\n    \
                pub lr: f64,\n    /// Not in C's docs.\n    pub step: u64,\n    /// Core only.\n    pub(crate) own: Vec<u8>,\n}\n";
    assert_eq!(duplicated_field_docs(&file(once)), Vec::<String>::new());
    let twice = once.replace("    pub lr: f64", "    /// The learning rate.\n    pub lr: f64");
    assert_eq!(
        duplicated_field_docs(&file(&twice)),
        ["src/x.rs: X::lr has a doc comment; so_x::lr (src/ffi/x.rs) documents it"]
    );
    let unlinked = once.replace("[`so_x`](crate::so_x)", "the C struct's");
    assert_eq!(
        duplicated_field_docs(&file(&unlinked)),
        ["src/x.rs: X's doc does not link to [`so_x`], which documents its fields"]
    );
}
