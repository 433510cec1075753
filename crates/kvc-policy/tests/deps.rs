//! The crate stays free of I/O and async runtimes: its normal dependencies are exactly
//! kvc-core, serde, smallvec (inline vectors: the block view's holder lists) and thiserror,
//! and, only with the `schema` feature, schemars (the configurations' JSON Schema, for the
//! generated configuration reference).

/// The normal dependencies a manifest names, in order: `name = …` and `name.workspace = true`
/// lines of its `[dependencies]` table (the workspace's manifest), or `[dependencies.name]`
/// tables (the manifest `cargo package` writes into the published crate).
fn normal_dependencies(manifest: &str) -> Vec<&str> {
    let mut deps = Vec::new();
    let mut in_table = false;
    for line in manifest.lines().map(str::trim) {
        if let Some(header) = line.strip_prefix('[') {
            let header = header.trim_end_matches(']');
            in_table = header == "dependencies";
            if let Some(name) = header.strip_prefix("dependencies.") {
                deps.push(name.trim_matches('"'));
            }
        } else if in_table && !line.is_empty() && !line.starts_with('#') {
            deps.extend(line.split(['.', '=', ' ']).next());
        }
    }
    deps
}

#[test]
fn normal_dependencies_are_pure() {
    let manifest = include_str!("../Cargo.toml");
    assert_eq!(
        normal_dependencies(manifest),
        ["kvc-core", "schemars", "serde", "smallvec", "thiserror"]
    );
    // schemars only with the `schema` feature: `schemars = { …, optional = true }` in the
    // workspace's manifest, a `[dependencies.schemars]` table with `optional = true` in the
    // packaged one.
    let entry = match manifest.find("[dependencies.schemars]") {
        Some(at) => manifest[at..].split("\n\n").next().unwrap_or_default(),
        None => manifest
            .lines()
            .find(|l| l.starts_with("schemars"))
            .expect("schemars"),
    };
    assert!(entry.contains("optional = true"), "{entry}");
}

#[test]
fn both_manifest_shapes_are_read() {
    let workspace = "[package]\nname = \"x\"\n\n[dependencies]\nkvc-core.workspace = true\n\
                     # inline vectors\nsmallvec = \"1\"\n\n[dev-dependencies]\ntokio = \"1\"\n";
    assert_eq!(normal_dependencies(workspace), ["kvc-core", "smallvec"]);
    let packaged = "[lib]\nname = \"x\"\n\n[dependencies.kvc-core]\nversion = \"0.1.0\"\n\n\
                    [dependencies.serde]\nversion = \"=1.0.229\"\nfeatures = [\"derive\"]\n\n\
                    [dev-dependencies.tokio]\nversion = \"1\"\n";
    assert_eq!(normal_dependencies(packaged), ["kvc-core", "serde"]);
}
