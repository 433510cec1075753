//! Compiles `proto/kvc/v1/*.proto` with the `protoc` vendored by `protoc-bin-vendored`, so the
//! build needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    #[allow(unsafe_code)]
    // SAFETY: the build script runs single-threaded; nothing else reads the environment now.
    unsafe {
        std::env::set_var("PROTOC", protoc);
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("kvc/v1/router.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    tonic_prost_build::configure()
        .file_descriptor_set_path(
            std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("kvc_v1_descriptor.bin"),
        )
        .compile_protos(&[file], &[root])?;
    Ok(())
}
