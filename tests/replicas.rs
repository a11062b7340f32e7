//! Several coordinator replicas on etcd, as real processes on loopback: three etcd members,
//! three coordinators (`--etcd`), agents given every replica's URL. Every host is callable
//! through every replica (relayed to the one that holds its link); `ListHosts` shows the whole
//! fleet from any of them; a replica killed with SIGKILL loses its hosts to the others within a
//! bounded time while calls through the others go on; a relayed call whose client vanishes ends
//! its process on the host; an etcd member lost changes nothing; a client cannot speak for
//! another client the way a replica may.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use toolsrv_testkit::{CoordinatorLaunch, EtcdCluster, free_port};
use toolsrv_tests::{Fleet, LineWatch, Proc, assert_exit, bin, text, wait_for, write};

const HELLO: &str =
    r#"{"description": "Say hello", "cmd": "echo hello from $(cat /proc/sys/kernel/hostname)"}"#;

/// A fleet of `agents` attached to `n` replicas on a 3-member etcd.
struct Replicated {
    // The replicas drop first, so that a failing test prints their logs while the fleet's
    // directory still holds them.
    replicas: Vec<Option<Proc>>,
    fleet: Fleet,
    etcd: EtcdCluster,
    ports: Vec<u16>,
}

impl Replicated {
    fn start(n: usize, agents: &[&str], tools: &[(&str, &str)]) -> Self {
        Self::start_with(n, agents, tools, |_| Vec::new())
    }

    /// As [`Self::start`], replica `i` with the flags `extra(i)` too.
    fn start_with(
        n: usize,
        agents: &[&str],
        tools: &[(&str, &str)],
        extra: impl Fn(usize) -> Vec<String>,
    ) -> Self {
        Self::start_on(EtcdCluster::start(3), n, agents, tools, extra)
    }

    /// As [`Self::start_with`], on `etcd`.
    fn start_on(
        etcd: EtcdCluster,
        n: usize,
        agents: &[&str],
        tools: &[(&str, &str)],
        extra: impl Fn(usize) -> Vec<String>,
    ) -> Self {
        let fleet = Fleet::new(agents);
        for (file, content) in tools {
            fleet.tool(file, content, false);
        }
        let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let mut this = Self {
            fleet,
            etcd,
            ports,
            replicas: Vec::new(),
        };
        for i in 0..n {
            let proc = this.launch_with(i, &this.fleet.tools, &extra(i));
            this.replicas.push(Some(proc));
        }
        this.fleet.agent_coordinators = Some(this.urls().join(","));
        this.fleet.port = this.ports[0];
        this
    }

    fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("https://127.0.0.1:{p}"))
            .collect()
    }

    fn launch(&self, i: usize) -> Proc {
        self.launch_with_tools(i, &self.fleet.tools)
    }

    /// Replica `i` serving the tools of `tools` (each replica has its own tools path).
    fn launch_with_tools(&self, i: usize, tools: &std::path::Path) -> Proc {
        self.launch_with(i, tools, &[])
    }

    /// Replica `i` serving `tools`, with flags `extra` too.
    fn launch_with(&self, i: usize, tools: &std::path::Path, extra: &[String]) -> Proc {
        let mut launch = CoordinatorLaunch::new(
            self.ports[i],
            tools,
            self.fleet.pki.files(&toolsrv_tls::Identity::Coordinator),
        );
        launch.log = "info,toolsrv_coordinator=debug".into();
        launch.args = vec![
            format!("--replica-id=r{i}"),
            format!("--advertise-url=https://127.0.0.1:{}", self.ports[i]),
            "--rescan-secs=1".into(),
            "--admin=alice".into(),
            format!(
                "--audit-log={}",
                self.fleet
                    .work
                    .path()
                    .join(format!("audit-r{i}.jsonl"))
                    .display()
            ),
        ];
        // Every member, unless the test gives its own way to etcd.
        if !extra.iter().any(|a| a.starts_with("--etcd=")) {
            launch
                .args
                .push(format!("--etcd={}", self.etcd.endpoints().join(",")));
        }
        // A short lease, so that a dead replica's hosts are freed soon; a test may give its own.
        if !extra.iter().any(|a| a.starts_with("--etcd-lease")) {
            launch.args.push("--etcd-lease=2s".into());
        }
        launch.args.extend(extra.iter().cloned());
        launch
            .start(
                &bin("toolsrv"),
                &format!("replica-{i}"),
                self.fleet.work.path(),
            )
            .unwrap()
    }

    /// `toolctl` as alice through replica `i`.
    fn toolctl(&mut self, i: usize, args: &[&str]) -> std::process::Output {
        self.fleet.port = self.ports[i];
        self.fleet.toolctl(args)
    }

    /// `toolctl hosts --json` through replica `i`.
    fn hosts(&mut self, i: usize) -> Vec<Value> {
        self.fleet.port = self.ports[i];
        self.fleet.hosts()
    }

    /// The catalog revision replica `i` serves: the revision of `toolctl watch`'s snapshot.
    fn served_revision(&mut self, i: usize) -> u64 {
        self.fleet.port = self.ports[i];
        let watch = LineWatch::start(
            self.fleet
                .toolctl_command("client-alice", &["watch", "--json"]),
        );
        let snapshot = watch.until("the watch's snapshot", |v| v["kind"] == "snapshot");
        snapshot["revision"].as_u64().unwrap()
    }

    /// Waits until replica `i` serves a revision `pred` accepts; that revision.
    fn wait_revision(&mut self, i: usize, what: &str, pred: impl Fn(u64) -> bool) -> u64 {
        let limit = Instant::now() + Duration::from_secs(30);
        loop {
            let revision = self.served_revision(i);
            if pred(revision) {
                return revision;
            }
            assert!(
                Instant::now() < limit,
                "replica {i}: {what}; serves {revision}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Adds tool `name` (`echo NAME`) to the tools path r0 and r1 share; the revision both
    /// serve for it, once above `after`.
    fn add_shared_tool(&mut self, name: &str, after: u64) -> u64 {
        let meta = format!(r#"{{"description": "Says {name}", "cmd": "echo {name}"}}"#);
        write(&self.fleet.tools, &format!("{name}.meta"), &meta);
        let revision = self.wait_revision(0, "a new revision", |rev| rev > after);
        self.wait_revision(1, "the same new revision", |rev| rev == revision);
        revision
    }

    /// Waits until replica `i` shows every host of `ids` online; the replicas holding them.
    fn wait_all_online(&mut self, i: usize, ids: &[&str], limit: Duration) -> Vec<String> {
        self.wait_all_online_off(i, ids, "", limit)
    }

    /// [`Self::wait_all_online`], none of them held by replica `not_on`.
    fn wait_all_online_off(
        &mut self,
        i: usize,
        ids: &[&str],
        not_on: &str,
        limit: Duration,
    ) -> Vec<String> {
        self.fleet.port = self.ports[i];
        let fleet = &self.fleet;
        wait_for("every host online through the replica", limit, || {
            let hosts = fleet.hosts();
            let online: Vec<&Value> = hosts
                .iter()
                .filter(|h| h["state"] == "online" && ids.contains(&h["host_id"].as_str().unwrap()))
                .filter(|h| h["replica"] != not_on)
                .collect();
            (online.len() == ids.len()).then(|| {
                online
                    .iter()
                    .map(|h| h["replica"].as_str().unwrap_or_default().to_string())
                    .collect()
            })
        })
    }
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("h{i:02}")).collect()
}

#[test]
fn every_host_is_callable_through_every_replica_and_a_dead_replica_loses_its_hosts_to_the_others() {
    let names = ids(30);
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let slow = r#"{"description": "Slow", "cmd": "sleep 4; echo slept"}"#;
    let mut r = Replicated::start(3, &names, &[("hello.meta", HELLO), ("slow.meta", slow)]);
    for id in &names {
        r.fleet
            .start_agent(id, &toolsrv_tests::AgentSpec::default());
    }
    let owners = r.wait_all_online(0, &names, Duration::from_secs(60));
    let mut distinct = owners.clone();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() >= 2,
        "agents spread over the replicas: {owners:?}"
    );

    // Every replica lists the whole fleet, and every host answers through every replica.
    for i in 0..3 {
        let hosts = r.hosts(i);
        assert_eq!(
            hosts.iter().filter(|h| h["state"] == "online").count(),
            names.len(),
            "replica {i}: {hosts:?}"
        );
        for id in &names {
            let out = r.toolctl(i, &["call", id, "hello"]);
            assert!(
                out.status.success(),
                "{id} through r{i}: {}",
                text(&out.stderr)
            );
            assert!(
                text(&out.stdout).contains("hello from"),
                "{}",
                text(&out.stdout)
            );
        }
        let out = r.toolctl(i, &["fanout", "all", "hello"]);
        assert!(
            out.status.success(),
            "fan-out through r{i}: {}",
            text(&out.stderr)
        );
    }
    // The entering replica audits relayed calls, naming the replica that ran them.
    let audit = std::fs::read_to_string(r.fleet.work.path().join("audit-r0.jsonl")).unwrap();
    assert!(audit.contains("\"relayed_to\""), "{audit}");

    // One etcd member dies: nothing changes.
    r.etcd.kill(2);
    for id in &names[..4] {
        let out = r.toolctl(1, &["call", id, "hello"]);
        assert!(
            out.status.success(),
            "{id} with an etcd member down: {}",
            text(&out.stderr)
        );
    }

    // Replica 2 dies with SIGKILL while calls run through the others.
    let victim = 2;
    let held: Vec<&str> = names
        .iter()
        .zip(&owners)
        .filter(|(_, o)| *o == &format!("r{victim}"))
        .map(|(n, _)| *n)
        .collect();
    let elsewhere = *names
        .iter()
        .zip(&owners)
        .find(|(_, o)| *o != &format!("r{victim}"))
        .map(|(n, _)| n)
        .unwrap();
    r.fleet.port = r.ports[0];
    let running = r
        .fleet
        .toolctl_command("client-alice", &["call", elsewhere, "slow"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // And one through replica 0 to a host the victim holds: it must end with one status.
    let doomed = r
        .fleet
        .toolctl_command("client-alice", &["call", held[0], "slow"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // And a fan-out to the whole fleet through replica 1, mid-load.
    r.fleet.port = r.ports[1];
    let fanout = r
        .fleet
        .toolctl_command("client-alice", &["fanout", "all", "slow", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    r.replicas[victim].as_mut().unwrap().kill();
    let killed = Instant::now();
    let back = r.wait_all_online_off(0, &names, &format!("r{victim}"), Duration::from_secs(60));
    let failover = killed.elapsed();
    assert!(back.iter().all(|o| o != &format!("r{victim}")), "{back:?}");
    eprintln!(
        "{} hosts of the dead replica back through the others after {failover:?}",
        held.len()
    );
    let out = doomed.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(75),
        "a call on a host of the dead replica ends lost (retry later): {err}"
    );
    assert!(err.contains("lost"), "{err}");
    assert!(
        !text(&out.stdout).contains("slept"),
        "{}",
        text(&out.stdout)
    );
    let out = running.wait_with_output().unwrap();
    assert!(
        out.status.success() && text(&out.stdout).contains("slept"),
        "a call through another replica is unaffected: {}",
        text(&out.stderr)
    );
    // Every host of the fan-out ended with exactly one status: lost on the dead replica's
    // hosts, ok everywhere else.
    let out = fanout.wait_with_output().unwrap();
    let lines: Vec<Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for id in &names {
        let results: Vec<&Value> = lines
            .iter()
            .filter(|l| l["type"] == "result" && l["host"] == *id)
            .collect();
        assert_eq!(results.len(), 1, "{id}: {results:?}");
        let want = if held.contains(id) { "lost" } else { "ok" };
        assert_eq!(results[0]["status"], want, "{id}: {:?}", results[0]);
    }
    let summary = lines.last().unwrap();
    assert_eq!(summary["type"], "summary", "{summary}");
    assert_eq!(summary["targeted"], names.len(), "{summary}");
    assert_eq!(summary["failed"], held.len(), "{summary}");
    for id in &names {
        let out = r.toolctl(1, &["call", id, "hello"]);
        assert!(
            out.status.success(),
            "{id} after the failover: {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn a_relayed_call_whose_client_vanishes_ends_its_process_on_the_host() {
    let mut r = Replicated::start(2, &["solo"], &[]);
    let pid_file = r.fleet.marks().join("sleeper.pid");
    r.fleet.tool(
        "sleeper.meta",
        &format!(
            r#"{{"description": "Sleeps", "cmd": "sh -c 'echo $$ > {}; exec sleep 60' & wait"}}"#,
            pid_file.display()
        ),
        false,
    );
    // The host attaches to replica 1 only; the client calls through replica 0.
    r.fleet.agent_coordinators = Some(r.urls()[1].clone());
    r.fleet
        .start_agent("solo", &toolsrv_tests::AgentSpec::default());
    let owners = r.wait_all_online(0, &["solo"], Duration::from_secs(30));
    assert_eq!(owners, vec!["r1".to_string()]);
    r.fleet.port = r.ports[0];
    // The tool was added after the replicas started: wait until the host offers it.
    r.fleet.wait_online(&["solo"], "sleeper");
    let mut call = r
        .fleet
        .toolctl_command("client-alice", &["call", "solo", "sleeper"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid: i32 = wait_for("the tool to start", Duration::from_secs(20), || {
        std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse().ok())
    });
    call.kill().unwrap();
    let _ = call.wait();
    wait_for("the tool's process to end", Duration::from_secs(20), || {
        (nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err()).then_some(())
    });
}

#[test]
fn only_a_replica_may_speak_for_a_client() {
    let policy = r#"{"default": "allow", "rules": [{"clients": ["bob"], "effect": "deny"}]}"#;
    let mut r = Replicated::start(1, &["p1"], &[("hello.meta", HELLO)]);
    drop(r.replicas.pop());
    let policy_file = r.fleet.work.path().join("policy.json");
    std::fs::write(&policy_file, policy).unwrap();
    let mut launch = CoordinatorLaunch::new(
        r.ports[0],
        &r.fleet.tools,
        r.fleet.pki.files(&toolsrv_tls::Identity::Coordinator),
    );
    launch.args = vec![
        format!("--etcd={}", r.etcd.endpoints().join(",")),
        "--replica-id=r0".into(),
        format!("--advertise-url=https://127.0.0.1:{}", r.ports[0]),
        format!("--policy={}", policy_file.display()),
    ];
    r.replicas.push(Some(
        launch
            .start(&bin("toolsrv"), "replica-p", r.fleet.work.path())
            .unwrap(),
    ));
    r.fleet
        .start_agent("p1", &toolsrv_tests::AgentSpec::default());
    r.wait_all_online(0, &["p1"], Duration::from_secs(30));
    let out = r
        .fleet
        .toolctl_as("client-bob", &["call", "p1", "hello"], None);
    assert!(!out.status.success(), "bob is denied");

    // Bob naming alice in the relay header is still bob.
    let pki = r.fleet.pki.root().to_path_buf();
    let url = r.urls()[0].clone();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        use tokio_stream::StreamExt;
        let files = toolsrv_testkit::stem_files(&pki, "client-bob");
        let channel = toolsrv_tls::connect_reloading(&url, &files, toolsrv_tls::Role::Coordinator)
            .await
            .unwrap();
        let mut tools = toolsrv_proto::v1::tools_client::ToolsClient::new(channel);
        let mut request = tonic::Request::new(toolsrv_proto::v1::CallRequest {
            host: "p1".into(),
            tool: "hello".into(),
            args_json: "{}".into(),
            ..Default::default()
        });
        request
            .metadata_mut()
            .insert("toolsrv-on-behalf-of", "alice".parse().unwrap());
        request
            .metadata_mut()
            .insert("toolsrv-relayed-by", "r9".parse().unwrap());
        let mut stream = tools.call(request).await.unwrap().into_inner();
        let mut status = None;
        while let Some(event) = stream.next().await {
            if let Some(toolsrv_proto::v1::call_event::Event::Result(result)) = event.unwrap().event
            {
                status = Some(result.status);
            }
        }
        assert_eq!(
            status,
            Some(toolsrv_proto::v1::CallStatus::Denied as i32),
            "a client's relay header is ignored"
        );
    });
}

/// The serving status of `service` on replica `url`'s health service, as client alice asks.
fn health(pki: &std::path::Path, url: &str, service: &str) -> i32 {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let files = toolsrv_testkit::stem_files(pki, "client-alice");
        let channel = toolsrv_tls::connect_reloading(url, &files, toolsrv_tls::Role::Coordinator)
            .await
            .unwrap();
        tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .map(|r| r.into_inner().status)
            .unwrap_or(-1)
    })
}

#[test]
fn without_an_etcd_quorum_replicas_serve_the_hosts_they_hold_and_refuse_new_links() {
    let names = ["q1", "q2", "q3", "q4"];
    let mut r = Replicated::start(2, &names, &[("hello.meta", HELLO)]);
    for id in &names[..3] {
        r.fleet
            .start_agent(id, &toolsrv_tests::AgentSpec::default());
    }
    r.wait_all_online(0, &names[..3], Duration::from_secs(30));
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    let pki = r.fleet.pki.root().to_path_buf();
    let url = r.urls()[0].clone();
    assert_eq!(health(&pki, &url, "toolsrv.cluster"), serving);

    // Two of three members gone: no quorum.
    r.etcd.kill(1);
    r.etcd.kill(2);
    wait_for(
        "health to say etcd is not usable",
        Duration::from_secs(30),
        || (health(&pki, &url, "toolsrv.cluster") == not_serving).then_some(()),
    );
    // The hosts held keep answering, through either replica.
    for i in 0..2 {
        for id in &names[..3] {
            let out = r.toolctl(i, &["call", id, "hello"]);
            assert!(
                out.status.success(),
                "{id} through r{i} without quorum: {}",
                text(&out.stderr)
            );
        }
    }
    // A new host is refused (its agent keeps retrying), and the log says why.
    r.fleet
        .start_agent("q4", &toolsrv_tests::AgentSpec::default());
    let agent = r.fleet.agents.get("q4").unwrap();
    let refused =
        toolsrv_tests::try_wait_for("the new agent refused", Duration::from_secs(30), || {
            agent
                .log()
                .contains("cannot record the link in etcd")
                .then_some(())
        });
    assert!(refused.is_ok(), "{}", agent.log());
    assert!(
        r.hosts(0)
            .iter()
            .all(|h| h["host_id"] != "q4" || h["state"] != "online")
    );

    // Quorum back: healthy again, and the new host attaches.
    r.etcd.restart(1);
    wait_for("health back", Duration::from_secs(60), || {
        (health(&pki, &url, "toolsrv.cluster") == serving).then_some(())
    });
    r.wait_all_online(0, &names, Duration::from_secs(90));
}

#[test]
fn a_relayed_stream_keeps_the_relaying_replicas_memory_bounded_while_the_reader_stalls() {
    let gib = r#"{"description": "1 GiB of zeros", "cmd": "head -c 1073741824 /dev/zero"}"#;
    let mut r = Replicated::start(2, &["big"], &[("gib.meta", gib)]);
    r.fleet.agent_coordinators = Some(r.urls()[1].clone());
    r.fleet.start_agent(
        "big",
        &toolsrv_tests::AgentSpec {
            args: vec!["--output-cap=2147483648".into()],
            ..toolsrv_tests::AgentSpec::default()
        },
    );
    r.wait_all_online(0, &["big"], Duration::from_secs(30));
    let relay_pid = r.replicas[0].as_ref().unwrap().pid();
    let rss_kib = |pid: i32| -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let before = rss_kib(relay_pid);
    let pki = r.fleet.pki.root().to_path_buf();
    let url = r.urls()[0].clone();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (read, peak) = runtime.block_on(async {
        use tokio_stream::StreamExt;
        let files = toolsrv_testkit::stem_files(&pki, "client-alice");
        let channel = toolsrv_tls::connect_reloading(&url, &files, toolsrv_tls::Role::Coordinator)
            .await
            .unwrap();
        let mut tools = toolsrv_proto::v1::tools_client::ToolsClient::new(channel);
        let mut stream = tools
            .call(toolsrv_proto::v1::CallRequest {
                host: "big".into(),
                tool: "gib".into(),
                args_json: "{}".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        // Read 4 MiB, then stall for 5 s while the tool could write a gigabyte.
        let mut read = 0usize;
        while read < 4 << 20 {
            if let Some(toolsrv_proto::v1::call_event::Event::Output(chunk)) =
                stream.next().await.unwrap().unwrap().event
            {
                read += chunk.data.len();
            }
        }
        let mut peak = 0;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            peak = peak.max(rss_kib(relay_pid));
        }
        drop(stream);
        (read, peak)
    });
    eprintln!(
        "relaying replica RSS: {} MiB before, {} MiB at most while the reader stalled (read {} MiB)",
        before / 1024,
        peak / 1024,
        read >> 20
    );
    assert!(
        peak < before + 64 * 1024,
        "the relaying replica grew from {before} KiB to {peak} KiB"
    );
}

#[test]
fn every_replica_serves_the_revision_agreed_in_etcd_and_it_never_goes_backwards() {
    let mut r = Replicated::start(2, &["a1", "a2", "b1"], &[("hello.meta", HELLO)]);
    for id in ["a1", "a2"] {
        r.fleet
            .start_agent(id, &toolsrv_tests::AgentSpec::default());
    }
    r.wait_all_online(0, &["a1", "a2"], Duration::from_secs(60));
    // A watch through r0 sees the hosts r1 holds: one attaching, its view changing, leaving.
    r.fleet.port = r.ports[0];
    let watch = LineWatch::start(
        r.fleet
            .toolctl_command("client-alice", &["watch", "--json"]),
    );
    watch.until("the snapshot", |v| v["kind"] == "snapshot");
    r.fleet.agent_coordinators = Some(r.urls()[1].clone());
    r.fleet
        .start_agent("b1", &toolsrv_tests::AgentSpec::default());
    r.fleet.agent_coordinators = Some(r.urls().join(","));
    watch.until("b1 online through r0", |v| {
        v["kind"] == "host_online" && v["host"] == "b1"
    });
    r.wait_all_online(0, &["a1", "a2", "b1"], Duration::from_secs(60));
    let first = r.served_revision(0);
    assert_eq!(r.served_revision(1), first, "one revision for one tool set");
    let views = |r: &mut Replicated, i: usize| -> Vec<u64> {
        r.hosts(i)
            .iter()
            .map(|h| h["view_revision"].as_u64().unwrap())
            .collect()
    };

    // A change of the (shared) tools path gets one new revision, served by both, applied by
    // every host whichever replica holds it.
    let second = r.add_shared_tool("two", first);
    wait_for(
        "every host's view at the new revision",
        Duration::from_secs(30),
        || views(&mut r, 1).iter().all(|v| *v == second).then_some(()),
    );
    watch.until("b1's new view through r0", |v| {
        v["kind"] == "host_view" && v["host"] == "b1" && v["view_revision"] == second
    });
    for i in 0..2 {
        let out = r.toolctl(i, &["fanout", "all", "two"]);
        assert!(out.status.success(), "r{i}: {}", text(&out.stderr));
    }
    drop(r.fleet.agents.remove("b1"));
    watch.until("b1 offline through r0", |v| {
        v["kind"] == "host_offline" && v["host"] == "b1"
    });
    drop(watch);

    // A replica that restarts serves the agreed revision, not its own first one.
    r.replicas[1].as_mut().unwrap().kill();
    r.replicas[1] = Some(r.launch(1));
    r.wait_revision(1, "the agreed revision after a restart", |rev| {
        rev == second
    });

    // A third replica whose tools path is a late copy: same tools, so the same revision
    // (none is added for it).
    let late = r.fleet.work.path().join("late-tools");
    std::fs::create_dir_all(&late).unwrap();
    for file in ["hello.meta", "two.meta"] {
        std::fs::copy(r.fleet.tools.join(file), late.join(file)).unwrap();
    }
    r.ports.push(free_port());
    let third = r.launch_with_tools(2, &late);
    r.replicas.push(Some(third));
    r.wait_revision(2, "the revision of the same tools", |rev| rev == second);
    assert_eq!(r.served_revision(0), second);

    // The shared path changes and the copy lags: the late replica keeps its tools at its
    // revision (never another set under the new number), says why, and takes the new revision
    // without making one of its own once its copy catches up.
    let third_revision = r.add_shared_tool("three", second);
    let late_replica = r.replicas[2].as_ref().unwrap();
    wait_for(
        "the late replica's warning",
        Duration::from_secs(30),
        || {
            late_replica
                .log()
                .contains("tools path differs")
                .then_some(())
        },
    );
    assert_eq!(
        r.served_revision(2),
        second,
        "its own tools at its own revision"
    );
    std::fs::copy(r.fleet.tools.join("three.meta"), late.join("three.meta")).unwrap();
    r.wait_revision(2, "the agreed revision once its tools caught up", |rev| {
        rev == third_revision
    });
    assert_eq!(
        r.served_revision(0),
        third_revision,
        "no revision was added"
    );
    for i in 0..3 {
        let out = r.toolctl(i, &["call", "a1", "three"]);
        assert!(out.status.success(), "r{i}: {}", text(&out.stderr));
    }
}

#[test]
fn a_revocation_through_one_replica_holds_on_every_replica_and_outlives_a_restart() {
    // No --state-dir: with --etcd the list is kept there.
    let mut r = Replicated::start(2, &["a1", "a2"], &[("hello.meta", HELLO)]);
    r.fleet.agent_coordinators = Some(r.urls()[1].clone());
    r.fleet
        .start_agent("a1", &toolsrv_tests::AgentSpec::default());
    r.fleet
        .start_agent("a2", &toolsrv_tests::AgentSpec::default());
    r.wait_all_online(0, &["a1", "a2"], Duration::from_secs(60));

    // bob watches through r1; alice revokes him through r0.
    r.fleet.port = r.ports[1];
    let bob_watch = LineWatch::start(r.fleet.toolctl_command("client-bob", &["watch", "--json"]));
    bob_watch.until("bob's snapshot", |v| v["kind"] == "snapshot");
    let out = r.toolctl(0, &["revoke", "client/bob", "--reason", "laptop stolen"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_ne!(bob_watch.end(), Some(0), "bob's watch through r1 ended");
    for i in 0..2 {
        r.fleet.port = r.ports[i];
        let out = r.fleet.toolctl_as("client-bob", &["hosts"], None);
        assert_eq!(out.status.code(), Some(77), "r{i}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("laptop stolen"),
            "r{i}: {}",
            text(&out.stderr)
        );
    }
    // Listed through the other replica.
    let out = r.toolctl(1, &["revocations", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0]["identity"], "client/bob");
    assert_eq!(list[0]["revoked_by"], "alice");

    // An agent revoked through r0 loses its link on r1, and stays out: both replicas forget
    // it (r1 held it, r0 knew it from etcd) long before --forget-offline-after-secs.
    let out = r.toolctl(0, &["revoke", "agent/a1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let state = |r: &mut Replicated, i: usize, host: &str| -> String {
        r.hosts(i)
            .iter()
            .find(|h| h["host_id"] == host)
            .map(|h| h["state"].as_str().unwrap_or_default().to_string())
            .unwrap_or_default()
    };
    for i in [1, 0] {
        wait_for(
            &format!("a1 gone from r{i}"),
            Duration::from_secs(15),
            || state(&mut r, i, "a1").is_empty().then_some(()),
        );
    }
    assert_exit(
        &r.toolctl(0, &["call", "a1", "hello"]),
        127,
        &["host `a1` is not in the fleet: the identity agent/a1 is revoked"],
    );
    assert_eq!(state(&mut r, 0, "a2"), "online", "a2 untouched");

    // A replica restarted takes the list from etcd.
    r.replicas[1].as_mut().unwrap().kill();
    r.replicas[1] = Some(r.launch(1));
    r.fleet.port = r.ports[1];
    let out = r.fleet.toolctl_as("client-bob", &["hosts"], None);
    assert_exit(&out, 77, &[]);

    // Lifted through r1: bob is back through r0 too.
    let out = r.toolctl(1, &["unrevoke", "client/bob"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    r.fleet.port = r.ports[0];
    let fleet = &r.fleet;
    wait_for("bob back through r0", Duration::from_secs(15), || {
        fleet
            .toolctl_as("client-bob", &["hosts"], None)
            .status
            .success()
            .then_some(())
    });
    let out = r.toolctl(0, &["revocations", "--json"]);
    let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<&str> = list
        .iter()
        .map(|v| v["identity"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["agent/a1"]);
}

#[test]
fn the_replica_a_call_enters_applies_its_policy_before_relaying() {
    let mut r = Replicated::start(2, &["solo"], &[("hello.meta", HELLO)]);
    r.fleet.agent_coordinators = Some(r.urls()[1].clone());
    r.fleet
        .start_agent("solo", &toolsrv_tests::AgentSpec::default());
    r.wait_all_online(0, &["solo"], Duration::from_secs(30));
    // r0 denies bob `hello` on solo; r1, which holds solo, has no such rule.
    let policy = r#"{"default": "allow", "rules": [
        {"clients": ["bob"], "tools": ["hello"], "hosts": "solo", "effect": "deny"}]}"#;
    let policy_file = r.fleet.work.path().join("policy-r0.json");
    std::fs::write(&policy_file, policy).unwrap();
    r.replicas[0].as_mut().unwrap().kill();
    let tools = r.fleet.tools.clone();
    r.replicas[0] =
        Some(r.launch_with(0, &tools, &[format!("--policy={}", policy_file.display())]));
    r.wait_all_online(0, &["solo"], Duration::from_secs(30));
    r.fleet.port = r.ports[0];
    let out = r
        .fleet
        .toolctl_as("client-bob", &["call", "solo", "hello"], None);
    assert!(!out.status.success(), "denied by r0's policy");
    assert!(
        text(&out.stderr).contains("denies client bob"),
        "{}",
        text(&out.stderr)
    );
    let audit = std::fs::read_to_string(r.fleet.work.path().join("audit-r0.jsonl")).unwrap();
    let denial = audit
        .lines()
        .find(|l| l.contains("\"bob\"") && l.contains("CALL_STATUS_DENIED"))
        .unwrap_or_else(|| panic!("r0 audits the denial: {audit}"));
    assert!(!denial.contains("relayed_to"), "{denial}");
    // Nothing reached the owner: its audit has no call of bob's.
    let owner =
        std::fs::read_to_string(r.fleet.work.path().join("audit-r1.jsonl")).unwrap_or_default();
    assert!(!owner.contains("\"bob\""), "{owner}");
    // Through the owner (no such rule there), and for alice through r0, it runs.
    r.fleet.port = r.ports[1];
    let out = r
        .fleet
        .toolctl_as("client-bob", &["call", "solo", "hello"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = r.toolctl(0, &["call", "solo", "hello"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// Two replicas started with flag `arg`, and host `solo` (serving `hello`) attached to r0, seen
/// online through r1.
fn solo_on_r0_of_two(arg: &str) -> Replicated {
    let mut r = Replicated::start_with(2, &["solo"], &[("hello.meta", HELLO)], |_| {
        vec![arg.to_string()]
    });
    r.fleet.agent_coordinators = Some(r.urls()[0].clone());
    r.fleet
        .start_agent("solo", &toolsrv_tests::AgentSpec::default());
    assert_eq!(
        r.wait_all_online(1, &["solo"], Duration::from_secs(30)),
        ["r0"]
    );
    r
}

/// A replica that does not hold a host shows it as the one holding it does, and selects it by
/// its sandbox level: through it, the host had no sandbox, no tools and no room for calls.
#[test]
fn a_host_of_another_replica_shows_and_selects_as_on_its_own() {
    let mut r = solo_on_r0_of_two("--max-finds-per-client=8");
    let own = r.hosts(0);
    let own = own.iter().find(|h| h["host_id"] == "solo").unwrap().clone();
    let level = own["sandbox"]["level"].as_str().unwrap().to_string();
    assert!(!level.is_empty(), "{own}");
    // r1 hears of the host's view from r0's watch.
    let other = wait_for("r1 to hear of solo's view", Duration::from_secs(20), || {
        let hosts = r.hosts(1);
        let solo = hosts.iter().find(|h| h["host_id"] == "solo")?.clone();
        (solo["view_revision"] == own["view_revision"]).then_some(solo)
    });
    assert_eq!(other["replica"], "r0", "{other}");
    assert_eq!(other["sandbox"]["level"], level.as_str(), "{other}");
    assert_eq!(
        other["max_concurrent_calls"], own["max_concurrent_calls"],
        "{other}"
    );
    assert_eq!(other["visible_tools"], own["visible_tools"], "{other}");
    let out = r.toolctl(1, &["fanout", &format!("sandbox={level}"), "hello"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("hello"), "{}", text(&out.stdout));
}

/// New host labels reach the replicas that do not hold the host: the replica holding it
/// rewrites its claim, so the others select it, and show it, by its new labels.
#[test]
fn host_labels_edited_while_running_reach_the_replicas_that_do_not_hold_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let labels = dir.path().join("host-labels.json");
    std::fs::write(&labels, "{}").unwrap();
    let arg = format!("--host-labels={}", labels.display());
    let mut r = solo_on_r0_of_two(&arg);
    let out = r.toolctl(1, &["fanout", "role=db", "hello"]);
    assert!(
        !text(&out.stdout).contains("hello\n"),
        "selected before it has the label"
    );

    let new = dir.path().join("host-labels.json.new");
    std::fs::write(&new, r#"{"solo": {"role": "db"}}"#).unwrap();
    std::fs::rename(&new, &labels).unwrap();
    wait_for(
        "r1 to see solo's new label",
        Duration::from_secs(20),
        || {
            let hosts = r.hosts(1);
            let solo = hosts.iter().find(|h| h["host_id"] == "solo")?;
            (solo["trusted_labels"]["role"] == "db").then_some(())
        },
    );
    let out = r.toolctl(1, &["fanout", "role=db", "hello"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("hello"), "{}", text(&out.stdout));
    // r0 still holds it, and calls through r1 still reach it.
    let out = r.toolctl(1, &["call", "solo", "hello"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// A host that went away is forgotten after `--forget-offline-after-secs` by every replica: the
/// one that held it (from its fleet) and the others (from the hosts they knew other replicas
/// held); a call through either is then `unknown_host`.
#[test]
fn a_host_away_too_long_is_forgotten_by_every_replica() {
    let mut r = solo_on_r0_of_two("--forget-offline-after-secs=3");
    drop(r.fleet.agents.remove("solo"));
    for i in [0, 1] {
        wait_for("solo offline", Duration::from_secs(20), || {
            let hosts = r.hosts(i);
            let solo = hosts.iter().find(|h| h["host_id"] == "solo")?;
            (solo["state"] != "online").then_some(())
        });
    }
    for i in [0, 1] {
        wait_for("solo forgotten", Duration::from_secs(20), || {
            let hosts = r.hosts(i);
            hosts.iter().all(|h| h["host_id"] != "solo").then_some(())
        });
        let out = r.toolctl(i, &["call", "solo", "hello"]);
        assert_eq!(out.status.code(), Some(127), "{}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("hosts offline that long are forgotten"),
            "{}",
            text(&out.stderr)
        );
    }
}

/// A host that left one replica and attached to another is not forgotten: the first replica
/// drops its own stale entry when the time comes, without telling its watchers the host is
/// gone, and still lists it online and calls it through the replica that holds it.
#[test]
fn a_host_that_moved_to_another_replica_is_not_forgotten() {
    let mut r = solo_on_r0_of_two("--forget-offline-after-secs=3");
    drop(r.fleet.agents.remove("solo"));
    r.fleet.agent_coordinators = Some(r.urls()[1].clone());
    r.fleet
        .start_agent("solo", &toolsrv_tests::AgentSpec::default());
    assert_eq!(
        r.wait_all_online(0, &["solo"], Duration::from_secs(30)),
        ["r1"]
    );
    r.fleet.port = r.ports[0];
    let watch = LineWatch::start(
        r.fleet
            .toolctl_command("client-alice", &["watch", "--json"]),
    );
    watch.until("the watch's snapshot", |v| v["kind"] == "snapshot");
    // Past the time r0 forgets its stale entry of solo (3 s after it last heard of it there).
    std::thread::sleep(Duration::from_secs(6));
    let forgotten: Vec<_> = watch
        .seen()
        .into_iter()
        .filter(|v| v["kind"] == "host_forgotten")
        .collect();
    assert!(forgotten.is_empty(), "{forgotten:?}");
    assert_eq!(
        r.wait_all_online(0, &["solo"], Duration::from_secs(5)),
        ["r1"]
    );
    let out = r.toolctl(0, &["call", "solo", "hello"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn an_approval_waiting_on_the_replica_that_runs_the_call_is_decided_through_any_replica() {
    let policy = r#"{"default": "allow", "rules": [
        {"tools": ["hello"], "effect": "approve", "approvers": ["bob"]}]}"#;
    let mut r = Replicated::start(2, &["solo"], &[("hello.meta", HELLO)]);
    let policy_file = r.fleet.work.path().join("policy-approve.json");
    std::fs::write(&policy_file, policy).unwrap();
    let tools = r.fleet.tools.clone();
    for i in 0..2 {
        r.replicas[i].as_mut().unwrap().kill();
        r.replicas[i] =
            Some(r.launch_with(i, &tools, &[format!("--policy={}", policy_file.display())]));
    }
    r.fleet.agent_coordinators = Some(r.urls()[1].clone());
    r.fleet
        .start_agent("solo", &toolsrv_tests::AgentSpec::default());
    r.wait_all_online(0, &["solo"], Duration::from_secs(30));

    // alice calls through r0; the call runs, and waits for bob, on r1.
    r.fleet.port = r.ports[0];
    let caller = r
        .fleet
        .toolctl_command("client-alice", &["call", "solo", "hello"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let fleet = &r.fleet;
    let pending: Vec<Value> = wait_for(
        "bob to see the request through r0",
        Duration::from_secs(20),
        || {
            let out = fleet.toolctl_as("client-bob", &["approvals", "--json"], None);
            let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
            (!list.is_empty()).then_some(list)
        },
    );
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(pending[0]["caller"], "alice");
    let id = pending[0]["id"].as_str().unwrap().to_string();
    // alice may not decide it, through either replica.
    let out = r.fleet.toolctl_as("client-alice", &["approve", &id], None);
    assert_exit(&out, 77, &[]);
    let out = r.fleet.toolctl_as("client-bob", &["approve", &id], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = toolsrv_tests::finish_child(caller, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("hello from"),
        "{}",
        text(&out.stdout)
    );
    // Decided once: not found anywhere now.
    let out = r.fleet.toolctl_as("client-bob", &["approve", &id], None);
    assert_exit(&out, 127, &[]);
}

#[test]
fn a_join_token_created_through_one_replica_enrolls_a_host_through_another() {
    let mut r = Replicated::start(2, &[], &[("hello.meta", HELLO)]);
    let tools = r.fleet.tools.clone();
    for i in 0..2 {
        let state = r.fleet.work.path().join(format!("state-r{i}"));
        let extra = [
            format!("--signing-ca-cert={}", r.fleet.pki.path("ca.pem").display()),
            format!(
                "--signing-ca-key={}",
                r.fleet.pki.path("ca-key.pem").display()
            ),
            format!("--state-dir={}", state.display()),
        ];
        r.replicas[i].as_mut().unwrap().kill();
        r.replicas[i] = Some(r.launch_with(i, &tools, &extra));
    }
    // A token through r0 (which keeps it) ...
    let create = |r: &mut Replicated, host: &str| -> (String, String) {
        let out = r.toolctl(0, &["token", "create", "--host-id", host]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let pin = toolsrv_tests::ca_pin_in(&text(&out.stderr));
        (text(&out.stdout).trim().to_string(), pin)
    };
    let (token, pin) = create(&mut r, "w1");
    // ... enrolls a host that only knows r1.
    r.fleet.agent_coordinators = Some(r.urls()[1].clone());
    let spec = toolsrv_tests::AgentSpec {
        enroll: Some(vec![format!("--join={token}"), format!("--ca-pin={pin}")]),
        ..toolsrv_tests::AgentSpec::default()
    };
    r.fleet.start_agent("w1", &spec);
    let owners = r.wait_all_online(0, &["w1"], Duration::from_secs(30));
    assert_eq!(owners, ["r1"]);
    let log = std::fs::read_to_string(r.fleet.work.path().join("audit-r1.jsonl")).unwrap();
    assert!(log.contains("\"signed_by_replica\":\"r0\""), "{log}");

    // Listed through either replica; used once, whichever replica it is shown again to.
    let list = |r: &mut Replicated, i: usize| -> Vec<Value> {
        let out = r.toolctl(i, &["token", "list", "--json"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let listed = list(&mut r, 1);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["state"], "used");
    let again = r.fleet.work.path().join("again");
    let mut cmd = std::process::Command::new(bin("toolsrv"));
    cmd.arg("agent")
        .arg(format!("--coordinator={}", r.urls()[1]))
        .arg(format!("--state-dir={}", again.display()))
        .arg("--sandbox=off")
        .arg(format!("--join={token}"))
        .arg(format!("--ca-pin={pin}"))
        .env("TOOLSRV_LOG", "info");
    let out = toolsrv_tests::run_bounded(cmd, None, Duration::from_secs(20));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("already used"),
        "{}",
        text(&out.stderr)
    );

    // A token kept by r0 revoked through r1.
    let (_, _) = create(&mut r, "w2");
    let id = list(&mut r, 0)
        .iter()
        .find(|t| t["host_id"] == "w2")
        .map(|t| t["id"].as_str().unwrap().to_string())
        .unwrap();
    let out = r.toolctl(1, &["token", "revoke", &id]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let w2 = list(&mut r, 0)
        .into_iter()
        .find(|t| t["host_id"] == "w2")
        .unwrap();
    assert_eq!(w2["state"], "revoked", "{w2}");
}

/// Two replicas serving a disk tool everyone has and a GPU tool only hosts with `HAS_GPU`
/// have; host `plain` attached to r0 and `gpu`, the one with a GPU, to r1.
fn disk_and_gpu_on_two_replicas(plain: &str, gpu: &str) -> Replicated {
    disk_and_gpu_on_two_replicas_with(plain, gpu, |_| Vec::new())
}

/// Host `plain` on r0 and host `gpu`, the only one with a GPU, on r1; replica `i` started with
/// the flags `extra(i)` too.
fn disk_and_gpu_on_two_replicas_with(
    plain: &str,
    gpu: &str,
    extra: impl Fn(usize) -> Vec<String>,
) -> Replicated {
    let disk_meta = r#"{"description": "Show disk usage per mounted filesystem", "keywords": ["df", "free space"], "cmd": "df -h"}"#;
    let gpu_meta = r#"{"description": "Show GPU utilisation and memory", "keywords": ["nvidia", "graphics card"], "cmd": "true",
        "variants": [{"match": {"env": "HAS_GPU"}}]}"#;
    let mut r = Replicated::start_with(
        2,
        &[plain, gpu],
        &[
            ("disk_usage.meta", disk_meta),
            ("gpu_status.meta", gpu_meta),
        ],
        extra,
    );
    r.fleet.agent_coordinators = Some(r.urls()[0].clone());
    r.fleet
        .start_agent(plain, &toolsrv_tests::AgentSpec::default());
    r.fleet.agent_coordinators = Some(r.urls()[1].clone());
    r.fleet.start_agent(
        gpu,
        &toolsrv_tests::AgentSpec {
            env: vec![("HAS_GPU".into(), "1".into())],
            ..toolsrv_tests::AgentSpec::default()
        },
    );
    let held = r.wait_all_online(0, &[plain, gpu], Duration::from_secs(30));
    assert_eq!(held, ["r0", "r1"]);
    r
}

#[test]
fn find_tools_through_any_replica_ranks_the_tools_of_every_replicas_hosts() {
    // fa on r0; fb, the only host with a GPU, on r1.
    let mut r = disk_and_gpu_on_two_replicas("fa", "fb");
    let find = |r: &mut Replicated, i: usize, args: &[&str]| -> Vec<Value> {
        let mut all = vec!["find"];
        all.extend_from_slice(args);
        all.push("--json");
        let out = r.toolctl(i, &all);
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{all:?} through r{i}: {e}: {}", text(&out.stderr)))
    };
    for i in 0..2 {
        // Both hosts' disks, whichever replica holds them.
        let found = find(
            &mut r,
            i,
            &["all", "how much free space is left on the disk"],
        );
        assert_eq!(found[0]["name"], "disk_usage", "r{i}: {found:?}");
        assert_eq!(
            found[0]["hosts"],
            serde_json::json!(["fa", "fb"]),
            "r{i}: {found:?}"
        );
        // The GPU of the host the other replica holds, too.
        let found = find(&mut r, i, &["all", "graphics card memory"]);
        assert_eq!(found[0]["name"], "gpu_status", "r{i}: {found:?}");
        assert_eq!(
            found[0]["hosts"],
            serde_json::json!(["fb"]),
            "r{i}: {found:?}"
        );
        // A selector picks on every replica: fa has no GPU, wherever it is asked.
        let on_fa = find(&mut r, i, &["fa", "graphics card memory"]);
        assert!(
            on_fa.iter().all(|m| m["name"] != "gpu_status"),
            "r{i}: {on_fa:?}"
        );
        let on_fb = find(&mut r, i, &["fb", "free space on the disk"]);
        assert_eq!(
            on_fb[0]["hosts"],
            serde_json::json!(["fb"]),
            "r{i}: {on_fb:?}"
        );
        // --limit holds for the merged answer.
        assert!(find(&mut r, i, &["all", "show", "--limit", "1"]).len() <= 1);
    }
    // A replica gone: the answer of the one asked comes without it, at once and whole for
    // its own hosts (fb has not attached elsewhere yet: its agent knows only r1).
    r.replicas[1].as_mut().unwrap().kill();
    let start = Instant::now();
    let found = find(&mut r, 0, &["all", "free space on the disk"]);
    assert_eq!(found[0]["hosts"], serde_json::json!(["fa"]), "{found:?}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

/// One replica ranks by meaning, the other by words alone (no `--find-model`): their scores are
/// not comparable, so the merged answer interleaves them and keeps the match by meaning of a tool
/// both found; each still brings the hosts it holds.
#[test]
fn replicas_ranking_differently_are_interleaved_and_none_loses_its_hosts() {
    let model = toolsrv_tests::find_model_dir();
    let mut r = disk_and_gpu_on_two_replicas_with("fa", "fb", |i| {
        if i == 0 {
            vec![format!("--find-model={}", model.display())]
        } else {
            Vec::new()
        }
    });
    let find_saying = |r: &mut Replicated, i: usize, query: &str| -> (Vec<Value>, String) {
        let out = r.toolctl(i, &["find", "all", query, "--json"]);
        let found = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{query:?} through r{i}: {e}: {}", text(&out.stderr)));
        (found, text(&out.stderr))
    };
    let find = |r: &mut Replicated, i: usize, query: &str| find_saying(r, i, query).0;
    for i in 0..2 {
        // Found by both: r0's match by meaning is kept (it has a semantic score), with the
        // hosts of both. The words-only replica's score for it is higher and would win a
        // comparison by score.
        let (found, said) = find_saying(&mut r, i, "free space on the disk");
        // The user is told why the scores may not come in order.
        assert!(
            said.contains("the replicas ranked differently"),
            "r{i}: {said}"
        );
        assert_eq!(found[0]["name"], "disk_usage", "r{i}: {found:?}");
        assert_eq!(
            found[0]["hosts"],
            serde_json::json!(["fa", "fb"]),
            "r{i}: {found:?}"
        );
        assert!(found[0]["semantic"].is_number(), "r{i}: {found:?}");
        // Found by words on r1's host only: still there, wherever asked.
        let found = find(&mut r, i, "nvidia graphics card");
        let gpu = found
            .iter()
            .find(|m| m["name"] == "gpu_status")
            .unwrap_or_else(|| panic!("r{i}: {found:?}"));
        assert_eq!(gpu["hosts"], serde_json::json!(["fb"]), "r{i}: {found:?}");
    }
}

#[test]
fn a_session_is_reached_through_any_replica_and_spans_every_replicas_hosts() {
    // sa on r0; sb, the only host with a GPU, on r1.
    let mut r = disk_and_gpu_on_two_replicas("sa", "sb");
    let ok = |out: std::process::Output, what: &str| -> String {
        assert!(out.status.success(), "{what}: {}", text(&out.stderr));
        text(&out.stdout)
    };
    let json = |out: String| -> Value { serde_json::from_str(&out).unwrap() };

    // Opened through r0, which holds only sa: the GPU tool of r1's host loads.
    let id = ok(r.toolctl(0, &["session", "open"]), "open")
        .trim()
        .to_string();
    assert!(
        id.ends_with("@r0"),
        "the id names the replica that keeps it: {id}"
    );
    let state = json(ok(
        r.toolctl(0, &["session", "load", &id, "gpu_status", "--json"]),
        "load gpu_status through r0",
    ));
    assert_eq!(
        state["selected"],
        serde_json::json!([{"host": "sa", "state": "online"}, {"host": "sb", "state": "online"}]),
        "{state}"
    );
    let gpu_tool = &state["tools"][0];
    assert_eq!(gpu_tool["hosts"], serde_json::json!(["sb"]), "{state}");
    assert_eq!(
        gpu_tool["resolutions"][0]["definition"]["description"],
        "Show GPU utilisation and memory"
    );

    // Through r1, the same session: shown, loaded into, watched and closed there.
    let state = json(ok(
        r.toolctl(1, &["session", "load", &id, "disk_usage", "--json"]),
        "load disk_usage through r1",
    ));
    let disk_tool = state["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "disk_usage")
        .unwrap_or_else(|| panic!("{state}"));
    assert_eq!(
        disk_tool["hosts"],
        serde_json::json!(["sa", "sb"]),
        "{state}"
    );
    let shown = json(ok(
        r.toolctl(1, &["session", "show", &id, "--json"]),
        "show through r1",
    ));
    assert_eq!(shown["tools"].as_array().unwrap().len(), 2, "{shown}");

    // Another client reaches nothing through either replica.
    for i in 0..2 {
        r.fleet.port = r.ports[i];
        let out = r
            .fleet
            .toolctl_as("client-bob", &["session", "show", &id], None);
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains("no session"),
            "{}",
            text(&out.stderr)
        );
    }

    // A watcher through r1 sees r1's own host go away (the session lives on r0).
    r.fleet.port = r.ports[1];
    let watch = LineWatch::start(
        r.fleet
            .toolctl_command("client-alice", &["session", "watch", &id, "--json"]),
    );
    let first = watch.until("the first state", |_| true);
    assert_eq!(first["watchers"], 1, "{first}");
    r.fleet.agents.get_mut("sb").unwrap().kill();
    let after = watch.until("sb gone from the GPU tool", |s| {
        s["tools"].as_array().is_some_and(|t| {
            t.iter().any(|t| {
                t["name"] == "gpu_status" && t["hosts"].as_array().is_none_or(Vec::is_empty)
            })
        })
    });
    assert!(
        after["tools"][0]["unavailable"]
            .as_str()
            .is_some_and(|u| !u.is_empty()),
        "{after}"
    );
    drop(watch);

    // Listed through either replica, with one opened through r1: both, wherever they live.
    let other = ok(r.toolctl(1, &["session", "open"]), "open through r1")
        .trim()
        .to_string();
    assert!(other.ends_with("@r1"), "{other}");
    let mut both = [id.as_str(), other.as_str()];
    both.sort_unstable();
    for i in 0..2 {
        let listed = json(ok(r.toolctl(i, &["session", "list", "--json"]), "list"));
        let ids: Vec<&str> = listed
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, both, "through r{i}, sorted by id");
    }
    let bobs = r
        .fleet
        .toolctl_as("client-bob", &["session", "list", "--json"], None);
    assert_eq!(ok(bobs, "bob's list").trim(), "[]");
    ok(
        r.toolctl(1, &["session", "close", &other]),
        "close r1's session",
    );
    ok(r.toolctl(1, &["session", "close", &id]), "close through r1");
    let out = r.toolctl(0, &["session", "show", &id]);
    assert!(!out.status.success(), "closed on r0 too");

    // A session whose replica is gone: a clear NOT_FOUND naming it.
    let gone = "0123456789abcdef0123456789abcdef@r7";
    let out = r.toolctl(0, &["session", "show", gone]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("replica `r7`, which is gone"),
        "{}",
        text(&out.stderr)
    );
    // Odd ids: huge, odd bytes, an empty replica, this replica's own name, several `@`: each a
    // short NOT_FOUND, and both replicas go on serving.
    let huge = format!("{}@{}", "a".repeat(20_000), "r".repeat(20_000));
    for id in [
        huge.as_str(),
        "x@\u{202e}r1\u{0007}",
        "x@",
        "@",
        "x@r0",
        "x@r1@r0",
        "x@@r1",
    ] {
        for i in 0..2 {
            let out = r.toolctl(i, &["session", "load", id, "disk_usage"]);
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(127), "{id:.40} through r{i}: {err}");
            assert!(err.contains("no session"), "{id:.40} through r{i}: {err}");
            assert!(err.len() < 1024, "a bounded message: {} bytes", err.len());
        }
    }
    let out = r.toolctl(1, &["call", "sa", "disk_usage"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn a_hung_replica_delays_what_is_asked_of_it_by_a_bounded_time_only() {
    // fh on r0; gh, the GPU host, on r1. Leases long enough that r1, stopped, still holds gh.
    let mut r = disk_and_gpu_on_two_replicas("fh", "gh");
    let tools = r.fleet.tools.clone();
    let lease = ["--etcd-lease=30s".to_string()];
    for i in 0..2 {
        r.replicas[i].as_mut().unwrap().kill();
        r.replicas[i] = Some(r.launch_with(i, &tools, &lease));
    }
    // Each host held by the new process of its replica (through its own replica, a host shows
    // online only once linked there: the old process's claims do not count), then seen by r0.
    r.wait_all_online(0, &["fh"], Duration::from_secs(60));
    r.wait_all_online(1, &["gh"], Duration::from_secs(60));
    assert_eq!(
        r.wait_all_online(0, &["fh", "gh"], Duration::from_secs(60)),
        ["r0", "r1"]
    );
    // r1 hangs: its process stopped, its connections open, nothing answered.
    let r1 = r.replicas[1].as_ref().unwrap().pid();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(r1),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    let timed = |r: &mut Replicated, args: &[&str]| {
        let start = Instant::now();
        let out = r.toolctl(0, args);
        (out, start.elapsed())
    };
    // FindTools answers with r0's hosts, after at most the 3 s it waits for the others.
    let (out, took) = timed(&mut r, &["find", "all", "free space on the disk", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let found: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(found[0]["hosts"], serde_json::json!(["fh"]), "{found:?}");
    assert!(took < Duration::from_secs(10), "find took {took:?}");
    // A session spanning the hung replica's host: shown, gh without its view (syncing).
    let (out, took) = timed(&mut r, &["session", "open", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(took < Duration::from_secs(10), "open took {took:?}");
    let state: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        state["selected"],
        serde_json::json!([{"host": "fh", "state": "online"}, {"host": "gh", "state": "syncing"}]),
        "{state}"
    );
    // Listings asked of every replica: bounded too.
    let (out, took) = timed(&mut r, &["approvals"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(took < Duration::from_secs(10), "approvals took {took:?}");
    // Every session of the list lacks gh's view: the list waits for the hung replica once, not
    // once per session.
    for _ in 0..3 {
        assert!(r.toolctl(0, &["session", "open"]).status.success());
    }
    let (out, took) = timed(&mut r, &["session", "list", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed.len(), 4, "{listed:?}");
    assert!(took < Duration::from_secs(10), "session list took {took:?}");
    // r0's own host is served meanwhile.
    let (out, _) = timed(&mut r, &["call", "fh", "disk_usage"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(r1),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    // Back: the session's next state has gh's view, and gh's tools.
    let id = state["id"].as_str().unwrap().to_string();
    wait_for("gh's view in the session", Duration::from_secs(20), || {
        let out = r.toolctl(0, &["session", "show", &id, "--json"]);
        let state: Value = serde_json::from_slice(&out.stdout).ok()?;
        (state["selected"][1]["state"] == "online").then_some(())
    });
}

/// `toolctl mcp` given every replica carries on through another when the replica holding its
/// session goes away: its next connection goes to a replica that answers, where it opens a new
/// session from the profile. Before, every connection went to the replica it first reached, and
/// each call, search and load failed (`Connection refused`) until that replica came back.
#[test]
fn toolctl_mcp_carries_on_through_another_replica_when_its_replica_dies() {
    let mut r = Replicated::start(2, &["solo"], &[("hello.meta", HELLO)]);
    r.fleet
        .start_agent("solo", &toolsrv_tests::AgentSpec::default());
    r.wait_all_online(0, &["solo"], Duration::from_secs(30));
    let profile = r.fleet.work.path().join("profile.json");
    std::fs::write(&profile, r#"{"autoLoad": ["hello"], "hosts": "all"}"#).unwrap();
    let mut cmd = r.fleet.toolctl_command(
        "client-alice",
        &["mcp", "--profile", profile.to_str().unwrap()],
    );
    cmd.env("TOOLSRV_ADDR", r.urls().join(","));
    let mut mcp = toolsrv_tests::McpStdio::start(cmd, r.fleet.work.path().join("mcp.stderr"));
    let call = |mcp: &mut toolsrv_tests::McpStdio| {
        mcp.request(
            "tools/call",
            serde_json::json!({"name": "hello", "arguments": {}}),
        )
    };
    let first = call(&mut mcp);
    assert_eq!(first["result"]["isError"], false, "{first}");
    let opened = mcp.stderr();
    let held_by = if opened.contains("@r0 ") { 0 } else { 1 };
    assert!(opened.contains(&format!("@r{held_by} ")), "{opened}");

    r.replicas[held_by].take().unwrap().kill();
    let other = format!("@r{}", 1 - held_by);
    wait_for(
        "a new session on the other replica",
        Duration::from_secs(60),
        || {
            let log = mcp.stderr();
            log.lines()
                .any(|l| l.contains("opened session") && l.contains(&other))
                .then_some(())
        },
    );
    let answered = wait_for(
        "a call through the other replica",
        Duration::from_secs(30),
        || {
            let answer = call(&mut mcp);
            if answer["result"]["isError"] == false {
                return Some(answer);
            }
            std::thread::sleep(Duration::from_millis(500));
            None
        },
    );
    assert!(
        answered["result"]["content"][0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("hello from")),
        "{answered}"
    );
}

/// A replica cut off from etcd, but alive and holding its agents' links, keeps serving them
/// ("serving the hosts held here"): its lease lapses, so the other replicas see its hosts
/// reconnecting, and their agents, whose links hold, have no reason to move. Calls and
/// fan-outs through another replica are relayed to the replica that last held the host; once
/// that replica is really gone, a call says so (offline, not lost), and a fan-out reports every
/// host rather than leaving out the ones it never held. Before, through the other replica,
/// every call said `no host ... has connected to this coordinator` for as long as the cut
/// lasted, and a fan-out left such hosts out.
#[test]
fn hosts_of_a_replica_cut_off_from_etcd_stay_callable_through_the_others() {
    let names = ["e1", "e2"];
    let etcd = EtcdCluster::start(3);
    // r0 reaches etcd through a link the test can cut; r1 directly.
    let member: u16 = etcd.endpoints()[0]
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let link = toolsrv_tests::TcpLink::start(member, None, None);
    let through = format!("--etcd=http://127.0.0.1:{}", link.port);
    let mut r = Replicated::start_on(etcd, 2, &names, &[("hello.meta", HELLO)], |i| {
        if i == 0 {
            vec![through.clone()]
        } else {
            Vec::new()
        }
    });
    // The agents know r0 only, so they stay with it.
    r.fleet.agent_coordinators = Some(r.urls()[0].clone());
    for id in names {
        r.fleet
            .start_agent(id, &toolsrv_tests::AgentSpec::default());
    }
    let held = r.wait_all_online(1, &names, Duration::from_secs(30));
    assert!(held.iter().all(|h| h == "r0"), "{held:?}");

    link.cut();
    // r0's lease lapses (2 s): r1 sees its hosts reconnecting.
    wait_for(
        "r1 to see r0's hosts reconnecting",
        Duration::from_secs(30),
        || {
            r.hosts(1)
                .iter()
                .filter(|h| h["state"] == "reconnecting")
                .count()
                .eq(&names.len())
                .then_some(())
        },
    );
    for id in names {
        let out = r.toolctl(1, &["call", id, "hello"]);
        assert!(
            out.status.success(),
            "{id} through r1 while r0 is cut from etcd: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stdout).contains("hello from"),
            "{}",
            text(&out.stdout)
        );
    }
    let out = r.toolctl(1, &["fanout", "all", "hello", "--json"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout} {}", text(&out.stderr));
    for id in names {
        assert!(
            stdout.contains(&format!("\"{id}\"")),
            "{id} in the fan-out: {stdout}"
        );
    }

    // r0 gone for good: a call through r1 is not run, and says why.
    r.replicas[0].take();
    let out = r.toolctl(1, &["call", "e1", "hello"]);
    assert_exit(&out, 75, &["reconnecting", "replica r0"]);
    let out = r.toolctl(1, &["fanout", "all", "hello"]);
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        all.contains("e1") && all.contains("e2"),
        "every host reported: {all}"
    );
}
