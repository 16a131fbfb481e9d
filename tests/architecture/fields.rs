//! Restricted fields (`pub(super)`, `pub(crate)`) read only where they are declared.

use std::collections::BTreeSet;

use crate::sources::*;

/// Structs whose `pub(crate)` or `pub(super)` fields other files may read: values whose fields
/// are what they say (a measured budget), changed only by their own file's methods.
pub(crate) const RECORDS: &[&str] = &["AutoBudget"];

/// How far a field is visible beyond its struct's file.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Reach {
    /// Private, or `pub` (then its struct's own visibility bounds it: a record's field).
    Unrestricted,
    /// `pub(super)`: the parent module and everything beneath it.
    Parent,
    /// `pub(crate)`.
    Crate,
}

/// The named-field structs of `toks`: each struct's name and its fields, with how far each
/// is visible as `pub(super)` or `pub(crate)` makes it.
pub(crate) fn struct_fields(toks: &[Tok]) -> Vec<(String, Vec<(String, Reach)>)> {
    let mut out = Vec::new();
    for (i, t) in toks.iter().enumerate() {
        let (Tok::Ident(kw), Some(name)) = (t, ident(toks.get(i + 1))) else { continue };
        if kw != "struct" {
            continue;
        }
        // The body: the first `{` before any `(` or `;` (tuple and unit structs have none).
        let Some(open) = toks[i + 2..]
            .iter()
            .position(|t| matches!(t, Tok::Punct('{' | '(' | ';')))
            .map(|p| i + 2 + p)
            .filter(|&p| toks[p] == Tok::Punct('{'))
        else {
            continue;
        };
        let mut fields = Vec::new();
        let mut depth = 0;
        for j in open..toks.len() {
            match &toks[j] {
                Tok::Punct('{' | '(' | '[' | '<') => depth += 1,
                Tok::Punct('>') if toks[j - 1] == Tok::Punct('-') => {}
                Tok::Punct('}' | ')' | ']' | '>') => depth -= 1,
                // A field: a name followed by `:` at the body's own depth.
                Tok::Ident(field) if depth == 1 && toks.get(j + 1) == Some(&Tok::Punct(':')) => {
                    let restricted = j >= 4 && toks[j - 4] == Tok::Ident("pub".into());
                    let reach = match ident(toks.get(j - 2)) {
                        Some("super") if restricted => Reach::Parent,
                        Some("crate") if restricted => Reach::Crate,
                        _ => Reach::Unrestricted,
                    };
                    fields.push((field.clone(), reach));
                }
                _ => {}
            }
            if depth == 0 {
                break;
            }
        }
        out.push((name.to_owned(), fields));
    }
    out
}

/// A component's fields are its own file's: one declared `pub(crate)` or `pub(super)` must
/// not be read (or written) from another file, unless its struct is one of the [`RECORDS`].
///
/// The heuristic: a file within a field's reach reads struct `S`'s field `f` where it names
/// `S` and has `.f` not followed by `(` (a method) or `::` (a turbofish), and declares no
/// field `f` of its own (which `.f` could be as well). A file that reaches a field through a
/// value whose type it never names is missed; struct literals (`S { f: .. }`, named
/// arguments) are not reads.
#[test]
fn no_restricted_field_is_read_from_another_file() {
    let files: Vec<(String, ModPath, Vec<Tok>)> =
        source_files().into_iter().map(|f| (f.rel, f.module, non_test_tokens(&f.text))).collect();
    let mut reads = Vec::new();
    for (home, home_module, toks) in &files {
        let parent = &home_module[..home_module.len().saturating_sub(1)];
        for (name, fields) in struct_fields(toks) {
            if RECORDS.contains(&name.as_str()) {
                continue;
            }
            for (rel, module, other) in files.iter().filter(|(rel, _, _)| rel != home) {
                let restricted: BTreeSet<&str> = fields
                    .iter()
                    .filter(|(_, reach)| match reach {
                        Reach::Unrestricted => false,
                        Reach::Parent => module.starts_with(parent),
                        Reach::Crate => true,
                    })
                    .map(|(f, _)| f.as_str())
                    .collect();
                if restricted.is_empty() || !other.contains(&Tok::Ident(name.clone())) {
                    continue;
                }
                let own: BTreeSet<String> =
                    struct_fields(other).into_iter().flat_map(|(_, f)| f.into_iter().map(|(f, _)| f)).collect();
                for w in other.windows(4) {
                    let [before, Tok::Punct('.'), Tok::Ident(field), after] = w else { continue };
                    if *before != Tok::Punct('.')
                        && !matches!(after, Tok::Punct('(') | Tok::PathSep)
                        && restricted.contains(field.as_str())
                        && !own.contains(field)
                    {
                        reads.push(format!("{rel} reads {name}::{field} (declared in {home})"));
                    }
                }
            }
        }
    }
    reads.dedup();
    assert!(
        reads.is_empty(),
        "restricted fields read from another file (give the struct methods, or move the code into its file):\n  {}",
        reads.join("\n  ")
    );
}
