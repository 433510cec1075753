//! Tidy checks: the documentation names only things that exist.
//!
//! `ARCHITECTURE.md`, `README.md`, the documents under `docs/`, the crates' READMEs and every
//! module doc (`//!`) of the workspace name files, folders and Rust paths in backticks and link
//! to files. Each such name must still exist, and the policy tables must list every policy
//! `kvc-policy` knows. A rename that forgets a document fails here instead of misleading the
//! next reader.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The workspace root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace root")
        .to_path_buf()
}

/// Top-level folders whose paths a document may name, relative to the workspace root.
const ROOTS: &[&str] = &[
    "crates/",
    "docs/",
    "proto/",
    "scripts/",
    "profiles/",
    "tests/",
    "xtask/",
    ".ci/",
];

/// One name a document uses, and where.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Mention {
    /// The document (workspace-relative) and its 1-based line.
    at: String,
    /// The name as written.
    name: String,
}

/// Backticked spans of one line (inline code), without the backticks.
fn code_spans(line: &str) -> Vec<&str> {
    line.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s)
        .collect()
}

/// Targets of Markdown links `[text](target)` in one line.
fn link_targets(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        if let Some(end) = rest.find(')') {
            out.push(&rest[..end]);
            rest = &rest[end..];
        }
    }
    out
}

/// A backticked span read as a workspace path, if it is one: it starts with a known top-level
/// folder and holds no placeholders, globs, spaces or options.
fn as_repo_path(span: &str) -> Option<&str> {
    let span = span.trim_end_matches(['.', ',', ':']);
    let is_path = ROOTS.iter().any(|r| span.starts_with(r))
        && !span.contains(['*', '<', '>', '{', '}', ' ', '$', '…'])
        && !span.contains("...");
    is_path.then_some(span)
}

/// A backticked span read as a Rust path into a workspace crate (`kvc_replay::sim::replay`).
fn as_rust_path(span: &str) -> Option<Vec<&str>> {
    let span = span.trim_end_matches("()");
    let segs: Vec<&str> = span.split("::").collect();
    let ok = segs.len() >= 2
        && segs[0].starts_with("kvc_")
        && segs
            .iter()
            .all(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    ok.then_some(segs)
}

/// The source folder of a workspace crate named as in Rust (`kvc_core`), if it exists.
fn crate_src(root: &Path, krate: &str) -> Option<PathBuf> {
    let dir = krate.replace('_', "-");
    [
        root.join("crates").join(&dir).join("src"),
        root.join(dir.trim_start_matches("kvc-")).join("src"),
    ]
    .into_iter()
    .find(|p| p.is_dir())
}

/// Whether `ident` is declared somewhere in the crate's sources (module, item or re-export).
fn declared_in(src: &Path, ident: &str) -> bool {
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read a source folder") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n == ident) {
                    return true;
                }
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                if path.file_stem().is_some_and(|n| n == ident) {
                    return true;
                }
                let text = std::fs::read_to_string(&path).expect("read a source file");
                let words = [
                    "mod",
                    "fn",
                    "struct",
                    "enum",
                    "trait",
                    "type",
                    "const",
                    "static",
                    "macro_rules!",
                ];
                if words.iter().any(|w| text.contains(&format!("{w} {ident}")))
                    || text.contains(&format!("{ident},")) && text.contains("pub use")
                {
                    return true;
                }
            }
        }
    }
    false
}

/// Whether a file named `name` (e.g. `retry.rs`) or folder (`workers/`) sits anywhere under
/// `src` (a code-map row may name a file inside a module folder it named before).
fn module_file_exists(src: &Path, name: &str) -> bool {
    let name = name.trim_end_matches('/');
    let leaf = Path::new(name);
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.ends_with(leaf) {
                return true;
            }
            if path.is_dir() {
                stack.push(path);
            }
        }
    }
    false
}

/// Every problem found in one document's text: names that do not resolve.
/// `doc` is the document's workspace-relative path (links resolve against its folder).
fn check_text(root: &Path, doc: &str, text: &str) -> Vec<Mention> {
    let mut missing = Vec::new();
    let doc_dir = Path::new(doc).parent().unwrap_or(Path::new(""));
    // The crate a source file belongs to (`crates/kvc-admission`), for crate-relative paths.
    let crate_dir = doc
        .strip_prefix("crates/")
        .and_then(|rest| rest.split('/').next())
        .map(|name| format!("crates/{name}"));
    let crate_dir = crate_dir.as_deref();
    let mut in_fence = false;
    for (n, line) in text.lines().enumerate() {
        let at = format!("{doc}:{}", n + 1);
        if line
            .trim_start()
            .trim_start_matches("//!")
            .trim()
            .starts_with("```")
        {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        // Paths written without backticks count too ("the bands of docs/topic.md").
        let bare = line
            .split(|c: char| c.is_whitespace() || c == '`' || c == '(' || c == ')')
            .filter(|w| w.contains('/') && w.trim_end_matches(['.', ',', ':', ';']).contains('.'));
        let spans: BTreeSet<&str> = code_spans(line).into_iter().chain(bare).collect();
        // A code-map row (`| \`crates/kvc-router\` | …`) names its crate's files relative to it.
        let row_crate = line
            .strip_prefix("| `")
            .and_then(|l| l.split('`').next())
            .filter(|p| p.starts_with("crates/") || *p == "proto/")
            .map(|p| p.trim_end_matches('/'));
        for span in &spans {
            if let Some(krate) = row_crate
                && as_repo_path(span).is_none()
                && (span.ends_with(".rs") || span.ends_with('/'))
                && !span.contains(['*', ' ', ':', '<'])
            {
                let found = [
                    root.join(krate).join("src").join(span),
                    root.join(krate).join(span),
                ]
                .iter()
                .any(|p| p.exists())
                    || module_file_exists(&root.join(krate).join("src"), span);
                if !found {
                    missing.push(Mention {
                        at: at.clone(),
                        name: span.to_string(),
                    });
                }
            }
        }
        for span in spans {
            if let Some(p) = as_repo_path(span) {
                // A crate's docs may name its own files relative to the crate (`tests/loom.rs`).
                let in_crate = crate_dir.is_some_and(|c| root.join(c).join(p).exists());
                if !root.join(p).exists() && !in_crate {
                    missing.push(Mention {
                        at: at.clone(),
                        name: p.to_string(),
                    });
                }
            } else if let Some(segs) = as_rust_path(span) {
                match crate_src(root, segs[0]) {
                    None => missing.push(Mention {
                        at: at.clone(),
                        name: span.to_string(),
                    }),
                    Some(src) => {
                        // Module and item segments must be declared in the crate; stop at the
                        // first capitalised segment's members (methods, variants).
                        for seg in &segs[1..] {
                            if !declared_in(&src, seg) {
                                missing.push(Mention {
                                    at: at.clone(),
                                    name: span.to_string(),
                                });
                                break;
                            }
                            if seg.starts_with(char::is_uppercase) {
                                break;
                            }
                        }
                    }
                }
            }
        }
        for target in link_targets(line) {
            let target = target.split('#').next().unwrap_or("");
            // Rust intra-doc links (`crate::Item`, `Type::method`) are rustdoc's to check.
            let file_like = target.contains('/') || target.contains('.');
            if target.is_empty() || target.contains("://") || target.contains("::") || !file_like {
                continue;
            }
            if !root.join(doc_dir).join(target).exists() {
                missing.push(Mention {
                    at: at.clone(),
                    name: target.to_string(),
                });
            }
        }
    }
    // A name both linked and written out on one line is one problem.
    let mut seen = BTreeSet::new();
    missing.retain(|m| seen.insert(m.clone()));
    missing
}

/// The module docs (`//!` lines) of a Rust file, line numbers kept (other lines blank).
fn module_doc(text: &str) -> String {
    text.lines()
        .map(|l| l.trim_start().strip_prefix("//!").unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every Rust source file of the workspace's crates (not `target/`).
fn rust_sources(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = ["crates", "proto", "tests", "xtask"]
        .iter()
        .map(|d| root.join(d))
        .filter(|p| p.is_dir())
        .collect();
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read a folder") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "target") {
                    stack.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn rel(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn documents_name_only_what_exists() {
    let root = root();
    let mut missing = Vec::new();
    let mut docs = vec![root.join("ARCHITECTURE.md"), root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).expect("docs/ exists") {
        let path = entry.expect("a docs entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            docs.push(path);
        }
    }
    // The READMEs of the published crates.
    for entry in std::fs::read_dir(root.join("crates")).expect("crates/ exists") {
        let readme = entry.expect("a crates entry").path().join("README.md");
        if readme.is_file() {
            docs.push(readme);
        }
    }
    for doc in &docs {
        let text = std::fs::read_to_string(doc).expect("read a document");
        missing.extend(check_text(&root, &rel(&root, doc), &text));
    }
    for src in rust_sources(&root) {
        let text = std::fs::read_to_string(&src).expect("read a source file");
        missing.extend(check_text(&root, &rel(&root, &src), &module_doc(&text)));
    }
    assert!(
        missing.is_empty(),
        "documents name what does not exist:\n{}",
        missing
            .iter()
            .map(|m| format!("  {}: `{}`", m.at, m.name))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Policy names listed in a Markdown table's first column (`| \`name\` | … |`).
fn table_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .map(|l| l.trim_start().trim_start_matches("//!").trim())
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_string)
        .collect()
}

#[test]
fn every_policy_is_in_the_policy_tables() {
    let root = root();
    let names: BTreeSet<String> = kvc_policy::PolicyConfig::all_names()
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert!(
        names.contains("kvc"),
        "the default policy is known: {names:?}"
    );
    let lib = std::fs::read_to_string(root.join("crates/kvc-policy/src/lib.rs")).unwrap();
    let listed = table_names(&lib);
    let absent: Vec<_> = names.difference(&listed).collect();
    assert!(
        absent.is_empty(),
        "kvc-policy's policy table lacks {absent:?}"
    );
    let arch = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let absent: Vec<_> = names
        .iter()
        .filter(|n| !arch.contains(&format!("`{n}`")))
        .collect();
    assert!(
        absent.is_empty(),
        "ARCHITECTURE.md does not name {absent:?}"
    );
}

#[test]
fn the_checker_reports_what_is_missing() {
    let root = root();
    let row = "| `crates/kvc-replay` | `sim/` (`replay.rs`, `gone.rs`), `cli/` |";
    let missing = check_text(&root, "ARCHITECTURE.md", row);
    assert_eq!(
        missing.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(),
        ["gone.rs"],
        "a code-map row's files resolve inside its crate"
    );
    let text = "\
see `crates/kvc-core` and `crates/kvc-nothing/src/lib.rs`
and `kvc_core::names` but `kvc_core::no_such_module`, [calibration](docs/calibration.md),
[gone](docs/no-such.md), `cargo xtask test`, `docs/<topic>.md`
```
`crates/in-a-fence`
```";
    let missing = check_text(&root, "ARCHITECTURE.md", text);
    let names: Vec<&str> = missing.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "crates/kvc-nothing/src/lib.rs",
            "kvc_core::no_such_module",
            "docs/no-such.md"
        ]
    );
    assert_eq!(missing[0].at, "ARCHITECTURE.md:1");
    assert_eq!(missing[2].at, "ARCHITECTURE.md:3");
    let listed = table_names("| `kvc` | x |\n//! | `cache-aware` | y |\n| name | z |");
    assert_eq!(
        listed.into_iter().collect::<Vec<_>>(),
        ["cache-aware".to_string(), "kvc".to_string()]
    );
}
