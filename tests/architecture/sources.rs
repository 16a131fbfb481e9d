//! The sources as this test reads them: the files of `src/` with their module paths, and a
//! tokenizer that leaves out comments, strings and character literals.

use std::path::{Path, PathBuf};

pub(crate) type ModPath = Vec<String>;

pub(crate) struct SourceFile {
    pub(crate) rel: String,
    pub(crate) module: ModPath,
    pub(crate) text: String,
}

pub(crate) fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub(crate) fn source_files() -> Vec<SourceFile> {
    pub(crate) fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let src = root().join("src");
    let mut paths = Vec::new();
    walk(&src, &mut paths);
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let rel = path.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
            let mut module: ModPath = rel.trim_end_matches(".rs").split('/').map(str::to_owned).collect();
            if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                module.pop();
            }
            SourceFile { text: std::fs::read_to_string(&path).unwrap(), rel: format!("src/{rel}"), module }
        })
        .collect()
}

pub(crate) fn name(module: &[String]) -> String {
    if module.is_empty() { "crate".to_owned() } else { module.join("::") }
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tok {
    Ident(String),
    Punct(char),
    PathSep,
}

/// Identifiers and punctuation, without comments, strings and character literals.
pub(crate) fn tokens(text: &str) -> Vec<Tok> {
    let c: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == 'r' && matches!(c.get(i + 1), Some('"' | '#')) && raw_string_end(&c, i + 1).is_some() {
            i = raw_string_end(&c, i + 1).unwrap();
        } else if ch == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if ch == '\'' {
            // A character literal, or a lifetime (left as the identifier after it).
            if c.get(i + 1) == Some(&'\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
        } else if ch.is_alphanumeric() || ch == '_' || ch == '$' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '$') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            out.push(Tok::Ident(if word == "$crate" { "crate".to_owned() } else { word }));
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push(Tok::PathSep);
            i += 2;
        } else {
            if !ch.is_whitespace() {
                out.push(Tok::Punct(ch));
            }
            i += 1;
        }
    }
    out
}

/// Where a raw string starting with the `#`s or quote at `i` ends, if it is one.
pub(crate) fn raw_string_end(c: &[char], mut i: usize) -> Option<usize> {
    let mut hashes = 0;
    while c.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    if c.get(i) != Some(&'"') {
        return None;
    }
    i += 1;
    while i < c.len() {
        if c[i] == '"' && (1..=hashes).all(|k| c.get(i + k) == Some(&'#')) {
            return Some(i + 1 + hashes);
        }
        i += 1;
    }
    None
}

pub(crate) fn ident(t: Option<&Tok>) -> Option<&str> {
    match t {
        Some(Tok::Ident(s)) => Some(s),
        _ => None,
    }
}

/// The tokens of a file outside its unit-test modules (`#[cfg(test)] mod name { ... }`).
pub(crate) fn non_test_tokens(text: &str) -> Vec<Tok> {
    let toks = tokens(text);
    let cfg_test = [Tok::Punct('#'), Tok::Punct('['), Tok::Ident("cfg".into()), Tok::Punct('(')];
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let test_module = toks[i..].starts_with(&cfg_test)
            && ident(toks.get(i + 4)) == Some("test")
            && ident(toks.get(i + 7)) == Some("mod")
            && toks.get(i + 9) == Some(&Tok::Punct('{'));
        if !test_module {
            out.push(toks[i].clone());
            i += 1;
            continue;
        }
        let mut depth = 0;
        i += 9;
        while i < toks.len() {
            match toks[i] {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => depth -= 1,
                _ => {}
            }
            i += 1;
            if depth == 0 {
                break;
            }
        }
    }
    out
}
