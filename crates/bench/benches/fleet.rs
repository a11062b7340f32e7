//! Fleet benchmarks: real `toolsrv coordinator` and `toolsrv agent` processes on 127.0.0.1 (release
//! builds), the library client, `toolctl`, `ssh` as the baseline, and a load generator standing in
//! for many hosts (`toolsrv_testkit::fake`).
//!
//! Run it through `crates/bench/fleet-bench.sh`, which builds the binaries, writes the PKI, sets up
//! sshd and tears everything down. Environment: `FLEET_BIN_DIR` (default: next to this bench's
//! executable), `FLEET_PKI` (default: a fresh PKI written here), `FLEET_EXAMPLES`, `FLEET_WORK`,
//! `FLEET_SSH_CONFIG` + `FLEET_SSH_HOST` or `FLEET_SSH_SKIP`, `FLEET_ONLY=latency,concurrency,
//! fanout,stream,memory,replicas,scale,failover,find,unread` (`scale`, `failover` and `find` run only
//! when named: `FLEET_SCALE_AGENTS`, default 10,000, `FLEET_SCALE_PARALLEL`,
//! `FLEET_SCALE_KEEPALIVE_MS`, `FLEET_SCALE_RUNS`; `FLEET_REPLICA_AGENTS`, default 3,000; `find`
//! takes the encoder from `TOOLSRV_FIND_MODEL` and `FLEET_FIND_HOSTS`, default 10),
//! `BENCH_QUICK=1`.

// In a directory of its own: a file beside this one would be a bench target of its own.
#[path = "fleet/failover.rs"]
mod failover;
#[path = "fleet/find.rs"]
mod find;
// The made-up tools of `toolsrv-find`'s benchmark, served here by a real coordinator.
#[path = "../../find/tests/common/generated.rs"]
mod find_catalog;
#[path = "fleet/replicas.rs"]
mod replicas;
#[path = "fleet/scale.rs"]
mod scale;
#[path = "fleet/unread.rs"]
mod unread;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use toolsrv_bench::call::{CallFixture, SpawnSetup, direct_spawn};
use toolsrv_bench::messages::message_sizes;
use toolsrv_bench::procs::{
    self, CLIENT, Mem, MemSampler, Paths, ProcMem, connect, cpu_of, mem_of, raise_nofile,
    reset_own_peak, start_agent, start_coordinator, wait_for_tool, write_tools,
};
use toolsrv_bench::remote::{
    BARE_SCRIPT, Route, SshTarget, concurrent_calls, connect_and_list, fan_out, library_call,
    spawn_floor, ssh_call, start_master, stream_call, toolctl_call, toolctl_parts,
};
use toolsrv_bench::stats::{Summary, Table, fmt_ns, fmt_rate};
use toolsrv_bench::{BenchError, iterations, quick};
use toolsrv_client::{Client, HostState};
use toolsrv_testkit::Proc;
use toolsrv_testkit::fake::{Connected, Definitions, FAKE_LABEL, FakeAgents, fake_id};

/// The trivial tool every latency figure calls: reads its arguments, answers `ok`.
const ECHO: &str = "echo_ok";
/// The barest tool (`echo ok`), for the comparison with ssh.
const BARE: &str = "say_ok";
/// The streaming tool.
const ZEROS: &str = "zeros";
/// Agent ids of the real agents.
const CALL_AGENT: &str = "real-1";
const DEFAULT_AGENT: &str = "real-16";
const STREAM_AGENT: &str = "real-stream";
const IDLE_AGENT: &str = "real-idle";

fn main() -> Result<(), BenchError> {
    toolsrv_tls::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run())
}

/// Sizes of a run.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    ssh_pairs: usize,
    lib_pairs: usize,
    concurrent_for: Duration,
    fanout_agents: usize,
    fanout_reps: usize,
    stream_bytes: u64,
    stream_reps: usize,
    memory_agents: usize,
    settle: Duration,
    scale_agents: usize,
}

/// Whether `FLEET_ONLY` names section `name`.
fn named(name: &str) -> bool {
    std::env::var("FLEET_ONLY").is_ok_and(|only| only.split(',').any(|o| o == name))
}

fn sizes() -> Result<Sizes, BenchError> {
    let mut sizes = default_sizes();
    if let Ok(n) = std::env::var("FLEET_SCALE_AGENTS") {
        sizes.scale_agents = n
            .parse()
            .map_err(|e| format!("FLEET_SCALE_AGENTS={n}: not a number: {e}"))?;
    }
    Ok(sizes)
}

fn default_sizes() -> Sizes {
    if quick() {
        Sizes {
            ssh_pairs: 20,
            lib_pairs: 100,
            concurrent_for: Duration::from_secs(2),
            fanout_agents: 50,
            fanout_reps: 5,
            stream_bytes: 64 << 20,
            stream_reps: 1,
            memory_agents: 50,
            settle: Duration::from_secs(2),
            scale_agents: 200,
        }
    } else {
        Sizes {
            ssh_pairs: 300,
            lib_pairs: 1000,
            concurrent_for: Duration::from_secs(10),
            fanout_agents: 200,
            fanout_reps: 20,
            stream_bytes: 1 << 30,
            stream_reps: 3,
            memory_agents: 1000,
            settle: Duration::from_secs(8),
            scale_agents: 10_000,
        }
    }
}

const HEADER: [&str; 7] = ["", "n", "median", "p90", "p99", "min", "max"];

fn row(table: &mut Table, label: &str, samples: &[Duration]) -> Option<Summary> {
    let s = Summary::of(samples)?;
    table.row(
        [label.to_string()]
            .into_iter()
            .chain(s.cells())
            .chain([fmt_ns(s.max)]),
    );
    Some(s)
}

fn verdict(met: bool) -> &'static str {
    if met { "MET" } else { "NOT met" }
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name).map(PathBuf::from)
}

/// Holds the scratch directory and PKI alive for the run.
#[derive(Debug)]
struct Setup {
    paths: Paths,
    _scratch: Option<tempfile::TempDir>,
}

fn setup(sizes: &Sizes) -> Result<Option<Setup>, BenchError> {
    let Some(bin_dir) = env_path("FLEET_BIN_DIR").or_else(procs::default_bin_dir) else {
        return Ok(None);
    };
    for bin in ["toolsrv", "toolctl"] {
        if !bin_dir.join(bin).exists() {
            println!(
                "fleet: SKIPPED: {} is missing; run crates/bench/fleet-bench.sh \
                 (it builds the release binaries first), or set FLEET_BIN_DIR",
                bin_dir.join(bin).display()
            );
            return Ok(None);
        }
    }
    let (work, scratch) = match env_path("FLEET_WORK") {
        Some(dir) => (dir, None),
        None => {
            let dir = tempfile::tempdir()?;
            (dir.path().to_path_buf(), Some(dir))
        }
    };
    let pki = match env_path("FLEET_PKI") {
        Some(pki) => pki,
        None => {
            let pki = work.join("pki");
            let mut opts = toolsrv_tls::PkiOptions::new(&pki);
            opts.agents = [CALL_AGENT, DEFAULT_AGENT, STREAM_AGENT, IDLE_AGENT]
                .map(String::from)
                .into_iter()
                .chain(
                    (0..sizes
                        .memory_agents
                        .max(sizes.fanout_agents)
                        .max(if named("scale") {
                            sizes.scale_agents
                        } else {
                            0
                        })
                        .max(if named("failover") {
                            failover::agents().unwrap_or(0)
                        } else {
                            0
                        }))
                        .map(fake_id),
                )
                .collect();
            opts.clients = vec![CLIENT.into()];
            println!("writing a PKI with {} agents...", opts.agents.len());
            toolsrv_tls::init(&opts)?;
            pki
        }
    };
    let examples = env_path("FLEET_EXAMPLES")
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/tools"));
    Ok(Some(Setup {
        paths: Paths {
            bin_dir,
            pki,
            examples,
            work,
        },
        _scratch: scratch,
    }))
}

async fn run() -> Result<(), BenchError> {
    let sizes = sizes()?;
    let nofile = raise_nofile()?;
    let Some(setup) = setup(&sizes)? else {
        return Ok(());
    };
    let paths = &setup.paths;
    let only = std::env::var("FLEET_ONLY").unwrap_or_default();
    // `scale` and `failover` need a PKI with as many stand-in hosts and minutes, `find` the
    // encoder's files: only when named.
    let wanted =
        |s: &str| (only.is_empty() && !["scale", "failover", "find"].contains(&s)) || named(s);
    println!(
        "fleet{}: binaries {}, open-file limit {nofile}, {} cores",
        if quick() { " (BENCH_QUICK)" } else { "" },
        paths.bin_dir.display(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    let mut failures = Vec::new();
    let sections: [(&str, Section); 10] = [
        ("latency", |p, s| {
            Box::pin(latency_and_concurrency(p, s, true))
        }),
        ("concurrency", |p, s| {
            Box::pin(latency_and_concurrency(p, s, false))
        }),
        ("fanout", |p, s| Box::pin(fanout(p, s))),
        ("stream", |p, s| Box::pin(stream(p, s))),
        ("memory", |p, s| Box::pin(memory(p, s))),
        ("scale", |p, s| Box::pin(scale::scale(p, s))),
        ("replicas", |p, s| Box::pin(replicas::replicas(p, s))),
        ("failover", |p, s| Box::pin(failover::failover(p, s))),
        ("find", |p, s| Box::pin(find::find(p, s))),
        ("unread", |p, s| Box::pin(unread::unread(p, s))),
    ];
    for (name, section) in sections {
        if !wanted(name) {
            continue;
        }
        println!("\n=== {name} ===");
        let started = Instant::now();
        if let Err(e) = section(paths, sizes).await {
            println!("{name}: FAILED: {e}");
            failures.push(name);
        }
        println!("({name}: {:.1} s)", started.elapsed().as_secs_f64());
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("sections failed: {}", failures.join(", ")).into())
    }
}

type Section = for<'a> fn(
    &'a Paths,
    Sizes,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<(), BenchError>> + 'a>,
>;

/// A coordinator serving the bench tools, with the agents of sections 1 and 2.
async fn call_fleet(
    paths: &Paths,
    extra_agent: Option<(&str, Vec<String>)>,
) -> Result<(procs::Coordinator, Vec<Proc>, Client), BenchError> {
    let tools = paths.work.join("tools-calls");
    write_tools(&tools, &[(ECHO, remote_script()), (BARE, BARE_SCRIPT)])?;
    let coordinator = start_coordinator(paths, "coordinator-calls", &tools)?;
    let mut agents = vec![start_agent(
        paths,
        &coordinator.url,
        CALL_AGENT,
        &["--max-concurrent-calls=64".to_string()],
    )?];
    if let Some((id, args)) = &extra_agent {
        agents.push(start_agent(paths, &coordinator.url, id, args)?);
    }
    let client = connect(paths, &coordinator.url).await?;
    wait_for_tool(&client, CALL_AGENT, ECHO, Duration::from_secs(30)).await?;
    if let Some((id, _)) = &extra_agent {
        wait_for_tool(&client, id, ECHO, Duration::from_secs(30)).await?;
    }
    Ok((coordinator, agents, client))
}

fn remote_script() -> &'static str {
    toolsrv_bench::remote::SCRIPT
}

/// Item 1 (latency, `latency == true`) or item 2 (64 concurrent callers).
async fn latency_and_concurrency(
    paths: &Paths,
    sizes: Sizes,
    latency: bool,
) -> Result<(), BenchError> {
    let extra = (!latency).then(|| (DEFAULT_AGENT, Vec::new()));
    let (_coordinator, _agents, client) = call_fleet(paths, extra).await?;
    if latency {
        ssh_vs_toolctl(paths, &_coordinator.url, sizes).await?;
        library_vs_local(&client, sizes).await
    } else {
        let pids = [
            (
                "coordinator".to_string(),
                _coordinator.proc.pid().to_string(),
            ),
            (format!("agent {CALL_AGENT}"), _agents[0].pid().to_string()),
            (
                format!("agent {DEFAULT_AGENT}"),
                _agents[1].pid().to_string(),
            ),
            ("callers (bench process)".to_string(), "self".to_string()),
        ];
        concurrency(&client, sizes, &pids).await
    }
}

async fn ssh_vs_toolctl(paths: &Paths, url: &str, sizes: Sizes) -> Result<(), BenchError> {
    let ssh = SshTarget::from_env();
    if let Err(reason) = &ssh {
        println!("ssh comparison SKIPPED: {reason}");
    }
    let (_master, socket) = start_master(paths, url).await?;
    for (tool, script) in [(ECHO, remote_script()), (BARE, BARE_SCRIPT)] {
        println!(
            "\n1a. `toolctl call {CALL_AGENT} {tool}` (fresh process per call; its own connection, \
             and through a `toolctl master`) vs `ssh HOST '{script}'` over a ControlMaster \
             connection; interleaved, order rotating"
        );
        let routes = [Route::Direct(url), Route::Master(&socket)];
        for _ in 0..5 {
            for route in routes {
                toolctl_call(paths, route, CALL_AGENT, tool).await?;
            }
            if let Ok(ssh) = &ssh {
                ssh_call(ssh, script).await?;
            }
        }
        // samples[0]: direct, [1]: through the master, [2]: ssh.
        let mut samples: [Vec<Duration>; 3] = Default::default();
        for i in 0..sizes.ssh_pairs {
            for k in 0..3 {
                let which = (i + k) % 3;
                let took = match (which, &ssh) {
                    (0 | 1, _) => toolctl_call(paths, routes[which], CALL_AGENT, tool).await?,
                    (_, Ok(ssh)) => ssh_call(ssh, script).await?,
                    (_, Err(_)) => continue,
                };
                samples[which].push(took);
            }
        }
        let mut table = Table::new(HEADER);
        let direct = row(&mut table, "toolctl call, own connection", &samples[0]);
        let master = row(&mut table, "toolctl call, via toolctl master", &samples[1]);
        let s = row(&mut table, "ssh over ControlMaster", &samples[2]);
        print!("{}", table.render());
        for (what, t) in [("own connection", direct), ("via toolctl master", master)] {
            match (t, &s) {
                (Some(t), Some(s)) => {
                    let ratio = s.median / t.median;
                    println!(
                        "goal: toolctl ({what}) at least 3x faster than ssh at the median -> {} \
                         (ssh/toolctl = {ratio:.2}x; p90 ratio {:.2}x)",
                        verdict(ratio >= 3.0),
                        s.p90 / t.p90
                    );
                }
                _ => println!(
                    "goal: toolctl ({what}) at least 3x faster than ssh -> NOT MEASURED (ssh skipped)"
                ),
            }
        }
    }

    println!("\n1a. breakdown of a fresh toolctl process");
    let mut parts: [Vec<Duration>; 5] = Default::default();
    for _ in 0..iterations(100, 10) {
        let (version, hosts) = toolctl_parts(paths, Route::Direct(url)).await?;
        parts[0].push(version);
        parts[1].push(hosts);
        parts[2].push(toolctl_parts(paths, Route::Master(&socket)).await?.1);
        parts[3].push(spawn_floor().await?);
        parts[4].push(connect_and_list(paths, url).await?);
    }
    let mut table = Table::new(HEADER);
    row(&mut table, "toolctl --version (start+exit only)", &parts[0]);
    row(&mut table, "toolctl hosts (certs+TLS+1 RPC)", &parts[1]);
    row(&mut table, "toolctl hosts via master (1 RPC)", &parts[2]);
    row(&mut table, "/bin/true (spawn floor)", &parts[3]);
    row(&mut table, "in-process: certs+TLS+1 RPC", &parts[4]);
    print!("{}", table.render());
    Ok(())
}

/// Times `n` pairs `pair(first)` of two measurements (the order alternating, after 20 pairs of
/// warm-up) and prints their table with the per-pair difference (first minus second);
/// their summaries and the difference's.
async fn paired<F, Fut>(
    n: usize,
    labels: [&str; 2],
    mut pair: F,
) -> Result<(Option<Summary>, Option<Summary>, Option<Summary>), BenchError>
where
    F: FnMut(bool) -> Fut,
    Fut: std::future::Future<Output = Result<(Duration, Duration), BenchError>>,
{
    for i in 0..20 {
        pair(i % 2 == 0).await?;
    }
    let (mut first, mut second, mut diff) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let (a, b) = pair(i % 2 == 0).await?;
        first.push(a);
        second.push(b);
        diff.push(a.as_nanos() as f64 - b.as_nanos() as f64);
    }
    let mut table = Table::new(HEADER);
    let a = row(&mut table, labels[0], &first);
    let b = row(&mut table, labels[1], &second);
    let d = Summary::of_nanos(&diff);
    if let Some(s) = &d {
        table.row([
            "difference per pair".to_string(),
            s.n.to_string(),
            fmt_ns(s.median),
            fmt_ns(s.p90),
            fmt_ns(s.p99),
            fmt_ns(s.min),
            fmt_ns(s.max),
        ]);
    }
    print!("{}", table.render());
    Ok((a, b, d))
}

async fn library_vs_local(client: &Client, sizes: Sizes) -> Result<(), BenchError> {
    println!(
        "\n1b. library `Client::call_to_end` on one open connection vs tokio::process `/bin/sh -c` \
         locally, interleaved pairs, order alternating"
    );
    let fixture = CallFixture::new()?;
    let pair = |first_lib: bool| {
        let fixture = &fixture;
        async move {
            let (lib, local) = if first_lib {
                let l = library_call(client, CALL_AGENT, ECHO).await?;
                (
                    l,
                    direct_spawn(fixture, SpawnSetup::default()).await?.finished,
                )
            } else {
                let d = direct_spawn(fixture, SpawnSetup::default()).await?.finished;
                (library_call(client, CALL_AGENT, ECHO).await?, d)
            };
            Ok::<_, BenchError>((lib, local))
        }
    };
    let (l, d, pd) = paired(
        sizes.lib_pairs,
        [
            "library call_to_end (remote agent)",
            "local tokio::process spawn",
        ],
        pair,
    )
    .await?;
    if let (Some(l), Some(d), Some(pd)) = (l, d, pd) {
        let gap = l.median - d.median;
        println!(
            "goal: library within 1 ms of local at the median -> {} (medians differ by {}; \
             median per-pair difference {})",
            verdict(gap < 1e6 && pd.median < 1e6),
            fmt_ns(gap),
            fmt_ns(pd.median)
        );
    }
    Ok(())
}

async fn concurrency(
    client: &Client,
    sizes: Sizes,
    pids: &[(String, String)],
) -> Result<(), BenchError> {
    let callers = 64;
    println!(
        "\n2. {callers} concurrent callers, library, one shared connection, `{ECHO}` for {:?}",
        sizes.concurrent_for
    );
    let mut table = Table::new(["agent", "calls", "calls/s", "median", "p90", "p99", "max"]);
    let mut cpu = Table::new([
        "agent",
        "process",
        "CPU own",
        "CPU children (tools)",
        "per call",
    ]);
    for (agent, label) in [
        (CALL_AGENT, "--max-concurrent-calls 64"),
        (DEFAULT_AGENT, "default (16)"),
    ] {
        concurrent_calls(client, agent, ECHO, callers, Duration::from_millis(500)).await?;
        let cpu_before: Vec<_> = pids
            .iter()
            .map(|(_, p)| cpu_of(p))
            .collect::<Result<_, _>>()?;
        let t = concurrent_calls(client, agent, ECHO, callers, sizes.concurrent_for).await?;
        let secs = t.elapsed.as_secs_f64();
        let mut total = 0.0;
        for ((name, pid), before) in pids.iter().zip(&cpu_before) {
            let (own, children) = cpu_of(pid)?;
            let own = own.saturating_sub(before.0).as_secs_f64();
            let children = children.saturating_sub(before.1).as_secs_f64();
            total += own + children;
            cpu.row([
                label.to_string(),
                name.clone(),
                format!("{:.0} %", own / secs * 100.0),
                format!("{:.0} %", children / secs * 100.0),
                format!("{:.0} µs", (own + children) / t.calls.max(1) as f64 * 1e6),
            ]);
        }
        cpu.row([
            label.to_string(),
            "all of the above".to_string(),
            format!("{:.0} %", total / secs * 100.0),
            String::new(),
            format!("{:.0} µs", total / t.calls.max(1) as f64 * 1e6),
        ]);
        let s = Summary::of(&t.latencies).ok_or("no calls")?;
        table.row([
            label.to_string(),
            t.calls.to_string(),
            fmt_rate(t.per_sec()),
            fmt_ns(s.median),
            fmt_ns(s.p90),
            fmt_ns(s.p99),
            fmt_ns(s.max),
        ]);
    }
    let single = {
        let started = Instant::now();
        let mut n = 0;
        while started.elapsed() < sizes.concurrent_for / 2 {
            library_call(client, CALL_AGENT, ECHO).await?;
            n += 1;
        }
        n as f64 / started.elapsed().as_secs_f64()
    };
    table.row([
        "1 caller, for reference".to_string(),
        String::new(),
        fmt_rate(single),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
    ]);
    print!("{}", table.render());
    println!("CPU during the runs (2 cores = 200 %):");
    print!("{}", cpu.render());
    println!("goal: none set (figure only)");
    Ok(())
}

/// Waits until `n` hosts are online with a view offering `tool`.
async fn wait_fleet(client: &Client, n: usize, limit: Duration) -> Result<Duration, BenchError> {
    let started = Instant::now();
    loop {
        let hosts = procs::hosts(client).await?;
        let ready = hosts
            .iter()
            .filter(|h| h.state == HostState::Online as i32 && h.visible_tools > 0)
            .count();
        if ready >= n {
            return Ok(started.elapsed());
        }
        if started.elapsed() > limit {
            return Err(format!("only {ready} of {n} hosts ready within {limit:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn fanout(paths: &Paths, sizes: Sizes) -> Result<(), BenchError> {
    let n = sizes.fanout_agents;
    println!(
        "\n3. fan-out of `{ECHO}` to {n} hosts: load-generator links (real mTLS, real protocol, \
         answering each call at once with `ok`) stand in for hosts; end to end = request sent to \
         summary received"
    );
    let tools = paths.work.join("tools-fanout");
    write_tools(&tools, &[(ECHO, remote_script())])?;
    let mut coordinator = start_coordinator(paths, "coordinator-fanout", &tools)?;
    let fleet = FakeAgents::start(
        &coordinator.url,
        &paths.pki,
        (0..n).map(fake_id).collect(),
        32,
    )
    .await?;
    let ready = fleet.wait_ready(Duration::from_secs(60)).await?;
    let client = connect(paths, &coordinator.url).await?;
    wait_fleet(&client, n, Duration::from_secs(60)).await?;
    println!(
        "{n} links attached and reported views in {:.2} s",
        ready.as_secs_f64()
    );
    let label = format!("{}={}", FAKE_LABEL.0, FAKE_LABEL.1);
    let mut table = Table::new(HEADER);
    let mut all = None;
    for selector in ["all", label.as_str()] {
        for _ in 0..2 {
            fan_out(&client, selector, ECHO, n).await?;
        }
        let mut e2e = Vec::new();
        let mut first = Vec::new();
        let mut server = Vec::new();
        for _ in 0..sizes.fanout_reps {
            let t = fan_out(&client, selector, ECHO, n).await?;
            e2e.push(t.end_to_end);
            first.push(t.first_result);
            server.push(Duration::from_millis(t.summary.duration_ms));
        }
        let s = row(&mut table, &format!("`{selector}`: end to end"), &e2e);
        if selector == "all" {
            all = s;
        }
        row(
            &mut table,
            &format!("`{selector}`: first host result"),
            &first,
        );
        row(
            &mut table,
            &format!("`{selector}`: summary duration_ms"),
            &server,
        );
    }
    print!("{}", table.render());
    if let Some(s) = all {
        println!(
            "goal: fan-out to {n} hosts under 1 s end to end -> {} (median {}, p90 {})",
            verdict(s.median < 1e9 && s.p90 < 1e9),
            fmt_ns(s.median),
            fmt_ns(s.p90)
        );
    }
    coordinator.proc.check_alive()?;
    if fleet.ended() > 0 {
        return Err(format!("{} fake links ended during the run", fleet.ended()).into());
    }
    if let Some(e) = fleet.stop().await {
        println!("note: a fake link ended with: {e}");
    }
    coordinator.proc.stop();
    Ok(())
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// Address-space cap of the streaming agent (`prlimit --as`): the agent keeps a copy of a call's
/// whole output and builds the result JSON from it, so without a cap a 1 GiB stream of NULs would
/// make it allocate several GiB on a shared machine.
const STREAM_AGENT_AS: u64 = 4 << 30;

async fn stream(paths: &Paths, sizes: Sizes) -> Result<(), BenchError> {
    let bytes = sizes.stream_bytes;
    println!(
        "\n4. stdout streaming: `head -c {bytes} /dev/zero` on a real agent (--output-cap \
         2147483648, address space capped at {} GiB by prlimit) -> coordinator -> library client \
         (bytes counted, not kept)",
        STREAM_AGENT_AS >> 30
    );
    let tools = paths.work.join("tools-stream");
    let cmd = format!("head -c {bytes} /dev/zero");
    write_tools(&tools, &[(ZEROS, cmd.as_str())])?;
    let mut coordinator = start_coordinator(paths, "coordinator-stream", &tools)?;
    let mut table = Table::new([
        "run",
        "MB/s",
        "MiB/s",
        "last byte",
        "result at",
        "chunks",
        "avg chunk",
        "result",
    ]);
    let mut mem = Table::new([
        "run",
        "process",
        "RSS before",
        "max RSS sampled",
        "VmHWM",
        "note",
    ]);
    let mut cpu = Table::new([
        "run",
        "process",
        "CPU (user+sys)",
        "of wall time",
        "per GiB",
    ]);
    let mut rates = Vec::new();
    for run in 1..=sizes.stream_reps {
        // A fresh agent per run: a failed result may take the agent (or its link) down.
        let mut agent = procs::start_agent_limited(
            paths,
            &coordinator.url,
            STREAM_AGENT,
            &["--output-cap=2147483648".to_string()],
            Some(STREAM_AGENT_AS),
        )?;
        let client = connect(paths, &coordinator.url).await?;
        wait_for_tool(&client, STREAM_AGENT, ZEROS, Duration::from_secs(30)).await?;
        let before = (coordinator.proc.mem()?, agent.mem()?);
        reset_own_peak()?;
        let own_before = mem_of("self")?;
        let sampler = MemSampler::start(
            vec![
                ("coordinator".into(), coordinator.proc.pid().to_string()),
                ("agent".into(), agent.pid().to_string()),
                ("client (bench process)".into(), "self".into()),
            ],
            Duration::from_millis(50),
        );
        let pids = [
            coordinator.proc.pid().to_string(),
            agent.pid().to_string(),
            "self".into(),
        ];
        let cpu_before: Vec<_> = pids.iter().map(|p| cpu_of(p)).collect::<Result<_, _>>()?;
        let mut cpu_after = Vec::new();
        let mut agent_at_last_byte = Mem::default();
        let mut at_last_byte = || {
            cpu_after = pids.iter().map(|p| cpu_of(p).unwrap_or_default()).collect();
            agent_at_last_byte = mem_of(&pids[1]).unwrap_or_default();
        };
        let r = stream_call(
            &client,
            STREAM_AGENT,
            ZEROS,
            bytes,
            Duration::from_secs(300),
            &mut at_last_byte,
        )
        .await;
        let sampled = sampler.stop();
        let agent_alive = agent.check_alive().is_ok();
        let r = r?;
        rates.push(r.mb_per_sec());
        let secs = r.last_byte.as_secs_f64();
        let gib = r.bytes as f64 / f64::from(1u32 << 30);
        for (i, name) in ["coordinator", "agent (own)", "client (bench process)"]
            .iter()
            .enumerate()
        {
            let own = (cpu_after[i].0.saturating_sub(cpu_before[i].0)).as_secs_f64();
            cpu.row([
                run.to_string(),
                name.to_string(),
                format!("{own:.2} s"),
                format!("{:.0} %", own / secs * 100.0),
                format!("{:.2} s/GiB", own / gib),
            ]);
        }
        let children = (cpu_after[1].1.saturating_sub(cpu_before[1].1)).as_secs_f64();
        cpu.row([
            run.to_string(),
            "agent's children (head, sh)".to_string(),
            format!("{children:.2} s"),
            format!("{:.0} %", children / secs * 100.0),
            format!("{:.2} s/GiB", children / gib),
        ]);
        table.row([
            run.to_string(),
            format!("{:.0}", r.mb_per_sec()),
            format!(
                "{:.0}",
                r.bytes as f64 / 1048576.0 / r.last_byte.as_secs_f64()
            ),
            fmt_ns(r.last_byte.as_nanos() as f64),
            fmt_ns(r.elapsed.as_nanos() as f64),
            r.chunks.to_string(),
            format!(
                "{:.1} KiB",
                r.bytes as f64 / r.chunks.max(1) as f64 / 1024.0
            ),
            format!(
                "{}{}",
                r.status,
                if r.ok() {
                    String::new()
                } else {
                    format!(": {}", r.message)
                }
            ),
        ]);
        for (s, b) in sampled.iter().zip([before.0, before.1, own_before]) {
            let note = if s.name == "agent" && !agent_alive {
                format!(
                    "RSS {} at the last output byte; died after it (see its log)",
                    mib(agent_at_last_byte.rss_kib)
                )
            } else if s.name == "agent" {
                format!(
                    "RSS {} at the last output byte",
                    mib(agent_at_last_byte.rss_kib)
                )
            } else if s.vanished {
                "vanished while sampled".to_string()
            } else {
                String::new()
            };
            mem.row([
                run.to_string(),
                s.name.clone(),
                mib(b.rss_kib),
                mib(s.max_rss_kib),
                mib(s.hwm_kib),
                note,
            ]);
        }
        if !agent_alive {
            println!("agent log tail:\n{}", agent.log_tail(15));
        }
        agent.stop();
    }
    print!("{}", table.render());
    print!("{}", mem.render());
    println!("CPU during each stream (call start to last output byte; 2 cores = 200 %):");
    print!("{}", cpu.render());
    rates.sort_by(f64::total_cmp);
    let median = rates[rates.len() / 2];
    println!(
        "goal: at least 300 MB/s -> {} (median {median:.0} MB/s to the last output byte); \
         see the result column and the agent's memory for the end of the call",
        verdict(median >= 300.0),
    );
    coordinator.proc.stop();
    Ok(())
}

/// RSS of `proc` sampled `n` times a second apart; the median.
async fn settled_rss(proc: &Proc, n: usize) -> Result<Mem, BenchError> {
    let mut samples = Vec::new();
    for _ in 0..n {
        samples.push(proc.mem()?);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    samples.sort_by_key(|m| m.rss_kib);
    Ok(samples[samples.len() / 2])
}

/// Coordinator RSS per idle agent with `catalog`: before, with connections only, with attached
/// links; returns KiB per agent.
async fn coordinator_per_agent(
    paths: &Paths,
    sizes: Sizes,
    catalog: &std::path::Path,
    what: &str,
    definitions: Definitions,
    staggered: Option<usize>,
) -> Result<f64, BenchError> {
    let n = sizes.memory_agents;
    println!(
        "\n5a. coordinator memory per idle agent: {n} load-generator links (real mTLS, real protocol), \
         catalog = {what} ({} files, {} bytes)",
        std::fs::read_dir(catalog).map_or(0, |d| d.count()),
        dir_bytes(catalog)
    );
    let (catalog_len, view_len) = message_sizes(catalog, definitions)?;
    println!(
        "encoded: full CatalogUpdate {catalog_len} bytes, each fake agent's HostView {view_len} bytes; \
         attach: {}",
        staggered.map_or("all at once".to_string(), |b| format!(
            "{b} link(s) at a time, each waiting for its view"
        ))
    );
    let mut coordinator = start_coordinator(paths, "coordinator-memory", catalog)?;
    let client = connect(paths, &coordinator.url).await?;
    tokio::time::sleep(sizes.settle / 2).await;
    let samples = if quick() { 2 } else { 3 };
    let before = settled_rss(&coordinator.proc, samples).await?;
    let own_before = mem_of("self")?;
    let ids: Vec<String> = (0..n).map(fake_id).collect();
    let connected = Connected::connect(&coordinator.url, &paths.pki, &ids, 32).await?;
    tokio::time::sleep(sizes.settle / 2).await;
    let conn_only = settled_rss(&coordinator.proc, samples).await?;
    let (fleet, ready) = match staggered {
        None => {
            let fleet = connected.attach(definitions);
            let ready = fleet.wait_ready(Duration::from_secs(120)).await?;
            (fleet, ready)
        }
        Some(batch) => {
            let started = Instant::now();
            let fleet = connected
                .attach_staggered(definitions, batch, Duration::from_secs(300))
                .await?;
            (fleet, started.elapsed())
        }
    };
    wait_fleet(&client, n, Duration::from_secs(60)).await?;
    println!(
        "{n} links attached and reported views in {:.2} s",
        ready.as_secs_f64()
    );
    tokio::time::sleep(sizes.settle).await;
    let after = settled_rss(&coordinator.proc, samples + 2).await?;
    let own_after = mem_of("self")?;
    let per = (after.rss_kib as f64 - before.rss_kib as f64) / n as f64;
    let mut table = Table::new([
        "",
        "coordinator RSS",
        "coordinator VmHWM",
        "load generator RSS",
    ]);
    table.row([
        "before (no agents)".to_string(),
        mib(before.rss_kib),
        mib(before.hwm_kib),
        mib(own_before.rss_kib),
    ]);
    table.row([
        format!("{n} TLS+HTTP/2 connections, no Attach yet"),
        mib(conn_only.rss_kib),
        mib(conn_only.hwm_kib),
        String::new(),
    ]);
    table.row([
        format!("{n} idle links (attached, views reported)"),
        mib(after.rss_kib),
        mib(after.hwm_kib),
        mib(own_after.rss_kib),
    ]);
    print!("{}", table.render());
    println!(
        "per agent: connection alone {:.1} KiB, agent-link session on top {:.1} KiB",
        (conn_only.rss_kib as f64 - before.rss_kib as f64) / n as f64,
        (after.rss_kib as f64 - conn_only.rss_kib as f64) / n as f64,
    );
    println!(
        "total: {per:.1} KiB per agent = ({} - {}) KiB / {n}",
        after.rss_kib, before.rss_kib
    );
    coordinator.proc.check_alive()?;
    if fleet.ended() > 0 {
        return Err(format!("{} fake links ended during the run", fleet.ended()).into());
    }
    fleet.stop().await;
    coordinator.proc.stop();
    Ok(per)
}

/// A catalog of 4 tools whose prompts are 64 KiB each: 256 KiB of `.meta`.
fn write_large_catalog(dir: &std::path::Path) -> Result<(), BenchError> {
    std::fs::create_dir_all(dir)?;
    for i in 0..4 {
        let meta = serde_json::json!({
            "description": "a tool with a long prompt",
            "prompt": "x".repeat(64 << 10),
            "cmd": "true",
        });
        std::fs::write(dir.join(format!("long_{i}.meta")), meta.to_string())?;
    }
    Ok(())
}

/// Bytes of a tools directory (every file), for reports.
fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

async fn memory(paths: &Paths, sizes: Sizes) -> Result<(), BenchError> {
    let per = coordinator_per_agent(
        paths,
        sizes,
        &paths.examples,
        "examples/tools",
        Definitions::FromMeta,
        None,
    )
    .await?;
    println!(
        "goal: under 100 KiB per idle agent -> {} ({per:.1} KiB per agent)",
        verdict(per < 100.0),
    );
    if !quick() {
        // Attribution: the same with tiny views, then tiny and large catalogs.
        coordinator_per_agent(
            paths,
            sizes,
            &paths.examples,
            "examples/tools, minimal views",
            Definitions::Minimal,
            None,
        )
        .await?;
        let tiny = paths.work.join("tools-tiny");
        write_tools(&tiny, &[(ECHO, remote_script())])?;
        coordinator_per_agent(
            paths,
            sizes,
            &tiny,
            "one small tool, minimal views",
            Definitions::Minimal,
            None,
        )
        .await?;
        let large = paths.work.join("tools-large");
        write_large_catalog(&large)?;
        coordinator_per_agent(
            paths,
            sizes,
            &large,
            "4 tools with 64 KiB prompts, minimal views",
            Definitions::Minimal,
            None,
        )
        .await?;
        coordinator_per_agent(
            paths,
            sizes,
            &large,
            "4 tools with 64 KiB prompts, minimal views, attached one by one",
            Definitions::Minimal,
            Some(1),
        )
        .await?;
    }

    println!("\n5b. idle RSS of a real `toolsrv agent` (release) attached with examples/tools");
    let mut coordinator = start_coordinator(paths, "coordinator-idle", &paths.examples)?;
    let mut agent = start_agent(paths, &coordinator.url, IDLE_AGENT, &[])?;
    let client = connect(paths, &coordinator.url).await?;
    wait_fleet(&client, 1, Duration::from_secs(30)).await?;
    let info = procs::hosts(&client).await?;
    let visible = info.first().map_or(0, |h| h.visible_tools);
    let attached = agent.mem()?;
    tokio::time::sleep(sizes.settle).await;
    let idle = settled_rss(&agent, 5).await?;
    let mut table = Table::new(["", "agent RSS", "agent VmHWM"]);
    table.row([
        "just attached (view reported)".to_string(),
        mib(attached.rss_kib),
        mib(attached.hwm_kib),
    ]);
    table.row([
        format!("settled (+{:?})", sizes.settle + Duration::from_secs(5)),
        mib(idle.rss_kib),
        mib(idle.hwm_kib),
    ]);
    print!("{}", table.render());
    println!(
        "({visible} of the example tools visible on this host)\ngoal: agent idle RSS under 15 MiB -> {} ({})",
        verdict(idle.rss_kib < 15 * 1024),
        mib(idle.rss_kib)
    );
    agent.check_alive()?;
    agent.stop();
    coordinator.proc.stop();
    Ok(())
}
