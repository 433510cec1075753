//! The container image `scripts/image/build.sh` makes by hand, as an OCI image layout archive:
//! built from the debug binaries this test run has (`--debug --bins`: a build of the
//! script's own would compile them again, without the features the tests' build turns on)
//! and read back by its own `--check` (blob digests and sizes, entrypoint and user, every
//! library the binaries need and their loader in the image), which runs kvc-router and
//! kvc-replay from the unpacked root filesystem; this test then reads the archive's index and
//! Docker manifest itself. Skipped with a notice only where python3 is absent (the script
//! exits 3).
#![forbid(unsafe_code)]

mod common;

use serde_json::Value;
use std::io::Read as _;
use std::path::Path;
use std::process::Command;

/// The file `name` of the tar archive at `path`, as JSON.
fn json_in_tar(path: &Path, name: &str) -> Value {
    let out = Command::new("tar")
        .arg("-xOf")
        .arg(path)
        .arg(name)
        .output()
        .expect("run tar");
    assert!(out.status.success(), "{name} is not in {}", path.display());
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_image_archive_runs_its_binaries_as_stated() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let dir = std::env::temp_dir().join(format!("kvc-image-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let archive = dir.join("kvc-router-oci.tar");
    let out = Command::new("bash")
        .arg(root.join("scripts/image/build.sh"))
        .args(["--debug", "--check", "--bins"])
        .arg(common::bin_dir())
        .arg("--out")
        .arg(&archive)
        .output()
        .expect("run scripts/image/build.sh");
    if out.status.code() == Some(3) {
        eprintln!("python3 not found: the image test is skipped");
        return;
    }
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut manifest = String::new();
    std::fs::File::open(root.join("crates/kvc-router/Cargo.toml"))
        .unwrap()
        .read_to_string(&mut manifest)
        .unwrap();
    let version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .unwrap();

    // What the check ran from the unpacked root filesystem.
    for line in [
        format!("/usr/local/bin/kvc-router --version: kvc-router {version}"),
        format!("/usr/local/bin/kvc-replay --version: kvc-replay {version}"),
        "/usr/local/bin/kvc-router --listen 127.0.0.1:0: kvc-router grpc=127.0.0.1:".to_owned(),
        "entrypoint /usr/local/bin/kvc-router, user 65532:65532 as stated".to_owned(),
    ] {
        assert!(stdout.contains(&line), "no {line:?} in:\n{stdout}");
    }
    assert!(stdout.contains("image check passed"), "{stdout}");

    // The archive's own index and Docker manifest name the image, and agree on its manifest.
    let reference = format!("kvc-router:{version}");
    let index = json_in_tar(&archive, "index.json");
    assert_eq!(
        index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"],
        reference.as_str()
    );
    let docker = json_in_tar(&archive, "manifest.json");
    assert_eq!(docker[0]["RepoTags"][0], reference.as_str());
    let digest = index["manifests"][0]["digest"].as_str().unwrap();
    let image_manifest = json_in_tar(
        &archive,
        &format!("blobs/sha256/{}", digest.trim_start_matches("sha256:")),
    );
    let layer = image_manifest["layers"][0]["digest"].as_str().unwrap();
    assert_eq!(
        docker[0]["Layers"][0],
        format!("blobs/sha256/{}", layer.trim_start_matches("sha256:"))
    );
    let _ = std::fs::remove_dir_all(&dir);
}
