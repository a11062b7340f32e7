//! The model-facing definition of a resolved tool, as agents report it and the coordinator
//! keeps it: one conversion, so that both sides say the same of the same `.meta`.

use toolsrv_meta::ResolvedTool;
use toolsrv_proto::v1::ToolDefinition;

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
