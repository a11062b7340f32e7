//! Call overhead benchmark: a local toolsrv call (`prepare` + `start` + draining events, as in
//! `toolctl local call`) against spawning the same `/bin/sh -c` script directly with tokio.

use std::time::Duration;

use toolsrv_bench::call::{
    CallFixture, CallPhases, SpawnSetup, confined_call, confiner, direct_spawn, jail_only, pairs,
    prepare_batch, timed_load, toolsrv_call,
};
use toolsrv_bench::stats::{Summary, Table, fmt_ns, fmt_rate, nanos};
use toolsrv_bench::{BenchError, iterations, quick};

/// The project's goal for the median overhead of a local call.
const GOAL: Duration = Duration::from_millis(1);
/// The project's goal for the median cost of confining a call (Landlock, cgroups, set-up and
/// tear-down) over the same call unconfined.
const CONFINE_GOAL: Duration = Duration::from_micros(500);

fn main() -> Result<(), BenchError> {
    // The same runtime `toolctl` builds.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run())?;
    Ok(())
}

fn summary_row(table: &mut Table, label: &str, samples: &[f64]) {
    if let Some(s) = Summary::of_nanos(samples) {
        table.row(
            [label.to_string()]
                .into_iter()
                .chain(s.cells())
                .chain([fmt_rate(s.ops_per_sec())]),
        );
    }
}

/// Picks one moment out of a call's phases.
type Phase = fn(&CallPhases) -> Duration;

const HEADER: [&str; 7] = ["", "n", "median", "p90", "p99", "min", "ops/s"];

async fn run() -> Result<(), BenchError> {
    let fixture = CallFixture::new()?;
    println!(
        "call_overhead: /bin/sh -c '{}'{}",
        toolsrv_bench::call::SCRIPT,
        if quick() { " (BENCH_QUICK)" } else { "" }
    );
    pairs(&fixture, iterations(20, 5)).await?;
    let measured = pairs(&fixture, iterations(1000, 100)).await?;

    let baseline: Vec<f64> = measured
        .iter()
        .map(|p| p.baseline.finished.as_nanos() as f64)
        .collect();
    let toolsrv: Vec<f64> = measured
        .iter()
        .map(|p| p.toolsrv.finished.as_nanos() as f64)
        .collect();
    let overhead: Vec<f64> = measured.iter().map(|p| p.overhead_ns()).collect();
    let mut table = Table::new(HEADER);
    summary_row(&mut table, "baseline: tokio Command", &baseline);
    summary_row(&mut table, "toolsrv: prepare+start+drain", &toolsrv);
    summary_row(&mut table, "overhead (per-pair difference)", &overhead);
    println!("\ninterleaved pairs (order alternating):");
    print!("{}", table.render());
    if let Some(s) = Summary::of_nanos(&overhead) {
        let met = s.median < GOAL.as_nanos() as f64;
        println!(
            "goal: median overhead under {} -> {} ({})",
            fmt_ns(GOAL.as_nanos() as f64),
            if met { "met" } else { "NOT met" },
            fmt_ns(s.median)
        );
    }

    // Where the difference arises: each moment of both calls, and its per-pair difference.
    let phases: [(&str, Phase); 4] = [
        ("prepare returned", |p| p.prepared),
        ("process spawned", |p| p.started),
        ("stdout `ok` received", |p| p.output),
        ("call over (Finished / exit+EOF)", |p| p.finished),
    ];
    let median = |v: Vec<f64>| Summary::of_nanos(&v).map_or(f64::NAN, |s| s.median);
    let mut table = Table::new([
        "time since start",
        "baseline median",
        "toolsrv median",
        "diff median",
        "diff p90",
    ]);
    for (label, phase) in phases {
        let diff = Summary::of_nanos(
            &measured
                .iter()
                .map(|p| p.phase_overhead_ns(phase))
                .collect::<Vec<_>>(),
        );
        table.row([
            label.to_string(),
            fmt_ns(median(
                measured
                    .iter()
                    .map(|p| phase(&p.baseline).as_nanos() as f64)
                    .collect(),
            )),
            fmt_ns(median(
                measured
                    .iter()
                    .map(|p| phase(&p.toolsrv).as_nanos() as f64)
                    .collect(),
            )),
            diff.map_or_else(String::new, |d| fmt_ns(d.median)),
            diff.map_or_else(String::new, |d| fmt_ns(d.p90)),
        ]);
    }
    println!("\nphases of the same pairs:");
    print!("{}", table.render());
    let batch = 1_000;
    let prepare_only: Vec<Duration> = (0..iterations(100, 10))
        .map(|_| prepare_batch(&fixture, batch).map(|d| d / batch as u32))
        .collect::<Result<_, _>>()?;
    let mut table = Table::new(HEADER);
    summary_row(&mut table, "prepare, back to back", &nanos(&prepare_only));
    println!("\nprepare alone (batches of {batch}, warm caches):");
    print!("{}", table.render());

    // Replays what the exec crate sets on the command, one option at a time, round-robin.
    let ladder = [
        ("direct: baseline", SpawnSetup::default()),
        (
            "+ process_group(0)",
            SpawnSetup {
                process_group: true,
                ..SpawnSetup::default()
            },
        ),
        (
            "+ env_clear + envs",
            SpawnSetup {
                process_group: true,
                explicit_env: true,
                ..SpawnSetup::default()
            },
        ),
        (
            "+ current_dir",
            SpawnSetup {
                pipe_stderr: false,
                ..SpawnSetup::LIKE_EXEC
            },
        ),
        ("+ stderr piped (= exec's setup)", SpawnSetup::LIKE_EXEC),
    ];
    let rounds = iterations(300, 20);
    let mut times: Vec<Vec<Duration>> = vec![Vec::with_capacity(rounds); ladder.len() + 1];
    for _ in 0..rounds {
        for (k, (_, setup)) in ladder.iter().enumerate() {
            times[k].push(direct_spawn(&fixture, *setup).await?.finished);
        }
        times[ladder.len()].push(toolsrv_call(&fixture).await?.finished);
    }
    let mut table = Table::new(HEADER);
    for (k, (label, _)) in ladder.iter().enumerate() {
        summary_row(&mut table, label, &nanos(&times[k]));
    }
    summary_row(&mut table, "toolsrv call", &nanos(&times[ladder.len()]));
    println!("\ndirect spawns with exec's options added one by one (round-robin):");
    print!("{}", table.render());

    confinement(&fixture).await?;

    let loads: Vec<Duration> = (0..iterations(200, 10))
        .map(|_| timed_load(&fixture))
        .collect();
    let mut table = Table::new(HEADER);
    summary_row(&mut table, "Host::current + scan (1 tool)", &nanos(&loads));
    println!("\nonce per `toolctl local call` process, before the call (not in the overhead):");
    print!("{}", table.render());
    Ok(())
}

/// Unconfined and confined calls of the same tool, interleaved, for two confiners: one with the
/// agent's files outside every granted directory, one with a hidden path under `/etc` (so `/etc`
/// is granted entry by entry, as with keys in `/etc/toolsrv`).
async fn confinement(fixture: &CallFixture) -> Result<(), BenchError> {
    let root = tempfile::tempdir()?;
    let under_etc = ["/etc/ssl/private", "/etc/hostname"]
        .into_iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
        .into_iter()
        .collect::<Vec<_>>();
    let setups = [
        (
            "agent's files outside /etc",
            confiner(&root.path().join("a"), vec![root.path().join("state")])?,
        ),
        (
            "a hidden path under /etc",
            confiner(&root.path().join("b"), under_etc)?,
        ),
    ];
    let a = setups[0].1.abilities();
    println!(
        "\nconfinement on this host: {} (Landlock ABI {}, cgroup {}, controllers {:?}, kill by {})",
        a.level.as_str(),
        a.landlock_abi,
        a.cgroup,
        a.controllers,
        a.kill
    );
    for (label, confiner) in &setups {
        for _ in 0..iterations(20, 5) {
            confined_call(fixture, confiner).await?;
        }
        let rounds = iterations(500, 50);
        let (mut open, mut closed, mut diff) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..rounds {
            let (u, c) = if i % 2 == 0 {
                let u = toolsrv_call(fixture).await?;
                (u, confined_call(fixture, confiner).await?)
            } else {
                let c = confined_call(fixture, confiner).await?;
                (toolsrv_call(fixture).await?, c)
            };
            open.push(u.finished.as_nanos() as f64);
            closed.push(c.finished.as_nanos() as f64);
            diff.push(c.finished.as_nanos() as f64 - u.finished.as_nanos() as f64);
        }
        let (mut set_up, mut torn_down) = (Vec::new(), Vec::new());
        for _ in 0..iterations(500, 50) {
            let (s, t) = jail_only(fixture, confiner)?;
            set_up.push(s);
            torn_down.push(t);
        }
        let mut table = Table::new(HEADER);
        summary_row(&mut table, "unconfined call", &open);
        summary_row(&mut table, "confined call", &closed);
        summary_row(&mut table, "cost (per-pair difference)", &diff);
        summary_row(&mut table, "jail set-up alone", &nanos(&set_up));
        summary_row(&mut table, "jail tear-down alone", &nanos(&torn_down));
        println!("\nconfinement, {label} (interleaved pairs, order alternating):");
        print!("{}", table.render());
        if let Some(s) = Summary::of_nanos(&diff) {
            println!(
                "goal: median cost of confinement under {} -> {} ({})",
                fmt_ns(CONFINE_GOAL.as_nanos() as f64),
                if s.median < CONFINE_GOAL.as_nanos() as f64 {
                    "met"
                } else {
                    "NOT met"
                },
                fmt_ns(s.median)
            );
        }
    }
    Ok(())
}
