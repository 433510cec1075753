//! The crates a router written elsewhere depends on, `kvc-core` and `kvc-policy`, stay
//! publishable as they are; every other crate of the workspace stays unpublishable.
//!
//! Offline and cheap: `cargo metadata` and `cargo package --list`, no build. `cargo xtask test`
//! runs `cargo publish --dry-run` on both (which builds the packaged crates) and their doc
//! build with warnings denied.

use serde_json::Value;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

/// The crates published on crates.io, in publishing order.
const PUBLISHED: &[&str] = &["kvc-core", "kvc-policy"];

/// The workspace root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace root")
        .to_path_buf()
}

/// `cargo ARGS` in the workspace root, offline; its standard output.
fn cargo(args: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_string());
    let out = Command::new(cargo)
        .args(args)
        .arg("--offline")
        .current_dir(root())
        .output()
        .expect("run cargo");
    assert!(
        out.status.success(),
        "cargo {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("cargo prints UTF-8")
}

/// The workspace's packages as `cargo metadata` describes them.
fn packages() -> Vec<Value> {
    let meta: Value = serde_json::from_str(&cargo(&[
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
        "--locked",
    ]))
    .expect("cargo metadata prints JSON");
    meta["packages"].as_array().expect("packages").clone()
}

fn text(p: &Value, field: &str) -> String {
    p[field].as_str().unwrap_or_default().to_string()
}

/// The folder of a package.
fn crate_dir(p: &Value) -> PathBuf {
    Path::new(p["manifest_path"].as_str().expect("a manifest path"))
        .parent()
        .expect("a manifest sits in its crate")
        .to_path_buf()
}

/// The problems that keep a package from being published as it is.
fn publish_problems(p: &Value, root_license: &[u8]) -> Vec<String> {
    let mut problems = Vec::new();
    let name = text(p, "name");
    // `publish`: null when any registry may take it, [] for `publish = false`.
    if !p["publish"].is_null() {
        problems.push(format!("{name}: `publish` forbids crates.io"));
    }
    for field in ["description", "repository", "documentation", "rust_version"] {
        if text(p, field).is_empty() {
            problems.push(format!("{name}: no `{field}`"));
        }
    }
    if text(p, "license") != "Apache-2.0" {
        problems.push(format!("{name}: license is not Apache-2.0"));
    }
    for field in ["keywords", "categories"] {
        let n = p[field].as_array().map_or(0, Vec::len);
        if !(1..=5).contains(&n) {
            problems.push(format!("{name}: {n} {field} (crates.io takes 1 to 5)"));
        }
    }
    let dir = crate_dir(p);
    if text(p, "readme") != "README.md" || !dir.join("README.md").is_file() {
        problems.push(format!("{name}: no README.md of its own"));
    }
    if std::fs::read(dir.join("LICENSE")).ok().as_deref() != Some(root_license) {
        problems.push(format!("{name}: LICENSE is not a copy of the root's"));
    }
    // Every dependency on a workspace crate names a version (a path alone is dropped from the
    // package, or fails it) and a crate that is published too.
    for dep in p["dependencies"].as_array().into_iter().flatten() {
        if dep["path"].is_null() {
            continue;
        }
        let dep_name = text(dep, "name");
        let kind = dep["kind"].as_str().unwrap_or("normal");
        if text(dep, "req") == "*" {
            problems.push(format!(
                "{name}: {kind} dependency {dep_name} has no version"
            ));
        }
        if !PUBLISHED.contains(&dep_name.as_str()) {
            problems.push(format!(
                "{name}: {kind} dependency {dep_name} is not published"
            ));
        }
    }
    problems
}

/// Files a crate's sources pull in at compile time (`include_str!`, `include_bytes!`,
/// `#[path]`) from outside the crate: the package would not compile.
fn includes_from_outside(dir: &Path) -> Vec<String> {
    let mut outside = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("read a folder") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let source = std::fs::read_to_string(&path).expect("read a source file");
            for marker in ["include_str!(\"", "include_bytes!(\"", "#[path = \""] {
                for (at, _) in source.match_indices(marker) {
                    let rest = &source[at + marker.len()..];
                    let target = &rest[..rest.find('"').unwrap_or(0)];
                    let mut resolved = path.parent().expect("a file's folder").to_path_buf();
                    for c in Path::new(target).components() {
                        match c {
                            Component::ParentDir => {
                                resolved.pop();
                            }
                            Component::Normal(s) => resolved.push(s),
                            _ => {}
                        }
                    }
                    if !resolved.starts_with(dir) {
                        outside.push(format!("{}: {target}", path.display()));
                    }
                }
            }
        }
    }
    outside
}

#[test]
fn only_the_published_crates_are_publishable_and_they_are_complete() {
    let root_license = std::fs::read(root().join("LICENSE")).expect("a LICENSE at the root");
    assert!(
        String::from_utf8_lossy(&root_license)
            .trim_start()
            .starts_with("Apache License\n                           Version 2.0"),
        "the root LICENSE is the Apache License 2.0"
    );
    let packages = packages();
    let mut problems = Vec::new();
    for p in &packages {
        let name = text(p, "name");
        if PUBLISHED.contains(&name.as_str()) {
            problems.extend(publish_problems(p, &root_license));
            problems.extend(includes_from_outside(&crate_dir(p)));
        } else if p["publish"] != serde_json::json!([]) {
            problems.push(format!("{name} is publishable; only {PUBLISHED:?} are"));
        }
    }
    let found: Vec<String> = packages.iter().map(|p| text(p, "name")).collect();
    for name in PUBLISHED {
        assert!(
            found.iter().any(|n| n == name),
            "{name} is a workspace member"
        );
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_packages_hold_their_readme_license_and_sources() {
    for name in PUBLISHED {
        let list = cargo(&["package", "--list", "--allow-dirty", "-p", name]);
        let files: Vec<&str> = list.lines().collect();
        for needed in ["Cargo.toml", "README.md", "LICENSE", "src/lib.rs"] {
            assert!(files.contains(&needed), "{name}'s package lacks {needed}");
        }
    }
}

#[test]
fn the_checks_see_what_breaks_a_package() {
    let root_license = b"Apache License";
    let dir = root().join("crates/kvc-policy");
    let unpublishable = serde_json::json!({
        "name": "kvc-x", "publish": [], "license": "MIT",
        "manifest_path": dir.join("Cargo.toml"), "readme": null, "keywords": [],
        "categories": ["a", "b", "c", "d", "e", "f"],
        "dependencies": [
            {"name": "kvc-core", "path": "/x", "req": "*", "kind": null},
            {"name": "kvc-replay", "path": "/y", "req": "^0.1.0", "kind": "dev"},
            {"name": "serde", "path": null, "req": "*", "kind": null}
        ]
    });
    let problems = publish_problems(&unpublishable, root_license);
    assert_eq!(
        problems,
        [
            "kvc-x: `publish` forbids crates.io",
            "kvc-x: no `description`",
            "kvc-x: no `repository`",
            "kvc-x: no `documentation`",
            "kvc-x: no `rust_version`",
            "kvc-x: license is not Apache-2.0",
            "kvc-x: 0 keywords (crates.io takes 1 to 5)",
            "kvc-x: 6 categories (crates.io takes 1 to 5)",
            "kvc-x: no README.md of its own",
            "kvc-x: LICENSE is not a copy of the root's",
            "kvc-x: normal dependency kvc-core has no version",
            "kvc-x: dev dependency kvc-replay is not published",
        ]
    );
    // kvc-engine-sim compiles the default engine profile in from `profiles/`: published
    // alone, it would not build.
    let sim = root().join("crates/kvc-engine-sim");
    let outside = includes_from_outside(&sim);
    assert_eq!(outside.len(), 1, "{outside:?}");
    assert!(outside[0].ends_with("profiles/qwen3-30b-a3b-h100.toml"));
    assert!(includes_from_outside(&dir).is_empty());
}
