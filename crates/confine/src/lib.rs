//! Confinement of tool calls: what a call may read and write, the processes and resources it may use, the environment it sees, and the user it runs as
//!
//! A [`Confiner`] is set up once per agent: it probes what the host can enforce (the Landlock
//! ABI, the cgroup hierarchies and their controllers, the `--run-as` user), plans the rules
//! every call shares, and reports [`Abilities`]. For each call, [`Confiner::prepare`] makes a
//! private directory (the call's `TMPDIR` and `HOME`, and its working directory unless the
//! caller named one), the call's cgroups with their limits, its Landlock rule set and its
//! environment, and returns a [`CallJail`] that the process joins between fork and exec
//! ([`CallJail::install`]) and that ends every process of the call and removes what was made
//! ([`CallJail::kill`], [`CallJail::release`]).
//!
//! Architecture invariant: nothing of the agent's own files (its state directory, keys and
//! configuration, the "hidden" paths) is reachable by a confined call, whatever the defaults
//! or the coordinator's grants allow: a grant inside a hidden path is dropped, and a hidden
//! path beneath a granted directory is carved out of it ([`fs_rules`]).
//!
//! Architecture invariant: a confined call sees only the allowlisted variables of the agent's
//! environment ([`env::ALLOWED`], `LC_*`, what the configuration adds) and the contract
//! variables the agent sets ([`env::CONTRACT`]).
//!
//! Architecture invariant: every process of a confined call is in the call's cgroups from
//! before the tool runs, and none is left when the call ends.

mod cgroup;
pub mod env;
mod error;
#[cfg(target_os = "linux")]
pub mod fs_rules;
mod jail;
mod profile;
pub mod seccomp;
#[cfg(target_os = "linux")]
pub mod spawn;
mod sys;
pub mod warden;

pub use cgroup::{Controller, LimitHit};
pub use error::ConfineError;
pub use jail::{
    Abilities, CallJail, CallPlan, Confiner, DEVICES, Level, Mode, Prepared, SYSTEM_READ, Settings,
};
pub use profile::{Grant, Limits, Profile, glob, grant_for, parse_cpu, parse_size};
#[cfg(target_os = "linux")]
pub use sys::{DROPPED_CAPABILITIES, close_inherited_on_exec, scrub_env_value};
