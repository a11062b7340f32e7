//! Size limits that both ends of every link agree on. They are part of the public contract:
//! a sender checks them before sending, so that no message a peer refuses is ever put on a
//! stream (a refused message would end the whole stream, and with it every other call on it).

/// Largest encoded gRPC message on the agent link and on the client API, in both directions.
/// Every sender keeps below it: catalogs and host views go out in parts, results are capped,
/// arguments are limited by [`MAX_ARGS_BYTES`].
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Most memory one received message may take once decoded, counted from its encoded bytes
/// before it is decoded ([`crate::cost`]); a larger one is refused undecoded. Eight messages'
/// worth: a list of short names, the densest message there is, counts up to about fourteen
/// times its size, and senders of lists that could be long (a session's host names, a
/// `FindTools` answer) keep them to half a message; 16 MiB of empty list entries, which
/// decoded to 1.7 GB, are refused.
pub const MAX_DECODED_BYTES: usize = 8 * MAX_MESSAGE_BYTES;

/// Largest `.meta` document the registry loads; a larger file is rejected with a diagnostic,
/// like any other broken `.meta`, and every other tool keeps loading.
pub const MAX_META_BYTES: u64 = 256 << 10;

/// Largest co-located executable the registry ships with its tool.
pub const MAX_EXECUTABLE_BYTES: u64 = 64 << 20;

/// Largest call arguments (`args_json`) the coordinator accepts; larger ones are refused with
/// `INVALID_ARGUMENT` before anything reaches an agent.
pub const MAX_ARGS_BYTES: usize = 1 << 20;

/// Most JSON values (objects, arrays, strings, numbers, booleans, nulls, at any depth, the
/// arguments object included) a call's arguments may hold, counted from their text before
/// anything is built from it (`toolsrv_meta::check_args_json`). A value takes tens of bytes
/// once built in memory, whatever its few bytes of text: 1 MiB of `[0],` took 89 MB on the
/// coordinator, and again on the host. 65,536 values take a few MB.
pub const MAX_ARGS_VALUES: usize = 65_536;

/// Most bytes the coordinator keeps of one host's view, all its parts together, counted by
/// [`view_tool_bytes`]. An agent keeps its view within it (tools past it are reported hidden
/// without their definition, or left out, and the agent logs it); the coordinator ends the link
/// of an agent that sends more, so a broken or hostile agent cannot grow its memory without
/// bound. Four messages' worth: room for 256 tools at [`MAX_META_BYTES`] each, or tens of
/// thousands of ordinary ones.
pub const MAX_VIEW_BYTES: usize = 4 * MAX_MESSAGE_BYTES;

/// The fixed cost of one tool of a view toward [`MAX_VIEW_BYTES`], on top of its encoded size:
/// what keeping an entry costs beyond its bytes, so that a view of countless empty entries
/// counts too.
pub const VIEW_TOOL_OVERHEAD_BYTES: usize = 512;

/// What one tool of a host view counts toward [`MAX_VIEW_BYTES`].
pub fn view_tool_bytes(tool: &crate::v1::ToolStatus) -> usize {
    prost::Message::encoded_len(tool) + VIEW_TOOL_OVERHEAD_BYTES
}

/// Longest `message` of a call result: a refusal can quote the arguments (a schema violation
/// names the value), and arguments may be large. Longer ones are cut, saying so.
pub const MAX_MESSAGE_TEXT: usize = 64 << 10;
