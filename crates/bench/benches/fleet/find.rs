//! Section `find` (run only when named: it needs the encoder's files): `FindTools` end to end,
//! from the library client over mutual TLS to a real coordinator that ranks 1,000 tools which
//! stand-in hosts report visible. Once with the lexical ranker alone, once fused with the
//! encoder (`--find-model`: `TOOLSRV_FIND_MODEL`, else `~/.cache/toolsrv/all-MiniLM-L6-v2`,
//! fetched there when missing). The catalog and the requests are the ones of `toolsrv-find`'s
//! own benchmark, so the two sets of figures differ by the RPC and the coordinator's share.

use std::path::Path;
use std::time::{Duration, Instant};

use toolsrv_bench::BenchError;
use toolsrv_bench::procs::{Paths, ProcMem, connect, start_coordinator_on};
use toolsrv_bench::stats::Table;
use toolsrv_client::Client;
use toolsrv_proto::v1::FindToolsResponse;
use toolsrv_testkit::fake::{FakeAgents, fake_id};
use toolsrv_testkit::try_free_port;

use super::{HEADER, Sizes, find_catalog, row};

/// Tools in the catalog, as in `toolsrv-find`'s benchmark.
const TOOLS: usize = 1000;
/// Stand-in hosts reporting every tool visible, unless `FLEET_FIND_HOSTS` says otherwise (at
/// most the PKI's stand-in hosts).
const HOSTS: usize = 10;
/// Rounds over the requests for each timed row.
const ROUNDS: usize = 3;
/// Matches asked for, as a model's `tool_search` would.
const LIMIT: u32 = 5;
/// How long any one wait of this section may take (an index build with the larger encoder
/// takes over two minutes here).
const WAIT: Duration = Duration::from_secs(600);

/// One labelled request of the evaluation set.
#[derive(Debug)]
struct Request {
    query: String,
    expected: Option<String>,
    /// `keyword` when it shares a keyword with its tool; otherwise a paraphrase.
    kind: String,
}

pub(crate) async fn find(paths: &Paths, _sizes: Sizes) -> Result<(), BenchError> {
    let eval = Path::new(env!("CARGO_MANIFEST_DIR")).join("../find/eval");
    let tools = paths.work.join("tools-find");
    let written = write_catalog(&eval.join("tools"), &tools)?;
    let requests = requests(&eval.join("queries.jsonl"))?;
    let model = toolsrv_testkit::find_model_dir();
    let hosts = match std::env::var("FLEET_FIND_HOSTS") {
        Ok(n) => n
            .parse::<usize>()
            .map_err(|e| format!("FLEET_FIND_HOSTS={n}: not a number: {e}"))?,
        Err(_) => HOSTS,
    };
    println!(
        "\nfind: FindTools through a real coordinator, {written} tools reported visible by \
         {hosts} stand-in hosts, {} requests x {ROUNDS} rounds, limit {LIMIT}; model {}",
        requests.len(),
        model.display()
    );

    let mut table = Table::new(HEADER);
    let mut notes = Vec::new();
    for (ranker, extra) in [
        ("lexical", None),
        ("fused", Some(format!("--find-model={}", model.display()))),
    ] {
        // The stand-in hosts share two cores with the coordinator, and each is shipped the
        // whole catalog at once: relaxed link timing keeps a starved one from being lost,
        // which is not what this section measures.
        let mut args = vec![
            "--max-finds-per-client=64".to_string(),
            "--keepalive-ms=5000".to_string(),
            "--lost-after-ms=120000".to_string(),
        ];
        args.extend(extra);
        let coordinator = start_coordinator_on(
            paths,
            &format!("coordinator-find-{ranker}"),
            &tools,
            (try_free_port()?, "warn"),
            &args,
        )?;
        let ids: Vec<String> = (0..hosts).map(fake_id).collect();
        let fleet = FakeAgents::start(&coordinator.url, &paths.pki, ids, 4).await?;
        fleet.wait_ready(WAIT).await?;
        let client = connect(paths, &coordinator.url).await?;
        // The stand-ins count a view as sent; wait until the coordinator holds every one.
        let started = Instant::now();
        loop {
            let listed = client.hosts().await?;
            let full = listed
                .iter()
                .filter(|h| h.visible_tools as usize == written)
                .count();
            if full == hosts {
                break;
            }
            if started.elapsed() > WAIT {
                return Err(format!("{full} of {hosts} hosts' views stored after {WAIT:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        // Until the index is built, requests wait for it, or, if an earlier build (of fewer
        // views) is done, are answered from that one, and while the encoder embeds the catalog
        // by words alone (`meaning_pending`): the time to the first answer by the ranker asked
        // for that finds a labelled request's tool is the build, seen from a client.
        let probe = requests
            .iter()
            .find(|r| r.kind == "keyword" && r.expected.is_some())
            .ok_or("no labelled keyword request")?;
        let started = Instant::now();
        loop {
            let answer = find_once(&client, &fake_id(0), &probe.query).await?;
            let seen = || {
                let names: Vec<&str> = answer.matches.iter().map(|m| m.name.as_str()).collect();
                format!(
                    "ranker `{}`, meaning_pending {}, matches {names:?}",
                    answer.ranker, answer.meaning_pending
                )
            };
            if answer.ranker == ranker
                && !answer.meaning_pending
                && answer
                    .matches
                    .iter()
                    .any(|m| Some(&m.name) == probe.expected.as_ref())
            {
                break;
            }
            if started.elapsed() > WAIT {
                return Err(format!(
                    "`{}` (for `{}`) not found by the {ranker} ranker after {WAIT:?}; the last \
                     answer: {}",
                    probe.query,
                    probe.expected.as_deref().unwrap_or_default(),
                    seen()
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let build = started.elapsed();
        let resident = coordinator.proc.mem()?.rss_kib;
        for (selector, label) in [(fake_id(0), "one host"), ("all".to_string(), "all hosts")] {
            let mut times = Vec::with_capacity(ROUNDS * requests.len());
            let mut recall = Recall::default();
            for round in 0..ROUNDS {
                for r in &requests {
                    let started = Instant::now();
                    let answer = find_once(&client, &selector, &r.query).await?;
                    times.push(started.elapsed());
                    // Every stand-in host offers every tool.
                    let want = if label == "one host" { 1 } else { hosts };
                    if let Some(m) = answer.matches.iter().find(|m| m.hosts.len() != want) {
                        return Err(format!(
                            "`{}`: {} offered by {} hosts, not {want}",
                            r.query,
                            m.name,
                            m.hosts.len()
                        )
                        .into());
                    }
                    if round == 0 {
                        recall.count(r, &answer);
                    }
                }
            }
            row(&mut table, &format!("{ranker}, {label}"), &times);
            if label == "one host" {
                notes.push(format!(
                    "{ranker}: first answer finding its tool after the views {:.1} s (index \
                     build), coordinator resident then {:.0} MiB; recall@3 {}",
                    build.as_secs_f64(),
                    resident as f64 / 1024.0,
                    recall.text()
                ));
            }
        }
        if let Some(e) = fleet.stop().await {
            return Err(format!("a stand-in host failed: {e}").into());
        }
    }
    println!("{}", table.render());
    for note in notes {
        println!("{note}");
    }
    Ok(())
}

async fn find_once(
    client: &Client,
    selector: &str,
    query: &str,
) -> Result<FindToolsResponse, BenchError> {
    match tokio::time::timeout(WAIT, client.find_tools(selector, query, LIMIT)).await {
        Ok(answer) => Ok(answer?),
        Err(_) => Err(format!("FindTools `{query}`: no answer within {WAIT:?}").into()),
    }
}

/// Labelled requests whose tool came in the first three.
#[derive(Debug, Default)]
struct Recall {
    paraphrases: (usize, usize),
    all: (usize, usize),
}

impl Recall {
    fn count(&mut self, request: &Request, answer: &FindToolsResponse) {
        let Some(expected) = &request.expected else {
            return;
        };
        let found = answer.matches.iter().take(3).any(|m| &m.name == expected);
        let add = |(hits, n): &mut (usize, usize)| {
            *hits += usize::from(found);
            *n += 1;
        };
        add(&mut self.all);
        if request.kind != "keyword" {
            add(&mut self.paraphrases);
        }
    }

    fn text(&self) -> String {
        let ratio =
            |(hits, n): (usize, usize)| format!("{hits}/{n} = {:.3}", hits as f64 / n as f64);
        format!(
            "{} on paraphrases, {} on all labelled requests",
            ratio(self.paraphrases),
            ratio(self.all)
        )
    }
}

/// Copies the evaluation catalog into `dir` and adds made-up tools up to [`TOOLS`]; how many
/// tools it holds.
fn write_catalog(eval_tools: &Path, dir: &Path) -> Result<usize, BenchError> {
    std::fs::create_dir_all(dir)?;
    let mut n = 0;
    for entry in std::fs::read_dir(eval_tools)? {
        let entry = entry?;
        let name = entry.file_name();
        std::fs::copy(entry.path(), dir.join(&name))?;
        n += usize::from(Path::new(&name).extension().is_some_and(|e| e == "meta"));
    }
    for (name, doc) in find_catalog::generated()
        .into_iter()
        .take(TOOLS.saturating_sub(n))
    {
        let meta = serde_json::json!({
            "description": doc.description,
            "prompt": doc.prompt,
            "keywords": doc.keywords,
            "cmd": "true",
        });
        std::fs::write(dir.join(format!("{name}.meta")), meta.to_string())?;
        n += 1;
    }
    Ok(n)
}

fn requests(path: &Path) -> Result<Vec<Request>, BenchError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut requests = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{}:{}: {e}", path.display(), i + 1))?;
        let text = |field: &str| value[field].as_str().map(str::to_string);
        requests.push(Request {
            query: text("query")
                .ok_or_else(|| format!("{}:{}: no query", path.display(), i + 1))?,
            expected: text("expected"),
            kind: text("kind").unwrap_or_default(),
        });
    }
    Ok(requests)
}
