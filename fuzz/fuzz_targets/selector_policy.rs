//! Host selectors and call policies: parsing any text, and matching/checking what parsed against a
//! fixed host, must never panic.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use toolsrv_coordinator::Policy;
use toolsrv_coordinator::selector::{Candidate, Selector};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let labels: BTreeMap<String, String> = [
        ("role".to_string(), "db".to_string()),
        ("zone".to_string(), "eu-west-1a".to_string()),
        ("empty".to_string(), String::new()),
    ]
    .into();
    let host = Candidate {
        id: "db-1",
        os: "linux",
        arch: "amd64",
        hostname: "db1.example.org",
        kernel: "6.1.0-18-amd64",
        sandbox: "enforced",
        labels: &labels,
    };
    if let Ok(selector) = Selector::parse(text) {
        let _ = selector.matches(&host);
        let _ = selector.exact_hosts().count();
    }
    if let Ok(policy) = Policy::parse(text) {
        let _ = policy.check("ci-runner", "service_status", &host);
        let _ = policy.sandbox_for(&host);
    }
});
