//! Section `unread`: what answers nobody reads hold in a coordinator. One client makes 1,000
//! `ListTools` requests of about 1 MiB each (a host of 20 tools with long prompts) on one HTTP/2
//! connection whose streams give the coordinator a window of 0 bytes (or 1) and read nothing,
//! once with no budget of answer bytes (`--max-buffered-bytes-per-identity=0`) and once with the
//! default (256 MiB). It reports how many answers wait and how many were cut short, and the
//! coordinator's resident memory before, at its peak, while the answers are held, and after the
//! connection is gone. Then requests whose message never ends, and answers queued for peers that
//! open the largest windows and stop reading their sockets.

use std::time::Duration;

use toolsrv_bench::BenchError;
use toolsrv_bench::procs::{
    Paths, connect, mem_of, start_agent, start_coordinator_on, wait_for_tool,
};
use toolsrv_bench::stats::Table;
use toolsrv_testkit::try_free_port;

use super::{CALL_AGENT, Sizes, mib};

/// Requests made, under the default `--max-requests-per-identity` (1,024).
const REQUESTS: usize = 1000;
/// Tools of the host, and the bytes of each one's prompt: one `ListTools` page of about 1 MiB.
const TOOLS: usize = 20;
const PROMPT_BYTES: usize = 48_000;

pub(crate) async fn unread(paths: &Paths, _sizes: Sizes) -> Result<(), BenchError> {
    let tools = paths.work.join("tools-unread");
    let last = long_tools(&tools, TOOLS)?;
    let tls = toolsrv_tls::client_config(&paths.client_tls(), toolsrv_tls::Role::Coordinator)?;
    println!(
        "\nunread: {REQUESTS} ListTools requests of one page each, on one connection whose \
         streams open a window of 0 or 1 byte and read nothing"
    );
    let mut table = Table::new([
        "window",
        "--max-buffered-bytes-per-identity",
        "answers waiting",
        "cut short",
        "other ends",
        "RSS before",
        "peak",
        "RSS while held",
        "RSS after",
    ]);
    for (window, budget) in [(0, "0"), (0, "256M"), (1, "0"), (1, "256M")] {
        let port = try_free_port()?;
        let coordinator = start_coordinator_on(
            paths,
            &format!("coordinator-unread-{window}-{budget}"),
            &tools,
            (port, "warn"),
            &[format!("--max-buffered-bytes-per-identity={budget}")],
        )?;
        let agent = start_agent(paths, &coordinator.url, CALL_AGENT, &[])?;
        let client = connect(paths, &coordinator.url).await?;
        wait_for_tool(&client, CALL_AGENT, &last, Duration::from_secs(30)).await?;
        let page = client.tools(CALL_AGENT, false).await?;
        let pid = coordinator.proc.pid().to_string();
        let before = mem_of(&pid)?;
        let mut host = vec![0x0a, u8::try_from(CALL_AGENT.len())?];
        host.extend_from_slice(CALL_AGENT.as_bytes());
        let unread = toolsrv_testkit::open_unread_answers(
            port,
            tls.clone(),
            "/toolsrv.v1.Tools/ListTools",
            &host,
            REQUESTS,
            window,
            Duration::from_secs(300),
        )
        .await;
        let held = mem_of(&pid)?;
        let cut = unread
            .ended
            .iter()
            .filter(|(status, message)| status == "8" && message.contains("of%20answers"))
            .count();
        let (waiting, others) = (unread.waiting, unread.ended.len() - cut);
        let mut kinds: Vec<&(String, String)> = unread
            .ended
            .iter()
            .filter(|(status, message)| !(status == "8" && message.contains("of%20answers")))
            .collect();
        kinds.dedup();
        if !kinds.is_empty() {
            println!("(window {window}, {budget}: other ends: {kinds:?})");
        }
        drop(unread);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let after = mem_of(&pid)?;
        table.row([
            window.to_string(),
            budget.to_string(),
            waiting.to_string(),
            cut.to_string(),
            others.to_string(),
            mib(before.rss_kib),
            mib(after.hwm_kib),
            mib(held.rss_kib),
            mib(after.rss_kib),
        ]);
        if page.tools.len() != TOOLS {
            return Err(format!("the host lists {} tools, not {TOOLS}", page.tools.len()).into());
        }
        drop((client, agent, coordinator));
    }
    println!("{}", table.render());
    unfinished(paths, &tools, tls.clone()).await?;
    stalled(paths, tls).await
}

/// Answers queued for peers that open the largest windows and then stop reading their sockets:
/// 8 connections of one client, each making 1,000 `ListTools` requests of a page of about 300 KB
/// (under HTTP/2's send buffer of 400 KiB a stream, which hyper takes whole at once), with no
/// limits (`--max-requests-per-identity=0 --max-buffered-bytes-per-identity=0`) and with the
/// defaults (1,024 requests, 256 MiB).
async fn stalled(
    paths: &Paths,
    tls: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
) -> Result<(), BenchError> {
    const CONNECTIONS: usize = 8;
    const PER_CONNECTION: usize = 1000;
    let tools = paths.work.join("tools-stalled");
    let last = long_tools(&tools, 6)?;
    println!(
        "\nunread: {CONNECTIONS} connections of one client, {PER_CONNECTION} ListTools requests \
         each of a page of about 300 KB, the largest windows opened and the socket not read"
    );
    let mut table = Table::new([
        "limits",
        "read whole",
        "cut short",
        "other ends",
        "RSS before",
        "RSS after 5 s",
        "peak",
    ]);
    let limits = [
        (
            "none",
            vec![
                "--max-requests-per-identity=0".to_string(),
                "--max-buffered-bytes-per-identity=0".to_string(),
            ],
        ),
        ("defaults", Vec::new()),
    ];
    for (name, flags) in limits {
        let port = try_free_port()?;
        let coordinator = start_coordinator_on(
            paths,
            &format!("coordinator-stalled-{name}"),
            &tools,
            (port, "warn"),
            &flags,
        )?;
        let agent = start_agent(paths, &coordinator.url, CALL_AGENT, &[])?;
        let client = connect(paths, &coordinator.url).await?;
        wait_for_tool(&client, CALL_AGENT, &last, Duration::from_secs(30)).await?;
        let pid = coordinator.proc.pid().to_string();
        let before = mem_of(&pid)?;
        let mut host = vec![0x0a, u8::try_from(CALL_AGENT.len())?];
        host.extend_from_slice(CALL_AGENT.as_bytes());
        let mut peers = Vec::new();
        for _ in 0..CONNECTIONS {
            let mut peer = toolsrv_testkit::StalledPeer::connect(port, tls.clone()).await;
            peer.stop_reading();
            peer.request("/toolsrv.v1.Tools/ListTools", &host, PER_CONNECTION)
                .await;
            peers.push(peer);
        }
        // Within HTTP/2 keepalive (a ping every 10 s, answered within 5 s), which would end the
        // connections.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let held = mem_of(&pid)?;
        let (mut whole, mut cut, mut others) = (0, 0, Vec::new());
        for peer in &mut peers {
            peer.read_again();
        }
        for peer in &mut peers {
            let outcomes = peer.outcomes(Duration::from_secs(120)).await;
            whole += outcomes.whole;
            for (status, message) in outcomes.ended {
                if status == "8" {
                    cut += 1;
                } else {
                    others.push((status, message));
                }
            }
        }
        let after = mem_of(&pid)?;
        let other_ends = others.len();
        others.sort();
        others.dedup();
        for (status, message) in &others {
            println!("({name}: also ended with {status}: {message:.160})");
        }
        table.row([
            name.to_string(),
            whole.to_string(),
            cut.to_string(),
            other_ends.to_string(),
            mib(before.rss_kib),
            mib(held.rss_kib),
            mib(after.hwm_kib),
        ]);
        drop((peers, client, agent, coordinator));
    }
    println!("{}", table.render());
    Ok(())
}

/// `count` tools `long00`, `long01`, ... in `dir`, each with a prompt of about [`PROMPT_BYTES`];
/// the name of the last.
fn long_tools(dir: &std::path::Path, count: usize) -> Result<String, BenchError> {
    std::fs::create_dir_all(dir)?;
    let prompt = "the answer of this tool is long. ".repeat(PROMPT_BYTES / 32);
    for i in 0..count {
        let meta = serde_json::json!({
            "description": "a tool with a long prompt",
            "prompt": prompt,
            "cmd": "true",
        });
        std::fs::write(dir.join(format!("long{i:02}.meta")), meta.to_string())?;
    }
    Ok(format!("long{:02}", count - 1))
}

/// Requests whose message never ends: 64 `ListHosts` requests, each announcing a message of 16
/// MiB and sending all of it but its last byte, with no budget and with the default.
async fn unfinished(
    paths: &Paths,
    tools: &std::path::Path,
    tls: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
) -> Result<(), BenchError> {
    const STREAMS: usize = 64;
    const ANNOUNCED: u32 = 16 << 20;
    let mut sent = toolsrv_testkit::grpc_prefix(ANNOUNCED).to_vec();
    sent.resize(5 + ANNOUNCED as usize - 1, b'x');
    let sent = bytes::Bytes::from(sent);
    println!(
        "\nunread: {STREAMS} ListHosts requests announcing a message of 16 MiB, all of it sent \
         but its last byte"
    );
    let mut table = Table::new([
        "--max-buffered-bytes-per-identity",
        "requests waiting",
        "ended",
        "RSS before",
        "peak",
    ]);
    for budget in ["0", "256M"] {
        let port = try_free_port()?;
        let coordinator = start_coordinator_on(
            paths,
            &format!("coordinator-unfinished-{budget}"),
            tools,
            (port, "warn"),
            &[format!("--max-buffered-bytes-per-identity={budget}")],
        )?;
        let pid = coordinator.proc.pid().to_string();
        let before = mem_of(&pid)?;
        let streams = toolsrv_testkit::open_unfinished_streams(
            port,
            tls.clone(),
            "/toolsrv.v1.Tools/ListHosts",
            sent.clone(),
            STREAMS,
            Duration::from_secs(30),
        )
        .await;
        let peak = mem_of(&pid)?;
        table.row([
            budget.to_string(),
            streams.taken.to_string(),
            streams.refused.to_string(),
            mib(before.rss_kib),
            mib(peak.hwm_kib),
        ]);
        for (status, message) in &streams.answers {
            println!("({budget}: ended with grpc-status {status}: {message:.160})");
        }
        drop((streams, coordinator));
    }
    println!("{}", table.render());
    Ok(())
}
