//! The host's view as the coordinator receives it: every tool as a `ToolStatus`, the memory of
//! what was last reported so an unchanged view is not sent again, and the split of a large view
//! into messages.

use prost::Message;
use toolsrv_meta::{Host, Resolution};
use toolsrv_proto::limits::{MAX_MESSAGE_BYTES, MAX_VIEW_BYTES, view_tool_bytes};
use toolsrv_proto::v1::{HostView, ToolStatus};
use toolsrv_registry::{Catalog, definition};

/// Most bytes of tools per view message. Far below [`MAX_MESSAGE_BYTES`], and small so that
/// neither side keeps a large buffer for the life of the link; a single larger tool still goes
/// out alone (a `.meta` is at most 256 KiB, so its status is far below the limit too).
pub const VIEW_PART_BYTES: usize = 1 << 20;
/// Room left in a message for everything but the tools (the revision, field tags).
const VIEW_MESSAGE_SLACK: usize = 1 << 10;

/// Every tool of `catalog` as `host` sees it, in name order (invalid ones hidden, with why).
pub fn tool_statuses(catalog: &Catalog, host: &Host) -> Vec<ToolStatus> {
    toolsrv_host::view(catalog, host)
        .iter()
        .map(|v| tool_status(v.name(), &v.resolution, v.hidden_description()))
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
            // The coordinator knows which tools it ships, and its policy; an agent does not say.
            host_only: false,
            policy: None,
        },
        Resolution::Hidden { reason } => ToolStatus {
            name: name.to_string(),
            visible: false,
            variant: None,
            reason: reason.clone(),
            description: hidden_description.unwrap_or_default().to_string(),
            definition: None,
            host_only: false,
            policy: None,
        },
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

/// `view` as the coordinator takes it: at most [`MAX_VIEW_BYTES`] in all, no tool alone above
/// what a message holds. Past the limit, tools are reported hidden without their definition
/// (so a listing says why they cannot be called), and once even that does not fit, left out.
pub fn within_limits(mut view: HostView) -> HostView {
    let mut total = 0usize;
    let (mut hidden, mut left_out) = (0usize, 0usize);
    let tools = std::mem::take(&mut view.tools);
    for mut tool in tools {
        let mut bytes = view_tool_bytes(&tool);
        if total + bytes > MAX_VIEW_BYTES
            || tool.encoded_len() + VIEW_MESSAGE_SLACK > MAX_MESSAGE_BYTES
        {
            tool = too_large(tool);
            bytes = view_tool_bytes(&tool);
            hidden += 1;
        }
        if total + bytes > MAX_VIEW_BYTES {
            left_out += 1;
            continue;
        }
        total += bytes;
        view.tools.push(tool);
    }
    if hidden > 0 {
        tracing::error!(
            hidden,
            left_out,
            limit = MAX_VIEW_BYTES,
            "the host's view is larger than the coordinator keeps: tools past the limit are reported hidden without their definition (or left out); remove tools or shorten their .meta files"
        );
    }
    view
}

fn too_large(tool: ToolStatus) -> ToolStatus {
    ToolStatus {
        visible: false,
        variant: None,
        reason: format!(
            "not reported: this host's view exceeds the {MAX_VIEW_BYTES} bytes the coordinator keeps per host (or this tool alone exceeds a message); see the agent's log"
        ),
        definition: None,
        description: String::new(),
        name: tool.name,
        host_only: false,
        policy: None,
    }
}

/// The messages that carry `view`: parts of at most [`VIEW_PART_BYTES`] of tools (a larger
/// tool alone), in order, every one but the last marked `more`.
pub fn parts(view: HostView) -> Vec<HostView> {
    let revision = view.catalog_revision;
    let mut parts = vec![HostView {
        catalog_revision: revision,
        tools: Vec::new(),
        more: false,
    }];
    let mut size = 0;
    for tool in view.tools {
        let bytes = tool.encoded_len();
        if size + bytes > VIEW_PART_BYTES && size > 0 {
            if let Some(last) = parts.last_mut() {
                last.more = true;
            }
            parts.push(HostView {
                catalog_revision: revision,
                tools: Vec::new(),
                more: false,
            });
            size = 0;
        }
        size += bytes;
        if let Some(last) = parts.last_mut() {
            last.tools.push(tool);
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolsrv_proto::v1::ToolDefinition;

    fn tool(name: &str, prompt_bytes: usize) -> ToolStatus {
        ToolStatus {
            name: name.to_string(),
            visible: true,
            description: "d".into(),
            definition: Some(ToolDefinition {
                name: name.to_string(),
                prompt: "p".repeat(prompt_bytes),
                ..ToolDefinition::default()
            }),
            ..ToolStatus::default()
        }
    }

    fn view(tools: Vec<ToolStatus>) -> HostView {
        HostView {
            catalog_revision: 9,
            tools,
            more: false,
        }
    }

    #[test]
    fn a_small_view_is_one_message() {
        let small = view(vec![tool("a", 10), tool("b", 10)]);
        assert_eq!(parts(small.clone()), vec![small]);
        let empty = view(vec![]);
        assert_eq!(parts(empty.clone()), vec![empty]);
    }

    #[test]
    fn a_large_view_goes_out_in_parts_below_the_limit() {
        // 80 tools of 250 KiB: about 20 MiB, above what one message may hold.
        let tools: Vec<_> = (0..80)
            .map(|i| tool(&format!("t{i:02}"), 250 << 10))
            .collect();
        let whole = view(tools.clone());
        assert!(whole.encoded_len() > MAX_MESSAGE_BYTES);
        let sent = parts(within_limits(whole));
        assert!(sent.len() >= 20, "{}", sent.len());
        for (i, part) in sent.iter().enumerate() {
            assert_eq!(part.catalog_revision, 9);
            assert_eq!(part.more, i + 1 < sent.len(), "part {i}");
            assert!(!part.tools.is_empty());
            assert!(part.encoded_len() <= VIEW_PART_BYTES + VIEW_MESSAGE_SLACK);
        }
        let joined: Vec<_> = sent.into_iter().flat_map(|p| p.tools).collect();
        assert_eq!(joined, tools, "every tool, in order, unchanged");

        // A tool larger than a part goes alone.
        let big = view(vec![tool("a", 1), tool("big", 2 << 20), tool("c", 1)]);
        let sent = parts(big);
        let sizes: Vec<_> = sent.iter().map(|p| p.tools.len()).collect();
        assert_eq!(sizes, [1, 1, 1]);
    }

    #[test]
    fn past_the_view_limit_tools_are_hidden_then_left_out() {
        // 100 tools of 1 MiB: 100 MiB, above the 64 MiB the coordinator keeps.
        let tools: Vec<_> = (0..100)
            .map(|i| tool(&format!("t{i:03}"), 1 << 20))
            .collect();
        let kept = within_limits(view(tools));
        assert_eq!(kept.tools.len(), 100);
        let total: usize = kept.tools.iter().map(view_tool_bytes).sum();
        assert!(total <= MAX_VIEW_BYTES);
        let visible = kept.tools.iter().filter(|t| t.visible).count();
        assert!((60..64).contains(&visible), "{visible}");
        let hidden = &kept.tools[99];
        assert!(!hidden.visible && hidden.definition.is_none());
        assert!(hidden.reason.contains("exceeds"), "{}", hidden.reason);

        // Countless tiny entries: what does not fit even hidden is left out.
        let many = (0..MAX_VIEW_BYTES / 512 + 10)
            .map(|i| ToolStatus {
                name: format!("{i}"),
                ..ToolStatus::default()
            })
            .collect();
        let kept = within_limits(view(many));
        let total: usize = kept.tools.iter().map(view_tool_bytes).sum();
        assert!(total <= MAX_VIEW_BYTES);
        assert!(kept.tools.len() < MAX_VIEW_BYTES / 512);
    }
}
