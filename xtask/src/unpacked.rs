//! Cargo's copies of our own packaged crates, unpacked under `$CARGO_HOME`.
//!
//! `cargo publish --dry-run -p kvc-core -p kvc-policy` packages both crates into a local
//! registry in `target/package/` and builds `kvc-policy` against that registry's
//! `kvc-core`. Cargo unpacks a registry's crate into `$CARGO_HOME/registry/src/<registry>/`
//! once per name and version and reuses the directory afterwards, so a checkout at the same
//! path (a CI machine cloning into the same directory) builds `kvc-policy` against the
//! `kvc-core` of an earlier run while the version number has not moved. Removing those
//! directories before the dry run makes cargo unpack what was just packaged.

use std::io;
use std::path::{Path, PathBuf};

/// Removes the unpacked copies of `crates` (any version) from the local registries' source
/// directories in `cargo_home` and returns what it removed. A local registry's directory
/// has an empty host name, so its name starts with `-`; the directories of remote
/// registries (crates.io's `index.crates.io-…`) are never touched. A missing
/// `registry/src` is not an error: there is nothing to remove.
pub(crate) fn forget(cargo_home: &Path, crates: &[&str]) -> io::Result<Vec<PathBuf>> {
    let sources = cargo_home.join("registry").join("src");
    let registries = match std::fs::read_dir(&sources) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut removed = Vec::new();
    for registry in registries {
        let registry = registry?;
        if !registry.file_name().to_string_lossy().starts_with('-')
            || !registry.file_type()?.is_dir()
        {
            continue;
        }
        for unpacked in std::fs::read_dir(registry.path())? {
            let unpacked = unpacked?;
            let name = unpacked.file_name();
            let name = name.to_string_lossy();
            let ours = crates.iter().any(|c| {
                name.strip_prefix(c)
                    .and_then(|rest| rest.strip_prefix('-'))
                    .is_some_and(|version| version.starts_with(|ch: char| ch.is_ascii_digit()))
            });
            if ours && unpacked.file_type()?.is_dir() {
                std::fs::remove_dir_all(unpacked.path())?;
                removed.push(unpacked.path());
            }
        }
    }
    removed.sort();
    Ok(removed)
}

/// `$CARGO_HOME`, or `$HOME/.cargo` as cargo itself defaults it.
pub(crate) fn cargo_home() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os("CARGO_HOME") {
        return Some(PathBuf::from(home));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("xtask-unpacked-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn mkdir(path: PathBuf) -> PathBuf {
        std::fs::create_dir_all(&path).unwrap();
        std::fs::write(path.join("Cargo.toml"), "").unwrap();
        path
    }

    #[test]
    fn only_our_crates_in_local_registries_are_removed() {
        let home = scratch("ours");
        let src = home.join("registry/src");
        let stale_core = mkdir(src.join("-9615d3144a5460a8/kvc-core-0.1.0"));
        let stale_policy = mkdir(src.join("-14cd1cce6819ff87/kvc-policy-0.2.0"));
        let other_local = mkdir(src.join("-14cd1cce6819ff87/kvc-core-extras-0.1.0"));
        let remote = mkdir(src.join("index.crates.io-1949cf8c6b5b557f/kvc-core-0.1.0"));
        let serde = mkdir(src.join("-9615d3144a5460a8/serde-1.0.0"));

        let removed = forget(&home, &["kvc-core", "kvc-policy"]).unwrap();

        assert_eq!(removed, vec![stale_policy.clone(), stale_core.clone()]);
        assert!(!stale_core.exists() && !stale_policy.exists());
        assert!(
            other_local.exists(),
            "a crate whose name only starts like ours stays"
        );
        assert!(remote.exists(), "a remote registry's copy stays");
        assert!(serde.exists(), "other crates in a local registry stay");
        // Nothing left to remove: a second call removes nothing.
        assert_eq!(
            forget(&home, &["kvc-core", "kvc-policy"]).unwrap(),
            Vec::<PathBuf>::new()
        );
        std::fs::remove_dir_all(&home).unwrap();
    }

    #[test]
    fn a_cargo_home_without_registry_sources_has_nothing_to_remove() {
        let home = scratch("empty");
        assert_eq!(forget(&home, &["kvc-core"]).unwrap(), Vec::<PathBuf>::new());
        std::fs::remove_dir_all(&home).unwrap();
    }
}
