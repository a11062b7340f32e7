//! Test harness of the workspace tests: a development PKI, and coordinator and agent processes
//! on loopback ports, from `toolsrv-testkit` (where they are shared with the per-crate tests
//! and the benches).
//!
//! Every process runs in its own process group and is killed when its handle drops; every wait
//! is bounded.

pub use toolsrv_testkit::{
    AgentSpec, LineWatch, Pki, Proc, Prometheus, TestFleet, TestkitError, Venv, assert_exit, bin,
    ca_pin_in, decisions, ensure_program, fake_version_manager, find_model_dir, finish_child,
    free_port, http_get, json_lines, mpnet_model_dir, must, run_bounded, text, try_bin,
    try_run_bounded, try_wait_for, wait_for, wait_until, write, write_executable, write_file,
};

/// A fleet under test: one PKI, one coordinator, any number of agents (the name these tests
/// use for [`TestFleet`]).
pub use toolsrv_testkit::TestFleet as Fleet;

/// A runtime for a test that speaks gRPC itself, with the TLS provider installed.
#[allow(clippy::expect_used)] // A test fixture: fails loudly.
pub fn runtime() -> tokio::runtime::Runtime {
    toolsrv_tls::install_crypto_provider();
    tokio::runtime::Runtime::new().expect("a tokio runtime")
}

/// A connection to the fleet's coordinator from a peer without a certificate, as a host that
/// comes to join has.
#[allow(clippy::expect_used)] // A test fixture: fails loudly.
pub async fn anonymous_channel(fleet: &Fleet) -> tonic::transport::Channel {
    let tls = toolsrv_tls::anonymous_client_config(
        &fleet.pki.path("ca.pem"),
        toolsrv_tls::Role::Coordinator,
    )
    .expect("a client configuration without a certificate");
    toolsrv_tls::connect(&fleet.url(), tls)
        .await
        .expect("a connection to the coordinator")
}

/// Asserts that two `--json` answers of `find` rank the same tools in the same order with the
/// same scores, to 1e-6: two processes that rank alike may still differ in the last bits of a
/// score (the coordinator sums a catalog's vectors in its hash map's order, which differs from
/// one process to the next).
pub fn assert_same_ranking(a: &serde_json::Value, b: &serde_json::Value) {
    let hits = |found: &serde_json::Value| -> Vec<(String, f64)> {
        found
            .as_array()
            .into_iter()
            .flatten()
            .map(|hit| {
                let name = hit["name"].as_str().unwrap_or_default().to_string();
                (name, hit["score"].as_f64().unwrap_or(f64::NAN))
            })
            .collect()
    };
    let (a_hits, b_hits) = (hits(a), hits(b));
    let names = |h: &[(String, f64)]| h.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&a_hits), names(&b_hits), "{a}\n{b}");
    for ((name, x), (_, y)) in a_hits.iter().zip(&b_hits) {
        assert!((x - y).abs() < 1e-6, "{name}: {x} and {y}\n{a}\n{b}");
    }
}
