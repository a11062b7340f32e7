//! Section `scale`: one coordinator and N stand-in hosts (`FLEET_SCALE_AGENTS`, 10,000 unless
//! set): attaching them, the idle cost, `toolctl hosts`, `toolctl fanout all`, a catalog change
//! reaching every host, and the reconnect storm after a coordinator restart (SIGKILL, then
//! SIGTERM), the stand-ins reconnecting with the agent's own backoff and jitter.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::process::Command;
use toolsrv_agent::Backoff;
use toolsrv_bench::BenchError;
use toolsrv_bench::procs::{
    Coordinator, MemSampler, Paths, ProcMem, connect, cpu_of, mem_of, start_coordinator_on,
    write_tools,
};
use toolsrv_bench::stats::{Summary, Table, fmt_ns};
use toolsrv_client::HostState;
use toolsrv_testkit::fake::{Connected, Counters, Definitions, FakeAgents, fake_id};
use toolsrv_testkit::{client_env, http_get, try_free_port};

use super::{ECHO, Sizes, mib, remote_script, settled_rss, verdict};

/// The tool the catalog change adds.
const PROBE: &str = "scale_probe";
/// How long any one wait of this section may take.
const WAIT: Duration = Duration::from_secs(300);

/// What the section is run with, from the environment.
#[derive(Debug, Clone, Copy)]
struct Settings {
    agents: usize,
    /// Handshakes the load generator runs at once while attaching.
    parallel: usize,
    /// The coordinator's `--keepalive-ms`.
    keepalive_ms: u64,
    /// Runs of each timed `toolctl` command.
    runs: usize,
}

fn settings(sizes: &Sizes) -> Result<Settings, BenchError> {
    let number = |name: &str, default: usize| -> Result<usize, BenchError> {
        match std::env::var(name) {
            Ok(v) => Ok(v
                .parse()
                .map_err(|e| format!("{name}={v}: not a number: {e}"))?),
            Err(_) => Ok(default),
        }
    };
    Ok(Settings {
        agents: sizes.scale_agents,
        parallel: number("FLEET_SCALE_PARALLEL", 64)?,
        keepalive_ms: number("FLEET_SCALE_KEEPALIVE_MS", 1000)? as u64,
        runs: number("FLEET_SCALE_RUNS", 5)?,
    })
}

/// The coordinator's log level here: what `deploy/systemd/coordinator.env` sets (it logs each
/// attach and detach).
const LOG: &str = "info";

/// The coordinator's flags for this section, with its metrics on `metrics` and the audit log
/// (one record per call) in `work`, as a deployed coordinator has one.
fn coordinator_args(s: &Settings, metrics: &str, work: &Path) -> Vec<String> {
    vec![
        format!("--metrics-listen={metrics}"),
        format!("--audit-log={}", work.join("audit-scale.jsonl").display()),
        // One fan-out to every host needs one call slot per host (a fan-out holds up to its
        // width of the client's slots) and a width over the default 4096.
        format!("--max-fanout-hosts={}", s.agents),
        format!("--max-calls-per-client={}", s.agents),
        format!("--keepalive-ms={}", s.keepalive_ms),
        format!("--lost-after-ms={}", 3 * s.keepalive_ms),
        // Every stand-in host connects from this one loopback address, which no real fleet's
        // hosts share.
        "--max-connecting-per-address=0".to_string(),
    ]
}

/// A gauge or counter of the coordinator's metrics endpoint (the first sample whose name and
/// labels start with `series`).
pub(crate) fn metric(addr: &str, series: &str) -> Result<f64, BenchError> {
    let (status, body) = http_get(addr, "/metrics")?;
    if status != 200 {
        return Err(format!("GET http://{addr}/metrics: status {status}").into());
    }
    let line = body
        .lines()
        .find(|l| l.starts_with(series))
        .ok_or_else(|| format!("no {series} in the coordinator's metrics"))?;
    let value = line.rsplit(' ').next().unwrap_or_default();
    Ok(value.parse()?)
}

pub(crate) fn online(addr: &str) -> Result<usize, BenchError> {
    Ok(metric(addr, "toolsrv_agents{state=\"online\"}")? as usize)
}

/// Open file descriptors of `pid`.
fn fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub(crate) fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// A tools directory with the example tools and the trivial tool the fan-out calls.
fn scale_tools(paths: &Paths) -> Result<std::path::PathBuf, BenchError> {
    let dir = paths.work.join("tools-scale");
    write_tools(&dir, &[(ECHO, remote_script())])?;
    for entry in std::fs::read_dir(&paths.examples)? {
        let entry = entry?;
        let name = entry.file_name();
        if entry.file_type()?.is_file() && name != "README.md" {
            std::fs::copy(entry.path(), dir.join(&name))?;
        }
    }
    Ok(dir)
}

pub(crate) async fn scale(paths: &Paths, sizes: Sizes) -> Result<(), BenchError> {
    let s = settings(&sizes)?;
    let n = s.agents;
    println!(
        "\n6. scale: one coordinator, {n} load-generator links (real mTLS, real protocol); \
         coordinator --keepalive-ms {}; load {}",
        s.keepalive_ms,
        load()
    );
    let tools = scale_tools(paths)?;
    let port = try_free_port()?;
    let metrics = format!("127.0.0.1:{}", try_free_port()?);
    let args = coordinator_args(&s, &metrics, &paths.work);
    println!("coordinator flags: {}", args.join(" "));
    let mut coordinator =
        start_coordinator_on(paths, "coordinator-scale", &tools, (port, LOG), &args)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = settled_rss(&coordinator.proc, 3).await?;
    let own_before = mem_of("self")?;

    // 1. Attach.
    let ids: Vec<String> = (0..n).map(fake_id).collect();
    let started = Instant::now();
    let connected = Connected::connect(&coordinator.url, &paths.pki, &ids, s.parallel).await?;
    let connect_took = started.elapsed();
    let attach_started = Instant::now();
    let backoff = Backoff::default();
    let fleet = connected.attach_reconnecting(
        Definitions::FromMeta,
        Arc::new(move |attempt| backoff.delay(attempt, &mut fastrand::Rng::new())),
    );
    fleet.wait_ready(WAIT).await?;
    let views_took = attach_started.elapsed();
    let online_took = wait_online(&metrics, n, attach_started, WAIT).await?;
    let attached = coordinator.proc.mem()?;
    println!(
        "1. {n} links: TCP+TLS+HTTP/2 in {} ({} handshakes at a time, {:.0} /s), then Attach \
         until every link reported its view {}, coordinator online={n} after {} (load {})",
        secs(connect_took),
        s.parallel,
        n as f64 / connect_took.as_secs_f64(),
        secs(views_took),
        secs(online_took),
        load()
    );

    // Idle: CPU over a window, memory settled.
    tokio::time::sleep(sizes.settle).await;
    let window = Duration::from_secs(if toolsrv_bench::quick() { 5 } else { 20 });
    let pid = coordinator.proc.pid().to_string();
    let (c0, g0, t0, load0) = (cpu_of(&pid)?, cpu_of("self")?, Instant::now(), load());
    tokio::time::sleep(window).await;
    let (c1, g1, took, load1) = (cpu_of(&pid)?, cpu_of("self")?, t0.elapsed(), load());
    let idle = settled_rss(&coordinator.proc, 5).await?;
    let own_idle = mem_of("self")?;
    let per_sec = |a: (Duration, Duration), b: (Duration, Duration)| {
        b.0.saturating_sub(a.0).as_secs_f64() / took.as_secs_f64()
    };
    let (coord_cpu, gen_cpu) = (per_sec(c0, c1), per_sec(g0, g1));
    let mut table = Table::new([
        "",
        "coordinator RSS",
        "coordinator VmHWM",
        "coordinator fds",
        "load generator RSS",
    ]);
    table.row([
        "before (no agents)".to_string(),
        mib(before.rss_kib),
        mib(before.hwm_kib),
        String::new(),
        mib(own_before.rss_kib),
    ]);
    table.row([
        format!("{n} links attached, views reported"),
        mib(attached.rss_kib),
        mib(attached.hwm_kib),
        fds(coordinator.proc.pid()).to_string(),
        String::new(),
    ]);
    table.row([
        format!("idle (+{}s, median of 5)", sizes.settle.as_secs()),
        mib(idle.rss_kib),
        mib(idle.hwm_kib),
        fds(coordinator.proc.pid()).to_string(),
        mib(own_idle.rss_kib),
    ]);
    print!("{}", table.render());
    println!(
        "per agent: {:.1} KiB ((idle RSS - before) / {n})",
        (idle.rss_kib as f64 - before.rss_kib as f64) / n as f64
    );
    println!(
        "idle CPU over {}: coordinator {:.1} % of a core ({:.1} µs per link per second), load \
         generator {:.1} % (load {load0} -> {load1})",
        secs(took),
        coord_cpu * 100.0,
        coord_cpu * 1e6 / n as f64,
        gen_cpu * 100.0,
    );

    // 2. toolctl hosts.
    hosts_commands(paths, &coordinator, n, s.runs).await?;
    // 3. Fan-out to every host.
    fanout_all(paths, &coordinator, n, s.runs).await?;
    // 4. A catalog change.
    catalog_change(paths, &coordinator, &metrics, &fleet, &tools, n).await?;
    // 5. Reconnect storms.
    for kill in [true, false] {
        coordinator = storm(paths, coordinator, &metrics, &fleet, &tools, &args, kill).await?;
    }
    let ended = fleet.ended();
    if let Some(e) = fleet.stop().await {
        println!("note: a fake link ended with: {e}");
    }
    coordinator.proc.stop();
    if ended > 0 {
        return Err(format!("{ended} fake links gave up during the run").into());
    }
    Ok(())
}

/// Waits until the coordinator's metrics count `n` hosts online; the time since `since`.
async fn wait_online(
    metrics: &str,
    n: usize,
    since: Instant,
    limit: Duration,
) -> Result<Duration, BenchError> {
    loop {
        let now = online(metrics).unwrap_or(0);
        if now >= n {
            return Ok(since.elapsed());
        }
        if since.elapsed() > limit {
            return Err(format!("only {now} of {n} hosts online within {limit:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fresh `toolctl` process with `args`, its stdout to /dev/null; the wall time, after checking
/// it exited 0.
async fn toolctl(paths: &Paths, url: &str, args: &[&str]) -> Result<Duration, BenchError> {
    let mut cmd = Command::new(paths.toolctl());
    cmd.args(args)
        .envs(client_env(url, &paths.client_tls()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let started = Instant::now();
    let child = cmd.spawn()?;
    let out = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .map_err(|_| format!("toolctl {}: no exit within 120 s", args.join(" ")))??;
    let took = started.elapsed();
    if !out.status.success() {
        return Err(format!(
            "toolctl {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(took)
}

/// `toolctl hosts` and `toolctl hosts --json`: wall time of `runs` fresh processes each, and the
/// coordinator's memory during and after.
async fn hosts_commands(
    paths: &Paths,
    coordinator: &Coordinator,
    n: usize,
    runs: usize,
) -> Result<(), BenchError> {
    println!(
        "\n2. `toolctl hosts` over {n} hosts (release binary, fresh process, stdout to /dev/null), {runs} runs each after one warm-up; load {}",
        load()
    );
    // Once with the output kept: it must list every host.
    let out = std::process::Command::new(paths.toolctl())
        .args(["hosts", "--json"])
        .envs(client_env(&coordinator.url, &paths.client_tls()))
        .output()?;
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("toolctl hosts --json: not JSON: {e}"))?;
    let count = listed.as_array().map_or(0, Vec::len);
    if count != n {
        return Err(format!("toolctl hosts --json listed {count} hosts, not {n}").into());
    }
    println!(
        "(toolctl hosts --json: {} bytes for {count} hosts)",
        out.stdout.len()
    );
    let sampler = MemSampler::start(
        vec![("coordinator".into(), coordinator.proc.pid().to_string())],
        Duration::from_millis(20),
    );
    let mut table = Table::new(["", "n", "median", "min", "max", "load after"]);
    for args in [&["hosts"][..], &["hosts", "--json"][..]] {
        toolctl(paths, &coordinator.url, args).await?;
        let mut took = Vec::new();
        for _ in 0..runs {
            took.push(toolctl(paths, &coordinator.url, args).await?);
        }
        let s = Summary::of(&took).ok_or("no runs")?;
        table.row([
            format!("toolctl {}", args.join(" ")),
            s.n.to_string(),
            fmt_ns(s.median),
            fmt_ns(s.min),
            fmt_ns(s.max),
            load(),
        ]);
    }
    let seen = sampler.stop();
    print!("{}", table.render());
    let after = coordinator.proc.mem()?;
    println!(
        "coordinator: largest RSS sampled during the runs {}, RSS after {}, VmHWM {}",
        mib(seen[0].max_rss_kib),
        mib(after.rss_kib),
        mib(after.hwm_kib)
    );
    Ok(())
}

/// `toolctl fanout all echo_ok` to every host: wall time, every host OK (exit 0), the
/// coordinator's peak memory; then one library fan-out for the coordinator's own duration.
async fn fanout_all(
    paths: &Paths,
    coordinator: &Coordinator,
    n: usize,
    runs: usize,
) -> Result<(), BenchError> {
    println!(
        "\n3. `toolctl fanout all {ECHO}` over {n} hosts (release binary, fresh process, stdout to \
         /dev/null; exit 0 = every host ok), {runs} runs after one warm-up; load {}",
        load()
    );
    let pid = coordinator.proc.pid().to_string();
    let before = coordinator.proc.mem()?;
    let sampler = MemSampler::start(
        vec![("coordinator".into(), pid.clone())],
        Duration::from_millis(10),
    );
    let cpu0 = cpu_of(&pid)?;
    toolctl(paths, &coordinator.url, &["fanout", "all", ECHO]).await?;
    let mut took = Vec::new();
    let mut loads = Vec::new();
    for _ in 0..runs {
        took.push(toolctl(paths, &coordinator.url, &["fanout", "all", ECHO]).await?);
        loads.push(load());
    }
    let cpu1 = cpu_of(&pid)?;
    let seen = sampler.stop();
    let after = coordinator.proc.mem()?;
    let client = connect(paths, &coordinator.url).await?;
    let lib = toolsrv_bench::remote::fan_out(&client, "all", ECHO, n).await?;
    let mut table = Table::new(["", "n", "median", "min", "max"]);
    let s = Summary::of(&took).ok_or("no runs")?;
    table.row([
        format!("toolctl fanout all {ECHO}"),
        s.n.to_string(),
        fmt_ns(s.median),
        fmt_ns(s.min),
        fmt_ns(s.max),
    ]);
    print!("{}", table.render());
    println!("loads after each run: {}", loads.join("; "));
    println!(
        "library fan-out once more: end to end {}, first result {}, coordinator's duration_ms \
         {}, {} of {n} ok",
        fmt_ns(lib.end_to_end.as_nanos() as f64),
        fmt_ns(lib.first_result.as_nanos() as f64),
        lib.summary.duration_ms,
        lib.summary.ok
    );
    let cpu = cpu1.0.saturating_sub(cpu0.0).as_secs_f64() / (runs + 1) as f64;
    println!(
        "coordinator: RSS before {}, largest RSS sampled {}, VmHWM after {} (since start), RSS \
         after {}; CPU {:.2} s per fan-out",
        mib(before.rss_kib),
        mib(seen[0].max_rss_kib),
        mib(after.hwm_kib),
        mib(after.rss_kib),
        cpu
    );
    println!(
        "goal: fanout all over {n} hosts under 2 s end to end and under 1 GiB -> {} (median {}, \
         largest coordinator RSS {})",
        verdict(s.median < 2e9 && seen[0].max_rss_kib < (1 << 20)),
        fmt_ns(s.median),
        mib(seen[0].max_rss_kib)
    );
    Ok(())
}

/// A new `.meta` in the coordinator's tools directory: when the coordinator serves the new
/// revision, when every link has received it (and answered with its view), and when the fleet
/// view (`ListHosts`) shows every host at it.
async fn catalog_change(
    paths: &Paths,
    coordinator: &Coordinator,
    metrics: &str,
    fleet: &FakeAgents,
    tools: &Path,
    n: usize,
) -> Result<(), BenchError> {
    println!(
        "\n4. catalog change: `{PROBE}.meta` written into the tools directory; load {}",
        load()
    );
    let old = metric(metrics, "toolsrv_catalog_revision")? as u64;
    let pid = coordinator.proc.pid().to_string();
    let cpu0 = cpu_of(&pid)?;
    let sampler = MemSampler::start(
        vec![("coordinator".into(), pid.clone())],
        Duration::from_millis(20),
    );
    let started = Instant::now();
    write_tools(tools, &[(PROBE, "echo probe")])?;
    let mut revision = old;
    while revision == old {
        if started.elapsed() > WAIT {
            return Err("the coordinator did not pick up the new .meta".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        revision = metric(metrics, "toolsrv_catalog_revision")? as u64;
    }
    let served = started.elapsed();
    let counters: &Counters = &fleet.counters;
    let (mut half, mut links) = (None, None);
    loop {
        let got = counters.views_of(revision);
        if half.is_none() && got * 2 >= n {
            half = Some(started.elapsed());
        }
        if got >= n {
            links = Some(started.elapsed());
            break;
        }
        if started.elapsed() > WAIT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let links = links.ok_or_else(|| {
        format!(
            "only {} of {n} links reported revision {revision}",
            counters.views_of(revision)
        )
    })?;
    let client = connect(paths, &coordinator.url).await?;
    let fleet_view = loop {
        let hosts = toolsrv_bench::procs::hosts(&client).await?;
        let at = hosts
            .iter()
            .filter(|h| h.state == HostState::Online as i32 && h.view_revision == revision)
            .count();
        if at >= n {
            break started.elapsed();
        }
        if started.elapsed() > WAIT {
            return Err(
                format!("only {at} of {n} hosts at revision {revision} in ListHosts").into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let cpu = cpu_of(&pid)?.0.saturating_sub(cpu0.0);
    let seen = sampler.stop();
    let mut table = Table::new(["from the write until", "time"]);
    table.row([
        format!("coordinator serves revision {revision} (metric)"),
        secs(served),
    ]);
    table.row([
        format!("half the links reported revision {revision}"),
        secs(half.unwrap_or(links)),
    ]);
    table.row([
        format!("all {n} links reported revision {revision}"),
        secs(links),
    ]);
    table.row([
        format!("ListHosts shows all {n} at revision {revision}"),
        secs(fleet_view),
    ]);
    print!("{}", table.render());
    println!(
        "coordinator CPU {:.2} s from the write to the last ListHosts; largest RSS sampled {}; load {}",
        cpu.as_secs_f64(),
        mib(seen[0].max_rss_kib),
        load()
    );
    let online = online(metrics)?;
    println!("toolsrv_agents{{state=\"online\"}} = {online}");
    Ok(())
}

/// Ends `old` (SIGKILL when `kill`, else SIGTERM and its drain), starts a new coordinator on the
/// same port, and measures until every link is back: the new coordinator.
async fn storm(
    paths: &Paths,
    mut old: Coordinator,
    metrics: &str,
    fleet: &FakeAgents,
    tools: &Path,
    args: &[String],
    kill: bool,
) -> Result<Coordinator, BenchError> {
    let how = if kill {
        "SIGKILL"
    } else {
        "SIGTERM (drain, goodbye to agents)"
    };
    let n = fleet.ids.len();
    let c = &fleet.counters;
    println!(
        "\n5. reconnect storm: {how}, then a new coordinator on the same port; load {}",
        load()
    );
    let (sessions0, failed0) = (
        c.sessions_ended.load(Ordering::SeqCst),
        c.failed_connects.load(Ordering::SeqCst),
    );
    let gen_cpu0 = cpu_of("self")?;
    let started = Instant::now();
    if kill {
        old.proc.kill();
    } else if old.proc.terminate_within(Duration::from_secs(60)).is_none() {
        return Err("the coordinator did not exit within 60 s of SIGTERM".into());
    }
    let gone = started.elapsed();
    let port: u16 = old
        .url
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or("no port in the coordinator's url")?;
    drop(old);
    let name = if kill {
        "coordinator-scale-after-kill"
    } else {
        "coordinator-scale-after-term"
    };
    let new = start_coordinator_on(paths, name, tools, (port, LOG), args)?;
    let listening = started.elapsed();
    let pid = new.proc.pid().to_string();
    let sampler = MemSampler::start(
        vec![("coordinator".into(), pid.clone())],
        Duration::from_millis(20),
    );
    let mut marks: Vec<(String, Duration)> = Vec::new();
    let mut next = 1;
    let back = loop {
        let now = online(metrics).unwrap_or(0);
        while next <= 4 && now * 4 >= n * next {
            marks.push((format!("{}% online", next * 25), started.elapsed()));
            next += 1;
        }
        if now >= n {
            break started.elapsed();
        }
        if started.elapsed() > WAIT {
            let seen = sampler.stop();
            return Err(format!(
                "only {now} of {n} hosts back online within {WAIT:?} (coordinator RSS peak {})",
                mib(seen[0].max_rss_kib)
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let cpu_new = cpu_of(&pid)?.0;
    let gen_cpu = cpu_of("self")?.0.saturating_sub(gen_cpu0.0);
    let seen = sampler.stop();
    let hwm = new.proc.mem()?.hwm_kib;
    let mut table = Table::new(["from the signal until", "time"]);
    table.row(["old coordinator gone".to_string(), secs(gone)]);
    table.row(["new coordinator accepts TCP".to_string(), secs(listening)]);
    for (what, at) in &marks {
        table.row([what.clone(), secs(*at)]);
    }
    print!("{}", table.render());
    println!(
        "all {n} back online {} after the signal, {} after the new coordinator listened; \
         sessions ended {}, failed connection attempts {}; new coordinator VmHWM {} (largest RSS \
         sampled {}), CPU {:.1} s until then; load generator CPU {:.1} s; load {}",
        secs(back),
        secs(back.saturating_sub(listening)),
        c.sessions_ended.load(Ordering::SeqCst) - sessions0,
        c.failed_connects.load(Ordering::SeqCst) - failed0,
        mib(hwm),
        mib(seen[0].max_rss_kib),
        cpu_new.as_secs_f64(),
        gen_cpu.as_secs_f64(),
        load()
    );
    // Why links ended and handshakes failed on the new coordinator, from its log.
    let log = new.proc.log();
    let count = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    println!(
        "new coordinator's log: {} attached, {} detached ({} lost for silence, {} link errors, \
         {} closed by the agent); TLS handshakes timed out {}, failed {}",
        count("agent attached"),
        count("agent detached"),
        count("lost: nothing heard"),
        count("link error"),
        count("the agent closed the link"),
        count("TLS handshake timed out"),
        count("TLS handshake failed"),
    );
    Ok(new)
}
