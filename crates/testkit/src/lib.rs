//! What the tests and benches of toolsrv share: a development PKI, `toolsrv` and `toolctl`
//! processes on loopback ports, fake agents, an etcd cluster, bounded waits and small file
//! helpers.
//!
//! Every fallible step returns a [`TestkitError`] (`try_*`, for the benches and for tests
//! that expect a failure); the plain names are wrappers that fail the test instead. Every
//! process runs in its own process group and is killed with it when its handle drops; every
//! wait is bounded.
//!
//! This crate depends only on the protocol and TLS crates, so that any crate's tests can use
//! it without a second copy of that crate's types. Fixtures that need a coordinator or an
//! agent in process stay in those crates' tests.

mod bin;
mod error;
mod etcd;
pub mod fake;
mod files;
mod fleet;
mod http;
mod kube;
mod launch;
mod link;
mod model;
mod pki;
mod proc;
mod python;
mod raw_h2;
mod wait;
mod watch;

pub use bin::{bin, profile_dir, try_bin, workspace_root};
pub use error::{Result, TestkitError, must};
pub use etcd::{EtcdClientTls, EtcdCluster, EtcdMember};
pub use files::{
    assert_exit, decisions, fake_version_manager, json_lines, line_starting, mkfifo, text,
    try_write_file, write, write_executable, write_file,
};
pub use fleet::{AgentSpec, TestFleet};
pub use http::{Prometheus, ensure_program, http_get};
pub use kube::{COORDINATOR_TOKEN, FakeKubeApi, ServiceAccountToken};
pub use launch::{AgentLaunch, CoordinatorLaunch, client_env};
pub use link::TcpLink;
pub use model::{find_model_dir, mpnet_model_dir};
pub use pki::{
    Pki, ca_pin_in, sign_with_ca, sign_with_ca_between, stem_files, tls_args, uri_san, write_key,
    write_pki,
};
pub use proc::{Proc, free_port, try_free_port};
pub use python::Venv;
pub use raw_h2::{
    Outcomes, StalledPeer, Streams, Unread, grpc_prefix, open_bodiless_streams,
    open_unfinished_streams, open_unread_answers,
};
pub use wait::{
    finish_child, run_bounded, try_finish_child, try_run_bounded, try_wait_for, wait_for,
    wait_until,
};
pub use watch::LineWatch;
