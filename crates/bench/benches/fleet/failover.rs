//! Section `failover` (only when named): three coordinator replicas on a three-member etcd and N
//! load-generator hosts (`FLEET_REPLICA_AGENTS`, 3,000 unless set) spread over them, each given
//! all three URLs and reconnecting with the agent's own backoff, moving on to the next URL when a
//! dial fails. Calls run through the first two replicas to every host while the third is killed
//! with SIGKILL: how long each of its hosts takes to attach to another replica, and how many
//! calls failed, on its hosts and elsewhere. Then every replica is killed and started again: the
//! reconnect storm of all N hosts, and the etcd writes it makes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use toolsrv_agent::Backoff;
use toolsrv_bench::BenchError;
use toolsrv_bench::procs::{Coordinator, Paths, connect, start_coordinator_on, write_tools};
use toolsrv_bench::stats::{Table, fmt_ns};
use toolsrv_client::{CallRequest, Client};
use toolsrv_testkit::fake::{Connected, Counters, Definitions, FakeAgents, fake_id};
use toolsrv_testkit::{EtcdCluster, try_free_port};

use super::scale::{metric, online, secs};
use super::{ECHO, HEADER, remote_script, row};

/// How long any one wait of this section may take.
const WAIT: Duration = Duration::from_secs(300);
/// Concurrent callers during the failover.
const CALLERS: usize = 8;

/// Each replica's `--max-keepalive-rate` (`FLEET_REPLICA_KEEPALIVE_RATE`; the coordinator's
/// default unless set).
fn keepalive_rate() -> Result<Option<u32>, BenchError> {
    match std::env::var("FLEET_REPLICA_KEEPALIVE_RATE") {
        Ok(v) => Ok(Some(v.parse().map_err(|e| {
            format!("FLEET_REPLICA_KEEPALIVE_RATE={v}: not a number: {e}")
        })?)),
        Err(_) => Ok(None),
    }
}

pub(crate) fn agents() -> Result<usize, BenchError> {
    match std::env::var("FLEET_REPLICA_AGENTS") {
        Ok(v) => Ok(v
            .parse()
            .map_err(|e| format!("FLEET_REPLICA_AGENTS={v}: not a number: {e}"))?),
        Err(_) if toolsrv_bench::quick() => Ok(150),
        Err(_) => Ok(3000),
    }
}

/// The replicas: one etcd, their ports and metrics addresses, the processes.
struct Replicas {
    etcd: EtcdCluster,
    ports: Vec<u16>,
    metrics: Vec<String>,
    procs: Vec<Option<Coordinator>>,
    tools: std::path::PathBuf,
    n: usize,
    /// Each replica's `--max-keepalive-rate`, when not the default.
    keepalive_rate: Option<u32>,
}

impl Replicas {
    fn url(&self, i: usize) -> String {
        format!("https://127.0.0.1:{}", self.ports[i])
    }

    fn start(&mut self, paths: &Paths, i: usize, name: &str) -> Result<(), BenchError> {
        let mut args = vec![
            format!("--etcd={}", self.etcd.endpoints().join(",")),
            format!("--replica-id=r{i}"),
            format!("--advertise-url={}", self.url(i)),
            format!("--metrics-listen={}", self.metrics[i]),
            format!("--max-fanout-hosts={}", self.n),
            format!("--max-calls-per-client={}", self.n),
            // Every stand-in host connects from this one loopback address, which no real
            // fleet's hosts share.
            "--max-connecting-per-address=0".to_string(),
        ];
        args.extend(
            self.keepalive_rate
                .map(|rate| format!("--max-keepalive-rate={rate}")),
        );
        let c = start_coordinator_on(
            paths,
            &format!("{name}-r{i}"),
            &self.tools,
            (self.ports[i], "info"),
            &args,
        )?;
        self.procs[i] = Some(c);
        Ok(())
    }

    /// Hosts online on each replica, from its metrics (0 for one that does not answer).
    fn online(&self) -> Vec<usize> {
        online_each(&self.metrics)
    }
}

/// Hosts online at each metrics address (0 for one that does not answer).
fn online_each(metrics: &[String]) -> Vec<usize> {
    metrics.iter().map(|m| online(m).unwrap_or(0)).collect()
}

/// Writes etcd has committed (raft proposals: puts, transactions, deletes, lease grants and
/// revocations), read from the member at `endpoint`.
fn etcd_writes(endpoint: &str) -> Result<f64, BenchError> {
    let addr = endpoint.trim_start_matches("http://");
    metric(addr, "etcd_server_proposals_committed_total")
}

pub(crate) async fn failover(paths: &Paths, _sizes: super::Sizes) -> Result<(), BenchError> {
    let n = agents()?;
    println!(
        "\n8. failover: 3 replicas on a 3-member etcd, {n} load-generator hosts spread over them \
         (each given the 3 URLs, the agent's backoff), --max-keepalive-rate {} on each replica",
        keepalive_rate()?.map_or("default".to_string(), |r| r.to_string())
    );
    let etcd = tokio::task::spawn_blocking(|| EtcdCluster::try_start_default_timing(3))
        .await
        .map_err(|e| e.to_string())??;
    let tools = paths.work.join("tools-failover");
    write_tools(&tools, &[(ECHO, remote_script())])?;
    let mut r = Replicas {
        etcd,
        ports: (0..3).map(|_| try_free_port()).collect::<Result<_, _>>()?,
        metrics: (0..3)
            .map(|_| try_free_port().map(|p| format!("127.0.0.1:{p}")))
            .collect::<Result<_, _>>()?,
        procs: vec![None, None, None],
        tools,
        n,
        keepalive_rate: keepalive_rate()?,
    };
    for i in 0..3 {
        r.start(paths, i, "coordinator-failover")?;
    }

    // Attach, a third to each replica.
    let started = Instant::now();
    let backoff = Backoff::default();
    let delay: Arc<dyn Fn(u32) -> Duration + Send + Sync> =
        Arc::new(move |attempt| backoff.delay(attempt, &mut fastrand::Rng::new()));
    let mut fleets: Vec<FakeAgents> = Vec::new();
    for i in 0..3 {
        let ids: Vec<String> = (0..n).filter(|k| k % 3 == i).map(fake_id).collect();
        let urls: Vec<String> = (0..3).map(|k| r.url((i + k) % 3)).collect();
        let connected = Connected::connect(&urls[0], &paths.pki, &ids, 64).await?;
        fleets.push(connected.attach_reconnecting_to(urls, Definitions::FromMeta, delay.clone()));
    }
    for fleet in &fleets {
        fleet.wait_ready(WAIT).await?;
    }
    wait_until("every host online", || {
        r.online().iter().sum::<usize>() >= n
    })
    .await?;
    println!(
        "attached {n} hosts in {} (online per replica {:?})",
        secs(started.elapsed()),
        r.online()
    );

    // Calls through r0 and r1 to every host, round robin, while r2 dies.
    let victim_url = r.url(2);
    let held: Vec<String> = welcomes(&fleets)
        .into_iter()
        .filter(|(_, (_, url))| *url == victim_url)
        .map(|(id, _)| id)
        .collect();
    let clients = [
        connect(paths, &r.url(0)).await?,
        connect(paths, &r.url(1)).await?,
    ];
    let load = Load::start(&clients, n);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let killed = Instant::now();
    if let Some(c) = r.procs[2].as_mut() {
        c.proc.kill();
    }
    let held_set: std::collections::HashSet<&str> = held.iter().map(String::as_str).collect();
    wait_until("the dead replica's hosts attached elsewhere", || {
        let w = welcomes(&fleets);
        held.iter()
            .all(|id| w.get(id).is_some_and(|(at, _)| *at > killed))
    })
    .await?;
    let all_back = killed.elapsed();
    wait_until("every host online on the other two", || {
        let online = r.online();
        online[0] + online[1] >= n
    })
    .await?;
    let online_back = killed.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let outcomes = load.stop().await;
    let w = welcomes(&fleets);
    let per_host: Vec<Duration> = held
        .iter()
        .filter_map(|id| w.get(id).map(|(at, _)| at.duration_since(killed)))
        .collect();
    let mut table = Table::new(HEADER);
    let s = row(
        &mut table,
        "host attached to another replica, after the SIGKILL",
        &per_host,
    );
    print!("{}", table.render());
    let (mut on_dead, mut elsewhere) = ((0, 0), (0, 0));
    for (host, ok, at) in &outcomes {
        let bucket = if held_set.contains(host.as_str()) {
            &mut on_dead
        } else {
            &mut elsewhere
        };
        if *at >= killed {
            bucket.0 += 1;
            if !ok {
                bucket.1 += 1;
            }
        }
    }
    println!(
        "{} hosts were on the killed replica: all attached elsewhere {} after the kill, all {n} \
         online on the other two after {}{}",
        held.len(),
        secs(all_back),
        secs(online_back),
        s.map(|s| format!(
            " (per host: median {}, p99 {})",
            fmt_ns(s.median),
            fmt_ns(s.p99)
        ))
        .unwrap_or_default()
    );
    println!(
        "calls started from the kill on: to its hosts {} ({} failed), to the other hosts {} ({} \
         failed)",
        on_dead.0, on_dead.1, elsewhere.0, elsewhere.1
    );

    // The reconnect storm of every host: all three replicas killed, then started again.
    storm(paths, &mut r, &fleets).await?;
    for fleet in fleets {
        let _ = fleet.stop().await;
    }
    Ok(())
}

/// Kills every replica, starts them again, and waits until all hosts are back: how long, and
/// the etcd writes per second meanwhile.
async fn storm(paths: &Paths, r: &mut Replicas, fleets: &[FakeAgents]) -> Result<(), BenchError> {
    let n = r.n;
    let etcd0 = r.etcd.endpoints()[0].clone();
    let writes0 = etcd_writes(&etcd0)?;
    let started = Instant::now();
    for proc in r.procs.iter_mut().flatten() {
        proc.proc.kill();
    }
    for i in 0..3 {
        r.start(paths, i, "coordinator-storm")?;
    }
    let listening = started.elapsed();
    // Committed writes, sampled every 100 ms, until every host is back.
    let mut samples: Vec<(Duration, f64)> = vec![(Duration::ZERO, writes0)];
    let back = loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Off the runtime: a starved replica answers its metrics late, and the load
        // generator's links must not wait for it.
        let (etcd0, metrics) = (etcd0.clone(), r.metrics.clone());
        let (writes, online) = tokio::task::spawn_blocking(move || {
            let online: usize = online_each(&metrics).iter().sum();
            (etcd_writes(&etcd0), online)
        })
        .await
        .map_err(|e| e.to_string())?;
        samples.push((started.elapsed(), writes?));
        if online >= n {
            break started.elapsed();
        }
        if started.elapsed() > WAIT {
            return Err(format!("only {online} of {n} hosts back within {WAIT:?}").into());
        }
    };
    let total = samples.last().map_or(0.0, |s| s.1) - writes0;
    // The busiest second: the most writes from one sample to the one 1 s later (or the last).
    let mut peak = 0.0f64;
    for (i, (t, w)) in samples.iter().enumerate() {
        if let Some((_, w1)) = samples[i..]
            .iter()
            .find(|(t1, _)| t1.saturating_sub(*t) >= Duration::from_secs(1))
            .or(samples.last())
        {
            peak = peak.max(w1 - w);
        }
    }
    let ended: usize = fleets
        .iter()
        .map(|f| f.counters.sessions_ended.load(Ordering::SeqCst))
        .sum();
    println!(
        "reconnect storm: all 3 replicas SIGKILLed and started again (listening after {}): all \
         {n} hosts back after {}; etcd committed {total:.0} writes meanwhile ({:.1} per host), \
         {:.0}/s on average, {peak:.0} in the busiest second; sessions ended so far {ended}",
        secs(listening),
        secs(back),
        total / n as f64,
        total / back.as_secs_f64(),
    );
    Ok(())
}

/// When each host last got a Welcome, and from which URL, over every fleet.
fn welcomes(fleets: &[FakeAgents]) -> BTreeMap<String, (Instant, String)> {
    let mut all = BTreeMap::new();
    for fleet in fleets {
        let c: &Counters = &fleet.counters;
        let w = c
            .welcomes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.extend(w.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    all
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) -> Result<(), BenchError> {
    let started = Instant::now();
    while !done() {
        if started.elapsed() > WAIT {
            return Err(format!("{what}: not within {WAIT:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Callers calling every host in turn through the clients given, each call's outcome noted.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: tokio::task::JoinSet<Vec<(String, bool, Instant)>>,
}

impl Load {
    fn start(clients: &[Client; 2], n: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for k in 0..CALLERS {
            let (client, stop, next) = (clients[k % 2].clone(), stop.clone(), next.clone());
            tasks.spawn(async move {
                let mut outcomes = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let host = fake_id(next.fetch_add(1, Ordering::Relaxed) % n);
                    let at = Instant::now();
                    let call = client.call_to_end(CallRequest {
                        host: host.clone(),
                        tool: ECHO.into(),
                        ..CallRequest::default()
                    });
                    let ok = matches!(
                        tokio::time::timeout(Duration::from_secs(30), call).await,
                        Ok(Ok(o)) if toolsrv_client::is_ok(o.result.status)
                    );
                    outcomes.push((host, ok, at));
                    if !ok {
                        // A host that is not back yet: do not spin on it.
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                outcomes
            });
        }
        Self { stop, tasks }
    }

    async fn stop(mut self) -> Vec<(String, bool, Instant)> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        while let Some(done) = self.tasks.join_next().await {
            all.extend(done.unwrap_or_default());
        }
        all
    }
}
