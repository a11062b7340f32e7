//! The memory a message takes once decoded, counted before decoding (`toolsrv_proto::cost`),
//! against what decoding really allocates, under a counting allocator: for every message of
//! the protocol and every hostile shape of every repeated field (countless empty entries, tiny
//! filled ones, many parents with one entry each, packed numbers), the count is an upper bound.
//!
//! One test function only: the allocator counts every thread of the process.
#![allow(clippy::unwrap_used, clippy::expect_used)]
// Tests fail loudly by design.
// A global allocator is an `unsafe` trait; this one only counts and passes each call on.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};

use prost::encoding::WireType;
use prost::{Message, Name};
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, FileDescriptorSet};
use toolsrv_proto::cost::{Why, check_named, decoded_bytes, struct_bytes};
use toolsrv_proto::limits::MAX_MESSAGE_BYTES;
use toolsrv_proto::v1;

/// Counts what the allocator hands out as glibc's malloc does: rounded up to 16 bytes, with a
/// 16-byte header. A reallocation holds the old block and the new one at once.
struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn charge(size: usize) -> usize {
    size.div_ceil(16) * 16 + 16
}

fn take(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::SeqCst) + bytes;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every call is passed on to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        take(charge(layout.size()));
        // SAFETY: the caller's layout, as given.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CURRENT.fetch_sub(charge(layout.size()), Ordering::SeqCst);
        // SAFETY: the caller's block and layout, as given.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        take(charge(new_size));
        CURRENT.fetch_sub(charge(layout.size()), Ordering::SeqCst);
        // SAFETY: the caller's block, layout and size, as given.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Frees what a decoded message holds (some messages hold nothing and are `Copy`).
fn release<T>(decoded: T) {
    drop(decoded);
}

/// Every message of the protocol: its full name, its struct's size, and a function that
/// decodes it and returns the most bytes held during the decoding (what it allocated).
macro_rules! messages {
    ($($t:ident),* $(,)?) => {
        fn messages() -> Vec<(String, usize, fn(&[u8]) -> usize)> {
            vec![$((
                v1::$t::full_name(),
                std::mem::size_of::<v1::$t>(),
                (|bytes: &[u8]| {
                    let before = CURRENT.load(Ordering::SeqCst);
                    PEAK.store(before, Ordering::SeqCst);
                    let decoded = v1::$t::decode(bytes).expect("the hostile message decodes");
                    let peak = PEAK.load(Ordering::SeqCst) - before;
                    release(decoded);
                    peak
                }) as fn(&[u8]) -> usize,
            )),*]
        }
    };
}

messages!(
    AgentMessage,
    ApprovalRequest,
    ApproveRequest,
    ApproveResponse,
    BlobChunk,
    BlobRef,
    BypassDecision,
    BypassRequest,
    CallEvent,
    CallFinished,
    CallOutput,
    CallRequest,
    CallResult,
    CallerPolicy,
    CancelCall,
    CatalogEvent,
    CatalogUpdate,
    CloseSessionResponse,
    CoordinatorMessage,
    CreateJoinTokenRequest,
    CreateJoinTokenResponse,
    Credit,
    DescribeToolRequest,
    Draining,
    FanOutEvent,
    FanOutRequest,
    FanOutSummary,
    FetchBlobRequest,
    FindToolsRequest,
    FindToolsResponse,
    GetCaBundleRequest,
    GetCaBundleResponse,
    GetSessionRequest,
    Goodbye,
    Hello,
    HostFacts,
    HostInfo,
    HostView,
    InvalidTool,
    JoinRequest,
    JoinResponse,
    JoinTokenInfo,
    Keepalive,
    ListApprovalsRequest,
    ListApprovalsResponse,
    ListHostsRequest,
    ListHostsResponse,
    ListJoinTokensRequest,
    ListJoinTokensResponse,
    ListRevocationsRequest,
    ListRevocationsResponse,
    ListSessionsRequest,
    ListSessionsResponse,
    ListToolsRequest,
    ListToolsResponse,
    LoadToolRequest,
    LoadedTool,
    OpenSessionRequest,
    OutputChunk,
    RenewRequest,
    RenewResponse,
    Revocation,
    RevokeJoinTokenRequest,
    RevokeJoinTokenResponse,
    RevokeRequest,
    RevokeResponse,
    SandboxFacts,
    SandboxGrant,
    SandboxPolicy,
    SessionHost,
    SessionProfile,
    SessionState,
    StartCall,
    ToolDefinition,
    ToolDocument,
    ToolMatch,
    ToolResolution,
    ToolStatus,
    UnloadToolRequest,
    UnrevokeRequest,
    UnrevokeResponse,
    WaitsForApproval,
    WatchCatalogRequest,
    Welcome,
);

/// The protocol's messages by full name, from the compiled-in descriptor set.
fn descriptors() -> HashMap<String, DescriptorProto> {
    fn collect(scope: &str, d: &DescriptorProto, out: &mut HashMap<String, DescriptorProto>) {
        let name = format!("{scope}.{}", d.name());
        for nested in &d.nested_type {
            collect(&name, nested, out);
        }
        out.insert(name, d.clone());
    }
    let set = FileDescriptorSet::decode(toolsrv_proto::FILE_DESCRIPTOR_SET).unwrap();
    let mut out = HashMap::new();
    for file in &set.file {
        for d in &file.message_type {
            collect(file.package(), d, &mut out);
        }
    }
    out
}

/// A field's key, as prost encodes it.
fn key(number: i32, wire: WireType) -> Vec<u8> {
    let mut out = Vec::new();
    prost::encoding::encode_key(u32::try_from(number).unwrap(), wire, &mut out);
    out
}

/// A length-delimited field.
fn delimited(number: i32, payload: &[u8]) -> Vec<u8> {
    let mut out = key(number, WireType::LengthDelimited);
    prost::encoding::encode_varint(payload.len() as u64, &mut out);
    out.extend_from_slice(payload);
    out
}

fn message_type<'d>(
    all: &'d HashMap<String, DescriptorProto>,
    f: &prost_types::FieldDescriptorProto,
) -> Option<&'d DescriptorProto> {
    (f.r#type() == Type::Message).then(|| &all[f.type_name().trim_start_matches('.')])
}

/// One entry of field `f`, as small as it gets (`filled` false) or with every text field of
/// the entry one byte long and every repeated field of it one entry long (`filled` true).
fn entry(
    all: &HashMap<String, DescriptorProto>,
    f: &prost_types::FieldDescriptorProto,
    filled: bool,
) -> Vec<u8> {
    match (message_type(all, f), f.r#type()) {
        (Some(d), _) => {
            let inner = if filled {
                fill(all, d, 0, b"a")
            } else {
                Vec::new()
            };
            delimited(f.number(), &inner)
        }
        (None, Type::String | Type::Bytes) => {
            delimited(f.number(), if filled { b"a" } else { b"" })
        }
        (None, Type::Double | Type::Fixed64 | Type::Sfixed64) => {
            let mut out = key(f.number(), WireType::SixtyFourBit);
            out.extend([0; 8]);
            out
        }
        (None, Type::Float | Type::Fixed32 | Type::Sfixed32) => {
            let mut out = key(f.number(), WireType::ThirtyTwoBit);
            out.extend([0; 4]);
            out
        }
        _ => {
            let mut out = key(f.number(), WireType::Varint);
            out.push(if filled { 1 } else { 0 });
            out
        }
    }
}

/// A message of type `d` with every text field one byte long, every repeated field one entry
/// long, and its message fields filled alike, `depth` levels down from 2.
fn fill(
    all: &HashMap<String, DescriptorProto>,
    d: &DescriptorProto,
    depth: usize,
    text: &[u8],
) -> Vec<u8> {
    let mut inner = Vec::new();
    for g in &d.field {
        match (message_type(all, g), g.r#type(), g.label()) {
            (Some(m), _, _) if depth < 2 => {
                inner.extend(delimited(g.number(), &fill(all, m, depth + 1, text)))
            }
            (Some(_), _, _) => inner.extend(delimited(g.number(), &[])),
            (None, Type::String | Type::Bytes, _) => inner.extend(delimited(g.number(), text)),
            (None, _, Label::Repeated) => {
                inner.extend(key(g.number(), WireType::Varint));
                inner.push(0);
            }
            _ => {}
        }
    }
    inner
}

/// Hostile encodings of `root`: for each repeated field within three levels, as many entries
/// of it as fit in about `bytes` (empty, filled, packed numbers), under parents given once or,
/// when a parent is repeated, many parents of one entry each.
fn shapes(
    all: &HashMap<String, DescriptorProto>,
    root: &str,
    bytes: usize,
) -> Vec<(String, Vec<u8>)> {
    // The message itself, filled.
    let mut out = vec![("(filled)".to_string(), fill(all, &all[root], 0, b"a"))];
    // Given again with longer texts: decoding reuses each field's buffer, and grows it.
    let mut again = fill(all, &all[root], 0, b"a");
    again.extend(fill(all, &all[root], 0, &[b'x'; 20]));
    again.extend(fill(all, &all[root], 0, &[b'y'; 21]));
    out.push(("(filled, then again with longer texts)".to_string(), again));
    let mut walk: Vec<(Vec<&prost_types::FieldDescriptorProto>, &DescriptorProto)> =
        vec![(Vec::new(), &all[root])];
    while let Some((path, d)) = walk.pop() {
        for f in &d.field {
            let mut here = path.clone();
            here.push(f);
            let names: Vec<&str> = here.iter().map(|f| f.name()).collect();
            let name = names.join(".");
            if f.label() == Label::Repeated {
                for filled in [false, true] {
                    let one = entry(all, f, filled);
                    let many: Vec<u8> = one.repeat((bytes / one.len()).max(1));
                    out.push((
                        format!("{name} ({})", if filled { "filled" } else { "empty" }),
                        wrap(&path, &many, 1),
                    ));
                    // Many parents of one entry each, where a parent is repeated.
                    if let Some(last) = path.last().filter(|p| p.label() == Label::Repeated) {
                        let parent = delimited(last.number(), &one);
                        let parents = parent.repeat((bytes / parent.len()).max(1));
                        out.push((
                            format!(
                                "{name} (one per parent, {})",
                                if filled { "filled" } else { "empty" }
                            ),
                            wrap(&path[..path.len() - 1], &parents, 1),
                        ));
                    }
                }
                if message_type(all, f).is_none()
                    && !matches!(f.r#type(), Type::String | Type::Bytes)
                {
                    out.push((
                        format!("{name} (packed)"),
                        wrap(&path, &delimited(f.number(), &vec![0; bytes]), 1),
                    ));
                }
            }
            if here.len() < 3
                && let Some(inner) = message_type(all, f)
                && !path.iter().any(|p| p.type_name() == f.type_name())
            {
                walk.push((here, inner));
            }
        }
    }
    out
}

/// `payload` wrapped in the message fields of `path`, innermost last, `times` each.
fn wrap(path: &[&prost_types::FieldDescriptorProto], payload: &[u8], times: usize) -> Vec<u8> {
    let mut out = payload.to_vec();
    for f in path.iter().rev() {
        out = delimited(f.number(), &out).repeat(times);
    }
    out
}

#[test]
fn what_is_counted_before_decoding_bounds_what_decoding_allocates() {
    let all = descriptors();
    let messages = messages();

    // Every message of the protocol is listed above, and counted at least its struct's size.
    let listed: BTreeSet<&str> = messages.iter().map(|(n, _, _)| n.as_str()).collect();
    let declared: BTreeSet<&str> = all
        .iter()
        .filter(|(_, d)| !d.options.as_ref().is_some_and(|o| o.map_entry()))
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(
        listed, declared,
        "every message of the protocol is in `messages!`"
    );
    for (name, size, _) in &messages {
        let counted = struct_bytes(name).unwrap();
        assert!(
            counted >= *size,
            "{name}: {counted} bytes counted for a struct of {size}"
        );
    }

    // Every hostile shape of every message: the count bounds the allocation.
    let mut cases = 0;
    let mut worst = (0.0f64, String::new());
    for (name, _, decode) in &messages {
        for (shape, bytes) in shapes(&all, name, 64 << 10) {
            let counted = decoded_bytes(name, &bytes)
                .unwrap_or_else(|| panic!("{name} {shape}: not counted"));
            let allocated = decode(&bytes);
            assert!(
                allocated <= counted,
                "{name}.{shape}: {} bytes allocated decoding {} bytes, {counted} counted",
                allocated,
                bytes.len()
            );
            let ratio = allocated as f64 / bytes.len() as f64;
            if ratio > worst.0 {
                worst = (ratio, format!("{name}.{shape}"));
            }
            cases += 1;
        }
    }
    assert!(cases > 250, "only {cases} shapes were tried");

    // Inputs the fuzzer found (`fuzz/fuzz_targets/decode_cost.rs`): a bytes field (copied out,
    // then into its vector), a string field given seven times (its buffer reused and grown);
    // and a message field given twice, whose second is decoded into the first, its string
    // growing.
    let found: [(&str, &str); 3] = [
        (
            "toolsrv.v1.OpenSessionRequest",
            "0a16121461616161616161616161616161616161616161610a171215626262626262626262626262\
             626262626262626262",
        ),
        ("toolsrv.v1.CallEvent", "0a0522001201060a001200"),
        (
            "toolsrv.v1.OpenSessionRequest",
            "121201005000122b12001200121212000000120012001200120012001200121a041010000000120012\
             001200120012001200120012001200122b",
        ),
    ];
    for (name, hex) in found {
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let (_, _, decode) = messages.iter().find(|(n, _, _)| n == name).unwrap();
        let counted = decoded_bytes(name, &bytes).unwrap();
        let allocated = decode(&bytes);
        assert!(
            allocated <= counted,
            "{name} (a known case): {allocated} allocated, {counted} counted"
        );
    }
    println!(
        "{cases} shapes; the most allocated per byte: {:.0} times, {}",
        worst.0, worst.1
    );

    // What the checks refuse, and what they let through.
    // 16 MiB of empty `HostView.tools` entries: 1.7 GB once decoded.
    let flood = delimited(2, &[0x12, 0x00].repeat((MAX_MESSAGE_BYTES - 16) / 2));
    let refused = check_named("toolsrv.v1.AgentMessage", &flood).unwrap_err();
    assert_eq!(
        refused.why,
        Why::TooLarge {
            field: "view.tools".into()
        }
    );
    assert_eq!(
        tonic::Status::from(refused.clone()).code(),
        tonic::Code::OutOfRange
    );
    let text = refused.to_string();
    assert!(
        text.contains("toolsrv.v1.AgentMessage") && text.contains("refused before decoding"),
        "{text}"
    );
    let output = v1::AgentMessage {
        msg: Some(v1::agent_message::Msg::Output(v1::CallOutput {
            call_id: 1,
            chunk: Some(v1::OutputChunk {
                stream: 1,
                data: vec![7; MAX_MESSAGE_BYTES - 64],
            }),
        })),
    };
    assert_eq!(
        check_named("toolsrv.v1.AgentMessage", &output.encode_to_vec()),
        Ok(())
    );
    for (bytes, what) in [
        (
            vec![0x12, 0x05, 0x00],
            "a value that runs past the end of its message",
        ),
        (vec![0x12, 0x80], "a length that ends early"),
        (
            vec![0x0b],
            "a group or unknown wire type, which no toolsrv message uses",
        ),
    ] {
        let refused = check_named("toolsrv.v1.AgentMessage", &bytes).unwrap_err();
        assert!(
            matches!(refused.why, Why::Malformed { what: w, .. } if w == what),
            "{refused}"
        );
        assert_eq!(tonic::Status::from(refused).code(), tonic::Code::Internal);
    }
}
