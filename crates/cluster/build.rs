//! Generates the etcd v3 client from `proto/` (a subset of etcd's API) with a vendored protoc
//! (or `$PROTOC` when set), as toolsrv-proto does: no protoc or .proto files from the system.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-env-changed=PROTOC");
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("proto");
    let files = ["etcd.proto", "kv.proto"].map(|f| root.join(f));
    let mut config = tonic_prost_build::Config::new();
    // `$PROTOC` wins; otherwise the vendored protoc, so no install step is needed.
    if std::env::var_os("PROTOC").is_none() {
        config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    }
    tonic_prost_build::configure()
        .build_server(false)
        .compile_with_config(config, &files, std::slice::from_ref(&root))?;
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    Ok(())
}
