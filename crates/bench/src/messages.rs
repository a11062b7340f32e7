//! Encoded sizes of the agent-link messages a new host costs: the full catalog the coordinator
//! sends it and the view a fake agent answers with.

use std::path::Path;

use prost::Message;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::{CatalogUpdate, CoordinatorMessage, ToolDocument, Welcome};
use toolsrv_testkit::fake::{Definitions, Reaction, Responder};

use crate::BenchError;

/// Encoded sizes of what the coordinator sends a new agent for the `.meta` files of `dir` (the
/// full `CatalogUpdate`, executables not inlined) and of the view a fake agent answers with.
pub fn message_sizes(dir: &Path, definitions: Definitions) -> Result<(usize, usize), BenchError> {
    let mut upserts = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "meta") {
            let name = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default()
                .to_string();
            upserts.push(ToolDocument {
                name,
                meta: std::fs::read(&path)?,
                meta_sha256: "0".repeat(64),
                executable: None,
            });
        }
    }
    let update = CatalogUpdate {
        revision: 1,
        full: true,
        upserts,
        removals: Vec::new(),
        more: false,
    };
    let message = |m: In| CoordinatorMessage { msg: Some(m) };
    let catalog = message(In::Catalog(update.clone())).encoded_len();
    let mut responder = Responder::new("fake-0000", definitions);
    responder.react(message(In::Welcome(Welcome::default())));
    let view = match responder.react(message(In::Catalog(update))) {
        Reaction::Send(sent) => sent.iter().map(Message::encoded_len).sum(),
        _ => 0,
    };
    Ok((catalog, view))
}
