//! Compiles `kvc/v1/*.proto` with the `protoc` vendored by `protoc-bin-vendored` (handed to
//! prost-build as its executable), so the build needs no system `protoc`.
#![forbid(unsafe_code)]

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let file = root.join("kvc/v1/router.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(
            std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("kvc_v1_descriptor.bin"),
        )
        .compile_with_config(config, &[file], &[root.to_path_buf()])?;
    Ok(())
}
