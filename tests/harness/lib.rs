//! Test harness of the workspace tests: a development PKI, and coordinator and agent processes
//! on loopback ports, from `toolsrv-testkit` (where they are shared with the per-crate tests
//! and the benches).
//!
//! Every process runs in its own process group and is killed when its handle drops; every wait
//! is bounded.

pub use toolsrv_testkit::{
    AgentSpec, LineWatch, Pki, Proc, Prometheus, TestFleet, TestkitError, Venv, assert_exit, bin,
    ca_pin_in, decisions, ensure_program, find_model_dir, finish_child, free_port, http_get,
    json_lines, mpnet_model_dir, must, run_bounded, text, try_bin, try_run_bounded, try_wait_for,
    wait_for, wait_until, write, write_executable, write_file,
};

/// A fleet under test: one PKI, one coordinator, any number of agents (the name these tests
/// use for [`TestFleet`]).
pub use toolsrv_testkit::TestFleet as Fleet;
