//! Generates the gRPC code from `proto/` with a vendored protoc (or `$PROTOC` when set).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `$PROTOC` wins; otherwise the vendored protoc, so no install step is needed.
    let protoc = match std::env::var_os("PROTOC") {
        Some(_) => None,
        None => Some(protoc_bin_vendored::protoc_bin_path()?),
    };
    println!("cargo:rerun-if-env-changed=PROTOC");
    generate(protoc)
}

fn generate(protoc: Option<PathBuf>) -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = [
        "toolsrv/v1/common.proto",
        "toolsrv/v1/agent.proto",
        "toolsrv/v1/tools.proto",
        "toolsrv/v1/enroll.proto",
    ]
    .map(|f| root.join(f));
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut config = tonic_prost_build::Config::new();
    // Sorted maps: labels print and compare deterministically.
    config.btree_map(["."]);
    // Every message knows its protobuf name: receivers look up its schema by it (`cost`).
    config.enable_type_names();
    if let Some(protoc) = protoc {
        config.protoc_executable(protoc);
    }
    tonic_prost_build::configure()
        .codec_path("crate::codec::LeanCodec")
        .file_descriptor_set_path(out.join("toolsrv_descriptor.bin"))
        .compile_with_config(config, &files, std::slice::from_ref(&root))?;
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    Ok(())
}
