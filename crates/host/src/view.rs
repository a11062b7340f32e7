//! A host's view of a catalog: every tool, visible with its chosen variant or hidden with a reason
//! (a tool whose files are invalid is listed hidden, with what is wrong with it).

use std::sync::Arc;

use serde::Serialize;
use toolsrv_meta::{Host, Meta, Resolution};
use toolsrv_registry::Catalog;

/// What one host sees of one tool.
#[derive(Debug, Clone)]
pub struct ToolView {
    pub name: String,
    /// The parsed definition; `None` for a tool whose files are invalid (hidden, with why).
    pub meta: Option<Arc<Meta>>,
    pub resolution: Resolution,
}

/// The listing shape shared by every client (`toolctl local list --json`, `toolctl tools --json`).
#[derive(Debug, Serialize)]
pub struct ListEntry<'a> {
    pub name: &'a str,
    pub visible: bool,
    /// Index of the chosen variant; `null` for tools without variants and hidden tools.
    pub variant: Option<usize>,
    /// Why a hidden tool is hidden; `null` for a visible one.
    pub reason: Option<&'a str>,
    pub description: Option<&'a str>,
    /// Served by the host from its own tools directory, not shipped by the coordinator (only
    /// a coordinator knows; present only when true).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub host_only: bool,
}

impl ToolView {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The description a listing shows for a hidden tool: its top-level one, when it has one.
    pub fn hidden_description(&self) -> Option<&str> {
        self.meta.as_ref()?.def.description.as_deref()
    }

    pub fn list_entry(&self) -> ListEntry<'_> {
        match &self.resolution {
            Resolution::Visible { variant, tool } => ListEntry {
                name: self.name(),
                visible: true,
                variant: *variant,
                reason: None,
                description: tool.description.as_deref(),
                host_only: false,
            },
            Resolution::Hidden { reason } => ListEntry {
                name: self.name(),
                visible: false,
                variant: None,
                reason: Some(reason),
                description: self.hidden_description(),
                host_only: false,
            },
        }
    }
}

/// Resolves every tool of `catalog` against `host`, in name order; tools whose files are invalid
/// are hidden, with the reason.
pub fn view(catalog: &Catalog, host: &Host) -> Vec<ToolView> {
    let served = catalog.tools.iter().map(|(name, t)| ToolView {
        name: name.clone(),
        meta: Some(t.meta.clone()),
        resolution: t.meta.resolve(host),
    });
    let invalid = catalog.invalid.iter().map(|(name, invalid)| ToolView {
        name: name.clone(),
        meta: None,
        resolution: Resolution::Hidden {
            reason: invalid.reason(),
        },
    });
    let mut views: Vec<ToolView> = served.chain(invalid).collect();
    views.sort_by(|a, b| a.name.cmp(&b.name));
    views
}
