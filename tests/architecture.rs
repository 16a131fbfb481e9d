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

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 650;

/// Cycles not yet taken apart, each as the sorted names of its modules (issue 43). The test
/// fails on any other, and on one listed here that is gone.
const KNOWN_CYCLES: &[&[&str]] = &[];

/// Structs whose `pub(crate)` or `pub(super)` fields other files may read: values whose fields
/// are what they say (a measured budget), changed only by their own file's methods.
const RECORDS: &[&str] = &["AutoBudget"];

/// Files over [`MAX_LINES`] not yet split (issue 43).
const KNOWN_LONG: &[&str] = &[];

type ModPath = Vec<String>;

struct SourceFile {
    rel: String,
    module: ModPath,
    text: String,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn source_files() -> Vec<SourceFile> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
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

fn name(module: &[String]) -> String {
    if module.is_empty() { "crate".to_owned() } else { module.join("::") }
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Punct(char),
    PathSep,
}

/// Identifiers and punctuation, without comments, strings and character literals.
fn tokens(text: &str) -> Vec<Tok> {
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
fn raw_string_end(c: &[char], mut i: usize) -> Option<usize> {
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

/// One path a file names: its segments as written, the inline modules around it, and
/// whether it is a top-level `use` (which brings a name into the module's scope).
struct Named {
    segments: Vec<String>,
    inline: Vec<String>,
    alias: Option<String>,
    top_level_use: bool,
}

fn ident(t: Option<&Tok>) -> Option<&str> {
    match t {
        Some(Tok::Ident(s)) => Some(s),
        _ => None,
    }
}

/// Expands the use tree at `toks[*i]` into paths (with the name each brings into scope).
fn use_tree(toks: &[Tok], i: &mut usize, prefix: &[String], out: &mut Vec<(Vec<String>, Option<String>)>) {
    let mut path = prefix.to_vec();
    loop {
        match toks.get(*i) {
            Some(Tok::Punct('{')) => {
                *i += 1;
                while !matches!(toks.get(*i), Some(Tok::Punct('}')) | None) {
                    use_tree(toks, i, &path, out);
                    if toks.get(*i) == Some(&Tok::Punct(',')) {
                        *i += 1;
                    }
                }
                *i += 1;
                return;
            }
            Some(Tok::Punct('*')) => {
                *i += 1;
                path.push("*".to_owned());
                out.push((path, None));
                return;
            }
            Some(Tok::Ident(s)) if s == "self" && !path.is_empty() => {
                *i += 1;
                let alias = path.last().cloned();
                out.push((path, alias));
                return;
            }
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                *i += 1;
                if toks.get(*i) == Some(&Tok::PathSep) {
                    *i += 1;
                    continue;
                }
                let alias = if ident(toks.get(*i)) == Some("as") {
                    *i += 2;
                    ident(toks.get(*i - 1)).map(str::to_owned)
                } else {
                    path.last().cloned()
                };
                out.push((path, alias));
                return;
            }
            Some(Tok::PathSep) => *i += 1,
            _ => return,
        }
    }
}

/// Every path in `toks` that starts at `crate`, `super` or `self`, or at a name in scope
/// (resolved later: a child module, or a name a `use` brought in).
fn named_paths(toks: &[Tok]) -> Vec<Named> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    // The inline modules (`mod name { ... }`) open around the current token, with their depth
    // and whether they are unit tests (`#[cfg(test)]`), whose paths are left out.
    let mut inline: Vec<(String, usize, bool)> = Vec::new();
    let cfg_test = [Tok::Punct('#'), Tok::Punct('['), Tok::Ident("cfg".into()), Tok::Punct('(')];
    let mut i = 0;
    while i < toks.len() {
        match &toks[i] {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth -= 1;
                if inline.last().is_some_and(|(_, d, _)| *d == depth) {
                    inline.pop();
                }
            }
            Tok::Ident(kw) if kw == "mod" => {
                if let (Some(name), Some(Tok::Punct('{'))) = (ident(toks.get(i + 1)), toks.get(i + 2)) {
                    let test = i >= 7 && toks[i - 7..i - 3] == cfg_test && ident(toks.get(i - 3)) == Some("test");
                    inline.push((name.to_owned(), depth, test));
                }
            }
            Tok::Ident(kw) if kw == "use" && toks.get(i + 1) != Some(&Tok::PathSep) => {
                let top_level = depth == inline.last().map_or(0, |(_, d, _)| d + 1);
                let mut j = i + 1;
                let mut trees = Vec::new();
                use_tree(toks, &mut j, &[], &mut trees);
                for (segments, alias) in trees {
                    if in_test(&inline) {
                        continue;
                    }
                    let inline = inline.iter().map(|(n, _, _)| n.clone()).collect();
                    out.push(Named { segments, inline, alias, top_level_use: top_level });
                }
                i = j;
                continue;
            }
            Tok::Ident(first) if toks.get(i + 1) == Some(&Tok::PathSep) && (i == 0 || toks[i - 1] != Tok::PathSep) => {
                let mut segments = vec![first.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::PathSep) {
                    match ident(toks.get(j + 1)) {
                        Some(s) => segments.push(s.to_owned()),
                        None => break,
                    }
                    j += 2;
                }
                if !in_test(&inline) {
                    let inline = inline.iter().map(|(n, _, _)| n.clone()).collect();
                    out.push(Named { segments, inline, alias: None, top_level_use: false });
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

fn in_test(inline: &[(String, usize, bool)]) -> bool {
    inline.iter().any(|(_, _, test)| *test)
}

struct Crate {
    modules: BTreeSet<ModPath>,
    /// Per module, the names its top-level `use`s bring into scope, as absolute paths.
    scope: BTreeMap<ModPath, BTreeMap<String, Vec<String>>>,
}

impl Crate {
    /// The absolute path of `segments` as written in `module` inside `inline`, or `None` for
    /// a path outside the crate (or a name this reader cannot place).
    fn absolute(&self, module: &ModPath, inline: &[String], segments: &[String]) -> Option<Vec<String>> {
        let mut here: Vec<String> = module.iter().chain(inline).cloned().collect();
        let mut rest = segments;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                here.clear();
                rest = &rest[1..];
            }
            Some("super" | "self") => {
                while let Some(s) = rest.first().map(String::as_str) {
                    match s {
                        "super" => {
                            here.pop()?;
                        }
                        "self" => {}
                        _ => break,
                    }
                    rest = &rest[1..];
                }
            }
            Some(first) => {
                let child: ModPath = module.iter().cloned().chain([first.to_owned()]).collect();
                if inline.is_empty() && self.modules.contains(&child) {
                    here = module.clone();
                } else if inline.is_empty()
                    && let Some(target) = self.scope.get(module).and_then(|s| s.get(first))
                {
                    return Some(target.iter().chain(&rest[1..]).cloned().collect());
                } else {
                    return None;
                }
            }
            None => return None,
        }
        Some(here.into_iter().chain(rest.iter().cloned()).collect())
    }

    /// The file module that defines what `path` (absolute) names.
    fn defining_module(&self, path: &[String], hops: usize) -> Option<ModPath> {
        let mut module: ModPath = Vec::new();
        let mut rest = path;
        while let Some(seg) = rest.first() {
            let child: ModPath = module.iter().chain([seg]).cloned().collect();
            if !self.modules.contains(&child) {
                break;
            }
            module = child;
            rest = &rest[1..];
        }
        if let Some(item) = rest.first()
            && hops < 8
            && let Some(target) = self.scope.get(&module).and_then(|s| s.get(item))
        {
            let onward: Vec<String> = target.iter().chain(&rest[1..]).cloned().collect();
            return self.defining_module(&onward, hops + 1);
        }
        Some(module)
    }
}

fn module_graph(files: &[SourceFile]) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let modules: BTreeSet<ModPath> = files.iter().map(|f| f.module.clone()).collect();
    let named: Vec<Vec<Named>> = files.iter().map(|f| named_paths(&tokens(&f.text))).collect();
    let mut krate = Crate { modules, scope: BTreeMap::new() };
    // Scopes first, in as many rounds as a re-export may take to reach its definition.
    for _ in 0..4 {
        for (file, paths) in files.iter().zip(&named) {
            for n in paths.iter().filter(|n| n.top_level_use && n.inline.is_empty()) {
                if let (Some(alias), Some(abs)) = (&n.alias, krate.absolute(&file.module, &n.inline, &n.segments)) {
                    krate.scope.entry(file.module.clone()).or_default().insert(alias.clone(), abs);
                }
            }
        }
    }
    let mut graph: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (file, paths) in files.iter().zip(&named) {
        let edges = graph.entry(file.module.clone()).or_default();
        for n in paths {
            let Some(abs) = krate.absolute(&file.module, &n.inline, &n.segments) else { continue };
            let Some(target) = krate.defining_module(&abs, 0) else { continue };
            if target != file.module {
                edges.insert(target);
            }
        }
    }
    graph
}

/// The strongly connected components of more than one module (Tarjan).
fn cycles(graph: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    struct State<'g> {
        graph: &'g BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<&'g ModPath, usize>,
        low: BTreeMap<&'g ModPath, usize>,
        stack: Vec<&'g ModPath>,
        on_stack: BTreeSet<&'g ModPath>,
        found: Vec<Vec<ModPath>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g ModPath) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.graph.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on_stack.remove(w);
                component.push(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.found
}

/// One cycle through the component, as `a -> b -> ... -> a`.
fn describe(graph: &BTreeMap<ModPath, BTreeSet<ModPath>>, component: &[ModPath]) -> String {
    let members: BTreeSet<&ModPath> = component.iter().collect();
    let start = &component[0];
    // Breadth-first from the start's successors back to the start, inside the component.
    let mut previous: BTreeMap<&ModPath, &ModPath> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for w in graph[v].iter().filter(|w| members.contains(w)) {
            if w == start {
                let mut path = vec![name(start)];
                let mut at = v;
                while at != start {
                    path.push(name(at));
                    at = previous[at];
                }
                path[1..].reverse();
                path.push(name(start));
                let members: Vec<String> = component.iter().map(|m| name(m)).collect();
                return format!("{} (all of {})", path.join(" -> "), members.join(", "));
            }
            if !previous.contains_key(w) {
                previous.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    unreachable!("a strongly connected component has a cycle through each member")
}

#[test]
fn the_module_graph_has_no_cycle() {
    let files = source_files();
    let graph = module_graph(&files);
    let known: BTreeSet<Vec<String>> =
        KNOWN_CYCLES.iter().map(|c| c.iter().map(|s| (*s).to_owned()).collect()).collect();
    let mut unexpected = Vec::new();
    let mut seen = BTreeSet::new();
    for component in cycles(&graph) {
        let names: Vec<String> = component.iter().map(|m| name(m)).collect();
        if !known.contains(&names) {
            unexpected.push(describe(&graph, &component));
        }
        seen.insert(names);
    }
    let gone: Vec<_> = known.difference(&seen).collect();
    assert!(unexpected.is_empty(), "import cycles among the modules of src/:\n  {}", unexpected.join("\n  "));
    assert!(gone.is_empty(), "cycles listed in KNOWN_CYCLES are gone; take them off the list: {gone:?}");
}

#[test]
fn the_reader_sees_the_imports() {
    // The kernels' loops reach the lane vocabulary, and a child reaches a name its parent
    // re-exports at the module that defines it.
    let graph = module_graph(&source_files());
    let edges = |m: &str| graph[&m.split("::").map(str::to_owned).collect::<ModPath>()].clone();
    let kernels_driver = edges("kernels::driver");
    assert!(kernels_driver.contains(&vec!["kernels".to_owned(), "lanes".to_owned()]), "{kernels_driver:?}");
    let cuda_transport = edges("cuda::transport");
    assert!(cuda_transport.contains(&vec!["session".to_owned(), "transport".to_owned()]), "{cuda_transport:?}");
}

/// The tokens of a file outside its unit-test modules (`#[cfg(test)] mod name { ... }`).
fn non_test_tokens(text: &str) -> Vec<Tok> {
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

/// How far a field is visible beyond its struct's file.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Reach {
    /// Private, or `pub` (then its struct's own visibility bounds it: a record's field).
    Unrestricted,
    /// `pub(super)`: the parent module and everything beneath it.
    Parent,
    /// `pub(crate)`.
    Crate,
}

/// The named-field structs of `toks`: each struct's name and its fields, with how far each
/// is visible as `pub(super)` or `pub(crate)` makes it.
fn struct_fields(toks: &[Tok]) -> Vec<(String, Vec<(String, Reach)>)> {
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
fn architecture_names() -> BTreeSet<String> {
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

/// A struct's doc comment and its named fields, each with whether a doc comment precedes it.
struct DocumentedStruct {
    file: String,
    doc: String,
    fields: Vec<(String, bool)>,
}

/// The named-field structs declared in `text`, by name, read line by line as rustfmt lays
/// them out: doc lines (`///`, `#[doc`) and attributes before a `struct Name {` line or a
/// `name: Type` line at the body's own depth.
fn documented_structs(file: &str, text: &str) -> Vec<(String, DocumentedStruct)> {
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
fn abi_struct_pairs(toks: &[Tok]) -> Vec<(String, String)> {
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
fn duplicated_field_docs(files: &[(String, String)]) -> Vec<String> {
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
