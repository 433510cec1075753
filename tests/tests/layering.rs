//! Layering: no circle of imports between two folders of a crate, through any chain of imports.
//!
//! Every `src/` of the workspace is read as text. A node is a folder (at any depth, with the
//! file of the same name beside it: `live.rs` belongs to `live/`) or a file directly in `src/`.
//! An edge is a path a file names: `crate::…`, `super::…`, `self::…`, or a child module the
//! file declares, in `use` trees and in code; it leads to the deepest folder the path walks
//! into, or to the file in `src/` it starts with (an item the crate root re-exports, to the
//! module it comes from). Crate roots (`lib.rs`, `main.rs`) and test code (`tests.rs`
//! modules, inline `#[cfg(test)]` modules) are no layer and are left out. A circle through
//! two folders or more fails the test; circles of files inside one folder, or through one
//! folder and files directly in `src/`, are left to that folder's own design.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The workspace root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace root")
        .to_path_buf()
}

/// Every `src/` folder of the workspace.
fn source_roots(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root.join("crates")).expect("crates/ exists") {
        let src = entry.expect("a crates entry").path().join("src");
        if src.is_dir() {
            out.push(src);
        }
    }
    for other in ["proto", "tests", "xtask"] {
        let src = root.join(other).join("src");
        if src.is_dir() {
            out.push(src);
        }
    }
    out.sort();
    out
}

/// The `.rs` files below `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("read a folder") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The module path of a file below `src` (`http/vllm.rs` → `[http, vllm]`, `http/mod.rs` →
/// `[http]`, `lib.rs` → `[]`).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("a file below src");
    let mut segs: Vec<String> = rel
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let last = segs.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    let at_root = segs.is_empty();
    if !(stem == "mod" || (at_root && (stem == "lib" || stem == "main"))) {
        segs.push(stem.to_owned());
    }
    segs
}

/// A node: `folder:a/b` or `file:x` (a file directly in `src/`, by module name); `None` for
/// the crate root itself (`lib.rs`, `main.rs`: it declares and re-exports, it is no layer).
fn node_of(src: &Path, module: &[String]) -> Option<String> {
    let mut dir = src.to_path_buf();
    let mut depth = 0;
    for seg in module {
        if dir.join(seg).is_dir() {
            dir = dir.join(seg);
            depth += 1;
        } else {
            break;
        }
    }
    if depth > 0 {
        return Some(format!("folder:{}", module[..depth].join("/")));
    }
    let first = module.first()?;
    src.join(format!("{first}.rs"))
        .is_file()
        .then(|| format!("file:{first}"))
}

/// What the crate roots of `src` re-export, by name: `pub use a::b::Item;` → `Item` → `[a, b]`.
fn root_reexports(src: &Path) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for root_file in ["lib.rs", "main.rs"] {
        let Ok(text) = std::fs::read_to_string(src.join(root_file)) else {
            continue;
        };
        let code = code_lines(&text).join("\n");
        let mut rest = code.as_str();
        while let Some(i) = rest.find("pub use ") {
            let after = &rest[i + 8..];
            let end = after.find(';').unwrap_or(after.len());
            let tree: String = after[..end]
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            for path in expand_use(&tree.replace(" as ", "@")) {
                let (path, alias) = match path.split_once('@') {
                    Some((p, a)) => (p.to_owned(), Some(a.to_owned())),
                    None => (path, None),
                };
                let segs: Vec<String> = path
                    .split("::")
                    .filter(|s| !s.is_empty() && *s != "crate" && *s != "self")
                    .map(str::to_owned)
                    .collect();
                if let Some((item, module)) = segs.split_last() {
                    out.insert(alias.unwrap_or_else(|| item.clone()), module.to_vec());
                }
            }
            rest = &after[end..];
        }
    }
    out
}

/// Whether `c` may be part of a Rust identifier.
fn ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths a `use` tree names (`a::{b, c::{d, e}}` → `a::b`, `a::c::d`, `a::c::e`).
fn expand_use(tree: &str) -> Vec<String> {
    // `Item as Alias` names `Item` (re-exports read the alias themselves).
    let tree: String = tree
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace(" as ", "@");
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let mut out = Vec::new();
    expand_into("", &tree, &mut out);
    out
}

fn expand_into(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let Some(open) = tree.find('{') else {
        out.push(format!("{prefix}{tree}"));
        return;
    };
    let head = &tree[..open];
    let inner = tree[open + 1..]
        .strip_suffix('}')
        .unwrap_or(&tree[open + 1..]);
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                expand_into(&format!("{prefix}{head}"), &inner[start..i], out);
                start = i + 1;
            }
            _ => {}
        }
    }
    if start < inner.len() {
        expand_into(&format!("{prefix}{head}"), &inner[start..], out);
    }
}

/// A path as a module path from the crate root, resolved from `module` (the naming file's
/// module) and `children` (the modules the file declares); `None` for another crate's path.
fn resolve(
    path: &str,
    module: &[String],
    children: &BTreeSet<String>,
    reexports: &BTreeMap<String, Vec<String>>,
) -> Option<Vec<String>> {
    let path = path.split('@').next().unwrap_or(path);
    let segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    let first = *segs.first()?;
    let (mut base, rest): (Vec<String>, &[&str]) = match first {
        "crate" => (Vec::new(), &segs[1..]),
        "self" => (module.to_vec(), &segs[1..]),
        "super" => {
            let mut base = module.to_vec();
            let mut i = 0;
            while segs.get(i) == Some(&"super") {
                base.pop();
                i += 1;
            }
            (base, &segs[i..])
        }
        name if children.contains(name) => (module.to_vec(), &segs[..]),
        _ => return None,
    };
    base.extend(
        rest.iter()
            .filter(|s| s.chars().all(ident_char) && **s != "*")
            .map(|s| (*s).to_owned()),
    );
    // An item the crate root re-exports stands for the module it comes from.
    if let [first, ..] = base.as_slice()
        && let Some(from) = reexports.get(first)
    {
        return Some(from.clone());
    }
    Some(base)
}

/// Code without comments (line comments and `//!`/`///` docs dropped; block comments are not
/// used in this workspace's sources).
fn code_lines(text: &str) -> Vec<&str> {
    text.lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect()
}

/// The paths one file names: whole `use` trees and the `crate::`/`super::`/`self::` paths in
/// its code.
fn named_paths(text: &str) -> (Vec<String>, BTreeSet<String>) {
    let lines = code_lines(text);
    let mut children = BTreeSet::new();
    for l in &lines {
        let t = l.trim();
        let t = t.strip_prefix("pub ").unwrap_or(t);
        let t = t
            .strip_prefix("pub(crate) ")
            .or_else(|| t.strip_prefix("pub(super) "))
            .unwrap_or(t);
        if let Some(name) = t.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
            children.insert(name.trim().to_owned());
        }
    }
    let code = lines.join("\n");
    let mut paths = Vec::new();
    // `use` trees, possibly over several lines.
    let mut rest = code.as_str();
    while let Some(i) = rest.find("use ") {
        let before = rest[..i].chars().next_back();
        let after = &rest[i + 4..];
        if before.is_some_and(ident_char) {
            rest = after;
            continue;
        }
        let end = after.find(';').unwrap_or(after.len());
        paths.extend(expand_use(&after[..end]));
        rest = &after[end..];
    }
    // Paths in code.
    for anchor in ["crate::", "super::", "self::"] {
        let mut rest = code.as_str();
        while let Some(i) = rest.find(anchor) {
            let before = rest[..i].chars().next_back();
            let tail = &rest[i..];
            let len = tail
                .char_indices()
                .find(|(_, c)| !(ident_char(*c) || *c == ':'))
                .map_or(tail.len(), |(j, _)| j);
            if !before.is_some_and(ident_char) {
                paths.push(tail[..len].to_owned());
            }
            rest = &tail[anchor.len()..];
        }
    }
    (paths, children)
}

/// Edges between nodes of one `src/`: (from, to) → an example `file: path`.
fn edges(src: &Path) -> BTreeMap<(String, String), String> {
    let reexports = root_reexports(src);
    let mut out = BTreeMap::new();
    for file in rust_files(src) {
        let text = std::fs::read_to_string(&file).expect("read a source file");
        let module = module_of(src, &file);
        let Some(from) = node_of(src, &module) else {
            continue;
        };
        // Test code is no layer: a `tests.rs` module, and a file's inline `#[cfg(test)]`
        // module, are left out.
        if module.last().is_some_and(|m| m == "tests") {
            continue;
        }
        let (code, _tests) = split_inline_tests(&text);
        let (paths, children) = named_paths(code);
        for path in paths {
            let Some(target) = resolve(&path, &module, &children, &reexports) else {
                continue;
            };
            let Some(to) = node_of(src, &target) else {
                continue;
            };
            if to != from {
                let name = file.strip_prefix(src).unwrap_or(&file).display();
                out.entry((from.clone(), to))
                    .or_insert_with(|| format!("{name}: {path}"));
            }
        }
    }
    out
}

/// A file's code before its inline test module, and that module's name and body (test
/// modules come last in this workspace's files).
fn split_inline_tests(text: &str) -> (&str, Option<(String, &str)>) {
    let mut offset = 0;
    let mut cfg_test = false;
    for line in text.split_inclusive('\n') {
        let t = line.trim();
        if cfg_test && let Some(name) = t.strip_prefix("mod ").and_then(|r| r.strip_suffix('{')) {
            let body = &text[offset + line.len()..];
            return (&text[..offset], Some((name.trim().to_owned(), body)));
        }
        cfg_test = t == "#[cfg(test)]";
        offset += line.len();
    }
    (text, None)
}

/// Circles between folders: each strongly connected set of nodes that holds two folders or
/// more, with the edges inside it.
fn folder_circles(edges: &BTreeMap<(String, String), String>) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.keys().flat_map(|(a, b)| [a, b]).collect();
    let reach = |start: &String| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![start.clone()];
        while let Some(n) = stack.pop() {
            for (a, b) in edges.keys() {
                if *a == n && seen.insert(b.clone()) {
                    stack.push(b.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> =
        nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut circles = Vec::new();
    for n in &nodes {
        if done.contains(*n) {
            continue;
        }
        let set: BTreeSet<&String> = nodes
            .iter()
            .copied()
            .filter(|m| reached[n].contains(*m) && reached[m].contains(*n))
            .collect();
        done.extend(set.iter().map(|m| (*m).clone()));
        if set.iter().filter(|m| m.starts_with("folder:")).count() > 1 {
            circles.push(
                edges
                    .iter()
                    .filter(|((a, b), _)| set.contains(a) && set.contains(b))
                    .map(|((a, b), why)| format!("{a} -> {b} ({why})"))
                    .collect(),
            );
        }
    }
    circles
}

#[test]
fn no_circle_of_imports_between_folders() {
    let root = root();
    let mut found = Vec::new();
    for src in source_roots(&root) {
        for circle in folder_circles(&edges(&src)) {
            let at = src
                .strip_prefix(&root)
                .unwrap_or(&src)
                .display()
                .to_string();
            found.push(format!("{at}:\n    {}", circle.join("\n    ")));
        }
    }
    assert!(
        found.is_empty(),
        "circles of imports between folders:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_checker_finds_a_circle_between_folders() {
    let dir = std::env::temp_dir().join(format!("kvc-layering-{}", std::process::id()));
    let src = dir.join("src");
    let write = |rel: &str, text: &str| {
        let path = src.join(rel);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("create a folder");
        std::fs::write(path, text).expect("write a file");
    };
    // `net/` uses `store/`; `store/` names `net/` back through a child-of-parent path; the
    // files directly in `src/` import each other, which is not a folder's circle.
    write(
        "lib.rs",
        "mod a;\nmod b;\nmod c;\nmod cache;\nmod net;\nmod store;\n",
    );
    write("a.rs", "use crate::b::Thing;\n");
    write("b.rs", "use super::a::Other;\n");
    write(
        "net/mod.rs",
        "mod conn;\nuse crate::store::{disk::Disk, Table};\n",
    );
    write("net/conn.rs", "pub struct Conn;\n");
    write("store/mod.rs", "pub mod disk;\n");
    write(
        "store/disk.rs",
        "fn f() { let _ = crate::net::conn::Conn; }\n",
    );
    // One folder and a file beside it: not a circle between folders.
    write("cache/mod.rs", "use crate::c::Limit;\n");
    write("c.rs", "use crate::cache::Entry;\n");
    let e = edges(&src);
    let circles = folder_circles(&e);
    std::fs::remove_dir_all(&dir).expect("remove the scratch folder");
    assert!(e.contains_key(&("file:a".to_owned(), "file:b".to_owned())));
    assert!(e.contains_key(&("file:b".to_owned(), "file:a".to_owned())));
    assert!(e.contains_key(&("folder:cache".to_owned(), "file:c".to_owned())));
    assert!(e.contains_key(&("file:c".to_owned(), "folder:cache".to_owned())));
    assert_eq!(circles.len(), 1, "{circles:?}");
    assert_eq!(
        circles[0],
        [
            "folder:net -> folder:store (net/mod.rs: crate::store::disk::Disk)",
            "folder:store -> folder:net (store/disk.rs: crate::net::conn::Conn)",
        ]
    );
    assert_eq!(
        expand_use("crate::{a::X, b::{Y, z::W}}"),
        ["crate::a::X", "crate::b::Y", "crate::b::z::W"]
    );
}
