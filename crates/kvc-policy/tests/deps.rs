//! The crate stays free of I/O and async runtimes: its normal dependencies are exactly
//! kvc-core, serde, smallvec (inline vectors: the block view's holder lists) and thiserror,
//! and, only with the `schema` feature, schemars (the configurations' JSON Schema, for the
//! generated configuration reference).

#[test]
fn normal_dependencies_are_pure() {
    let manifest = include_str!("../Cargo.toml");
    let section = manifest
        .split("\n[")
        .find(|section| section.starts_with("dependencies]"))
        .expect("a [dependencies] section");
    let deps: Vec<&str> = section
        .lines()
        .skip(1)
        .filter_map(|l| l.split(['.', '=', ' ']).next())
        .filter(|name| !name.is_empty() && !name.starts_with('#'))
        .collect();
    assert_eq!(
        deps,
        ["kvc-core", "schemars", "serde", "smallvec", "thiserror"]
    );
    let schemars = section
        .lines()
        .find(|l| l.starts_with("schemars"))
        .expect("schemars");
    assert!(schemars.contains("optional = true"), "{schemars}");
}
