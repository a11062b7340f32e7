//! Benchmarks of toolsrv: the measured functions, shared by the bench mains and the smoke test.
//! The fleet bench (`benches/fleet.rs`, run by `fleet-bench.sh`) drives real coordinator and agent
//! processes ([`procs`]), `toolctl`, `ssh` and the library ([`remote`]), and a load generator that
//! stands in for many hosts (`toolsrv_testkit::fake`; [`messages`] measures what it exchanges).
//!
//! Each bench in `benches/` is a plain `main` (no criterion: it would dominate compile time on
//! two cores) that calls into these modules, times with `std::time::Instant` and prints a
//! table. `tests/smoke.rs` runs every measured function once on tiny inputs so CI notices
//! when a bench stops working.

pub mod call;
pub mod fixtures;
pub mod messages;
pub mod procs;
pub mod remote;
pub mod scan;
pub mod stats;
pub mod variants;

/// Errors of a bench run. A bench either measures what it claims or stops, so a boxed error
/// carrying its message is all a caller needs; no caller matches on kinds.
pub type BenchError = Box<dyn std::error::Error + Send + Sync>;

/// Whether `BENCH_QUICK=1` asks for a short run (fewer iterations).
pub fn quick() -> bool {
    std::env::var_os("BENCH_QUICK").is_some_and(|v| v == "1")
}

/// `full` iterations, or `quick_n` in quick mode.
pub fn iterations(full: usize, quick_n: usize) -> usize {
    if quick() { quick_n } else { full }
}
