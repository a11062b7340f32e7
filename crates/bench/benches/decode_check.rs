//! What the check of a received message (`toolsrv_proto::cost`: what it would take once
//! decoded, read from its bytes) costs beside decoding it, for the messages the links carry
//! most: output chunks, view parts, list pages, catalog batches; and for a hostile message it
//! refuses, the time to refuse it against the time decoding it took before.

use std::hint::black_box;
use std::time::Instant;

use prost::{Message, Name};
use toolsrv_bench::stats::{Summary, Table, fmt_ns};
use toolsrv_bench::{BenchError, iterations, quick};
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::{
    AgentMessage, CallOutput, CatalogUpdate, CoordinatorMessage, HostView, ListToolsResponse,
    OutputChunk, ToolDefinition, ToolDocument, ToolStatus,
};

/// A visible tool as a host reports it: a description of a few lines, a prompt, an args schema.
fn tool(i: usize) -> ToolStatus {
    let name = format!("tool_{i:05}");
    ToolStatus {
        name: name.clone(),
        visible: true,
        variant: Some(0),
        description: "Shows how full each mounted filesystem is, largest first".into(),
        definition: Some(ToolDefinition {
            name,
            description: "Shows how full each mounted filesystem is, largest first".into(),
            prompt: "Use when the user asks about disk space; pass a path to narrow it.".into(),
            args_schema_json: r#"{"type":"object","properties":{"path":{"type":"string"}}}"#.into(),
            keywords: vec!["disk".into(), "space".into(), "df".into()],
            ..ToolDefinition::default()
        }),
        ..ToolStatus::default()
    }
}

/// Tools until their encoded size reaches `bytes`.
fn tools(bytes: usize) -> Vec<ToolStatus> {
    let mut out = Vec::new();
    let mut size = 0;
    while size < bytes {
        let t = tool(out.len());
        size += t.encoded_len();
        out.push(t);
    }
    out
}

/// Times `f` over `samples` runs of `inner` calls each; per call.
fn time(samples: usize, inner: usize, mut f: impl FnMut()) -> Option<Summary> {
    let mut runs = Vec::new();
    for _ in 0..samples {
        let start = Instant::now();
        for _ in 0..inner {
            f();
        }
        runs.push(start.elapsed());
    }
    Summary::of(&runs).map(|s| s.per(inner as f64))
}

fn row<M: Message + Name + Default>(table: &mut Table, label: &str, encoded: &[u8], inner: usize) {
    let samples = iterations(15, 3);
    let check = time(samples, inner, || {
        black_box(toolsrv_proto::cost::check::<M>(black_box(encoded)).is_ok());
    });
    let decode = time(samples, inner, || {
        black_box(M::decode(black_box(encoded)).is_ok());
    });
    let (Some(check), Some(decode)) = (check, decode) else {
        return;
    };
    table.row([
        label.to_string(),
        encoded.len().to_string(),
        fmt_ns(check.median),
        fmt_ns(decode.median),
        format!("{:.1} %", 100.0 * check.median / decode.median),
    ]);
}

fn main() -> Result<(), BenchError> {
    println!(
        "decode_check: the check of a received message beside its decoding{}",
        if quick() { " (BENCH_QUICK)" } else { "" }
    );
    let mut table = Table::new([
        "message",
        "bytes",
        "check, median",
        "decode, median",
        "check / decode",
    ]);
    let output = |size: usize| AgentMessage {
        msg: Some(Out::Output(CallOutput {
            call_id: 7,
            chunk: Some(OutputChunk {
                stream: 1,
                data: vec![b'x'; size],
            }),
        })),
    };
    row::<AgentMessage>(
        &mut table,
        "output chunk, 1 KiB",
        &output(1 << 10).encode_to_vec(),
        2000,
    );
    row::<AgentMessage>(
        &mut table,
        "output chunk, 64 KiB",
        &output(64 << 10).encode_to_vec(),
        200,
    );
    let part = AgentMessage {
        msg: Some(Out::View(HostView {
            catalog_revision: 3,
            tools: tools(1 << 20),
            more: true,
        })),
    };
    row::<AgentMessage>(
        &mut table,
        "view part, 1 MiB of tools",
        &part.encode_to_vec(),
        3,
    );
    let page = ListToolsResponse {
        tools: tools(1 << 20),
        ..ListToolsResponse::default()
    };
    row::<ListToolsResponse>(
        &mut table,
        "ListTools page, 1 MiB",
        &page.encode_to_vec(),
        3,
    );
    let batch = CoordinatorMessage {
        msg: Some(In::Catalog(CatalogUpdate {
            revision: 3,
            full: true,
            upserts: (0..40)
                .map(|i| ToolDocument {
                    name: format!("tool_{i}"),
                    meta: vec![b'm'; 400],
                    meta_sha256: "0".repeat(64),
                    executable: None,
                })
                .collect(),
            removals: Vec::new(),
            more: true,
        })),
    };
    row::<CoordinatorMessage>(
        &mut table,
        "catalog batch, 40 tools",
        &batch.encode_to_vec(),
        200,
    );
    print!("{}", table.render());

    // Hostile view parts of empty entries: the check refuses them; decoding took memory.
    let flood = |bytes: usize| {
        let tools = [0x12u8, 0x00].repeat(bytes / 2);
        let mut out = vec![0x12];
        prost::encoding::encode_varint(tools.len() as u64, &mut out);
        out.extend(tools);
        out
    };
    let big = flood((16 << 20) - 16);
    let start = Instant::now();
    let refused = toolsrv_proto::cost::check::<AgentMessage>(&big).is_err();
    println!(
        "16 MiB of empty view entries: refused {refused} by the check in {}",
        fmt_ns(start.elapsed().as_nanos() as f64)
    );
    let small = flood(1 << 20);
    let start = Instant::now();
    let refused = toolsrv_proto::cost::check::<AgentMessage>(&small).is_err();
    let check = start.elapsed();
    let start = Instant::now();
    let decoded = AgentMessage::decode(small.as_slice()).map(|m| match m.msg {
        Some(Out::View(v)) => v.tools.capacity() * std::mem::size_of::<ToolStatus>(),
        _ => 0,
    });
    let decode = start.elapsed();
    println!(
        "1 MiB of them: refused {refused} by the check in {}; decoding them takes {} and {} MB",
        fmt_ns(check.as_nanos() as f64),
        fmt_ns(decode.as_nanos() as f64),
        decoded.unwrap_or(0) >> 20
    );
    Ok(())
}
