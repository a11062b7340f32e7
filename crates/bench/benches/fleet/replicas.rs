//! Section `replicas`: two coordinator replicas on a three-member etcd (Debian `etcd-server`),
//! one real agent attached to the second. The same call through the replica that holds the
//! agent's link (local) and through the other one (relayed), interleaved, on one open
//! connection each.

use std::time::Duration;

use toolsrv_bench::BenchError;
use toolsrv_bench::procs::{
    Paths, connect, start_agent, start_coordinator_on, wait_for_tool, write_tools,
};
use toolsrv_bench::remote::{library_call, stream_call};
use toolsrv_bench::stats::{Table, fmt_ns};
use toolsrv_testkit::{EtcdCluster, try_free_port};

use super::{CALL_AGENT, ECHO, Sizes, ZEROS, paired, remote_script, verdict};

pub(crate) async fn replicas(paths: &Paths, sizes: Sizes) -> Result<(), BenchError> {
    println!(
        "\n7. replicas: a call relayed by another replica vs the same call through the replica \
         holding the agent's link (library call_to_end, one connection each, interleaved pairs, \
         order alternating)"
    );
    let etcd = tokio::task::spawn_blocking(|| EtcdCluster::try_start(3))
        .await
        .map_err(|e| e.to_string())??;
    let tools = paths.work.join("tools-replicas");
    let zeros = format!("head -c {} /dev/zero", sizes.stream_bytes);
    write_tools(&tools, &[(ECHO, remote_script()), (ZEROS, zeros.as_str())])?;
    let ports = [try_free_port()?, try_free_port()?];
    let mut replicas = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let args = vec![
            "--max-calls-per-client=100000".to_string(),
            "--max-calls-per-client-host=100000".to_string(),
            format!("--etcd={}", etcd.endpoints().join(",")),
            format!("--replica-id=r{i}"),
            format!("--advertise-url=https://127.0.0.1:{port}"),
        ];
        replicas.push(start_coordinator_on(
            paths,
            &format!("coordinator-replica-{i}"),
            &tools,
            (*port, "warn"),
            &args,
        )?);
    }
    let _agent = start_agent(
        paths,
        &replicas[1].url,
        CALL_AGENT,
        &[
            "--max-concurrent-calls=64".to_string(),
            "--output-cap=2147483648".to_string(),
        ],
    )?;
    let local = connect(paths, &replicas[1].url).await?;
    let relaying = connect(paths, &replicas[0].url).await?;
    wait_for_tool(&local, CALL_AGENT, ECHO, Duration::from_secs(30)).await?;
    wait_for_tool(&relaying, CALL_AGENT, ECHO, Duration::from_secs(30)).await?;
    let pair = |relayed_first: bool| {
        let (local, relaying) = (&local, &relaying);
        async move {
            if relayed_first {
                let r = library_call(relaying, CALL_AGENT, ECHO).await?;
                Ok::<_, BenchError>((r, library_call(local, CALL_AGENT, ECHO).await?))
            } else {
                let l = library_call(local, CALL_AGENT, ECHO).await?;
                Ok((library_call(relaying, CALL_AGENT, ECHO).await?, l))
            }
        }
    };
    let (r, l, pd) = paired(
        sizes.lib_pairs,
        [
            "relayed by the other replica",
            "through the replica holding the link",
        ],
        pair,
    )
    .await?;
    if let (Some(l), Some(r), Some(pd)) = (l, r, pd) {
        println!(
            "goal: a relayed call under 0.5 ms more than a local one at the median -> {} \
             (medians differ by {}; median per-pair difference {})",
            verdict(r.median - l.median < 5e5 && pd.median < 5e5),
            fmt_ns(r.median - l.median),
            fmt_ns(pd.median)
        );
    }

    // Throughput: the same stream of zeros through each replica, alternating.
    let mut table = Table::new(["stdout stream", "run", "MB/s", "last byte"]);
    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for run in 1..=sizes.stream_reps.max(2) {
        for (k, (label, client)) in [
            ("through the replica holding the link", &local),
            ("relayed by the other replica", &relaying),
        ]
        .into_iter()
        .enumerate()
        {
            let r = stream_call(
                client,
                CALL_AGENT,
                ZEROS,
                sizes.stream_bytes,
                Duration::from_secs(300),
                &mut || {},
            )
            .await?;
            rates[k].push(r.mb_per_sec());
            table.row([
                label.to_string(),
                run.to_string(),
                format!("{:.0}", r.mb_per_sec()),
                format!("{:.2} s", r.last_byte.as_secs_f64()),
            ]);
        }
    }
    print!("{}", table.render());
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or_default()
    };
    let (l, r) = (median(&mut rates[0]), median(&mut rates[1]));
    println!(
        "{} MiB of stdout: {l:.0} MB/s through the replica holding the link, {r:.0} MB/s relayed ({:.0} % of it)",
        sizes.stream_bytes >> 20,
        if l > 0.0 { 100.0 * r / l } else { 0.0 }
    );
    Ok(())
}
