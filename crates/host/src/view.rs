//! A host's view of a catalog: every tool, visible with its chosen variant or hidden with a reason.

use std::sync::Arc;

use serde::Serialize;
use toolsrv_meta::{Host, Meta, Resolution};
use toolsrv_registry::Catalog;

/// What one host sees of one tool.
#[derive(Debug, Clone)]
pub struct ToolView {
    pub meta: Arc<Meta>,
    pub resolution: Resolution,
}

/// The listing shape shared by every client (`toolctl local list --json`, `toolctl tools --json`).
#[derive(Debug, Serialize)]
pub struct ListEntry<'a> {
    pub name: &'a str,
    pub visible: bool,
    /// Index of the chosen variant; `null` for tools without variants and hidden tools.
    pub variant: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'a str>,
    pub description: Option<&'a str>,
}

impl ToolView {
    pub fn name(&self) -> &str {
        &self.meta.name
    }

    pub fn list_entry(&self) -> ListEntry<'_> {
        match &self.resolution {
            Resolution::Visible { variant, tool } => ListEntry {
                name: self.name(),
                visible: true,
                variant: *variant,
                reason: None,
                description: tool.description.as_deref(),
            },
            Resolution::Hidden { reason } => ListEntry {
                name: self.name(),
                visible: false,
                variant: None,
                reason: Some(reason),
                description: self.meta.def.description.as_deref(),
            },
        }
    }
}

/// Resolves every tool of `catalog` against `host`, in name order.
pub fn view(catalog: &Catalog, host: &Host) -> Vec<ToolView> {
    catalog
        .tools
        .values()
        .map(|t| ToolView {
            meta: t.meta.clone(),
            resolution: t.meta.resolve(host),
        })
        .collect()
}
