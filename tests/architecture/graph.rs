//! The module graph, from the paths each file names: no cycle.

use std::collections::{BTreeMap, BTreeSet};

use crate::sources::*;

/// Cycles not yet taken apart, each as the sorted names of its modules (issue 43). The test
/// fails on any other, and on one listed here that is gone.
pub(crate) const KNOWN_CYCLES: &[&[&str]] = &[];

/// One path a file names: its segments as written, the inline modules around it, and
/// whether it is a top-level `use` (which brings a name into the module's scope).
pub(crate) struct Named {
    pub(crate) segments: Vec<String>,
    pub(crate) inline: Vec<String>,
    pub(crate) alias: Option<String>,
    pub(crate) top_level_use: bool,
}

/// Expands the use tree at `toks[*i]` into paths (with the name each brings into scope).
pub(crate) fn use_tree(toks: &[Tok], i: &mut usize, prefix: &[String], out: &mut Vec<(Vec<String>, Option<String>)>) {
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
pub(crate) fn named_paths(toks: &[Tok]) -> Vec<Named> {
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

pub(crate) fn in_test(inline: &[(String, usize, bool)]) -> bool {
    inline.iter().any(|(_, _, test)| *test)
}

pub(crate) struct Crate {
    pub(crate) modules: BTreeSet<ModPath>,
    /// Per module, the names its top-level `use`s bring into scope, as absolute paths.
    pub(crate) scope: BTreeMap<ModPath, BTreeMap<String, Vec<String>>>,
}

impl Crate {
    /// The absolute path of `segments` as written in `module` inside `inline`, or `None` for
    /// a path outside the crate (or a name this reader cannot place).
    pub(crate) fn absolute(&self, module: &ModPath, inline: &[String], segments: &[String]) -> Option<Vec<String>> {
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
    pub(crate) fn defining_module(&self, path: &[String], hops: usize) -> Option<ModPath> {
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

pub(crate) fn module_graph(files: &[SourceFile]) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
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
pub(crate) fn cycles(graph: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    struct State<'g> {
        graph: &'g BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<&'g ModPath, usize>,
        low: BTreeMap<&'g ModPath, usize>,
        stack: Vec<&'g ModPath>,
        on_stack: BTreeSet<&'g ModPath>,
        found: Vec<Vec<ModPath>>,
    }
    pub(crate) fn visit<'g>(s: &mut State<'g>, v: &'g ModPath) {
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
pub(crate) fn describe(graph: &BTreeMap<ModPath, BTreeSet<ModPath>>, component: &[ModPath]) -> String {
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
