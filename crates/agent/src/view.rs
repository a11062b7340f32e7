//! The host's view as the coordinator receives it: every tool as a `ToolStatus`, and the memory of
//! what was last reported so an unchanged view is not sent again.

use toolsrv_meta::{Host, Resolution, ResolvedTool};
use toolsrv_proto::v1::{HostView, ToolDefinition, ToolStatus};
use toolsrv_registry::Catalog;

/// Every tool of `catalog` as `host` sees it, in name order.
pub fn tool_statuses(catalog: &Catalog, host: &Host) -> Vec<ToolStatus> {
    toolsrv_host::view(catalog, host)
        .iter()
        .map(|v| tool_status(v.name(), &v.resolution, v.meta.def.description.as_deref()))
        .collect()
}

/// One tool's status: visible with its definition and variant, or hidden with the reason and
/// the top-level description `hidden_description`.
pub fn tool_status(
    name: &str,
    resolution: &Resolution,
    hidden_description: Option<&str>,
) -> ToolStatus {
    match resolution {
        Resolution::Visible { variant, tool } => ToolStatus {
            name: name.to_string(),
            visible: true,
            // A .meta with more than 4 billion variants is not a thing; saturate rather than fail.
            variant: variant.map(|i| u32::try_from(i).unwrap_or(u32::MAX)),
            reason: String::new(),
            description: tool.description.clone().unwrap_or_default(),
            definition: Some(definition(tool)),
        },
        Resolution::Hidden { reason } => ToolStatus {
            name: name.to_string(),
            visible: false,
            variant: None,
            reason: reason.clone(),
            description: hidden_description.unwrap_or_default().to_string(),
            definition: None,
        },
    }
}

/// The model-facing definition of a resolved tool.
pub fn definition(tool: &ResolvedTool) -> ToolDefinition {
    ToolDefinition {
        name: tool.name.clone(),
        description: tool.description.clone().unwrap_or_default(),
        prompt: tool.prompt.clone().unwrap_or_default(),
        keywords: tool.keywords.clone(),
        args_schema_json: serde_json::to_string(&tool.args).unwrap_or_default(),
        tier: tool
            .tier
            .map(|t| t.as_str().to_string())
            .unwrap_or_default(),
        scope: tool.scope.clone().unwrap_or_default(),
        output_format: tool.output_format.clone().unwrap_or_default(),
        resets_counter: tool.resets_counter,
    }
}

/// Remembers the last view sent on a session.
#[derive(Debug, Default)]
pub struct ViewTracker {
    last: Option<HostView>,
}

impl ViewTracker {
    /// `view` if it differs from the last one sent (which it then becomes), else `None`.
    pub fn if_changed(&mut self, view: HostView) -> Option<HostView> {
        if self.last.as_ref() == Some(&view) {
            return None;
        }
        self.last = Some(view.clone());
        Some(view)
    }

    /// Records `view` as sent, changed or not (after a catalog update it is always sent).
    pub fn sent(&mut self, view: HostView) -> HostView {
        self.last = Some(view.clone());
        view
    }
}
