//! A seccomp filter for confined calls: what a process of a call may not do to processes outside
//! itself, where neither Landlock nor the dropped capabilities stop it
//!
//! A tool running as the agent's user (root, by default) passes the kernel's permission checks
//! for changing another process of that user: its resource limits (`prlimit`), its scheduling
//! (`setpriority`, `sched_set*`, `ioprio_set`). Landlock scopes signals and `ptrace`, not these.
//! With them, a tool could take every descriptor from the agent, from the calls' warden (which
//! then cannot end anything when the agent dies) or from another caller's call. The filter lets
//! a process change only itself (the calls take pid 0, as libc's `setrlimit`, `nice` and
//! `ionice` pass it) and refuses the rest with `EPERM`.
//!
//! It also answers `clone3` with `ENOSYS`, which libc takes as an old kernel and falls back to
//! `clone`: `clone3` can start a child straight in another cgroup (`CLONE_INTO_CGROUP`, given a
//! descriptor of a cgroup directory the call may read), out of the call's cgroup and so out of
//! its limits and of `cgroup.kill`. A seccomp filter cannot read `clone3`'s arguments, which
//! are in memory.
//!
//! Covered: x86-64 (64-bit, x32 and i386 calls) and AArch64; on other architectures no filter
//! is made and the sandbox facts say so.

/// One BPF instruction, as `struct sock_filter`
pub type Instruction = libc::sock_filter;

/// A finished filter, shared by every call of an agent
#[derive(Clone)]
pub struct Filter(pub(crate) std::sync::Arc<[Instruction]>);

impl std::fmt::Debug for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Filter({} instructions)", self.0.len())
    }
}

// Classic BPF, as seccomp runs it (linux/filter.h, linux/bpf_common.h): the class, with the
// size, mode, operation and source bits that are not 0.
/// `BPF_LD | BPF_W | BPF_ABS`
const BPF_LD_W_ABS: u16 = 0x20;
/// `BPF_JMP | BPF_JEQ | BPF_K`
const BPF_JEQ_K: u16 = 0x05 | 0x10;
/// `BPF_RET | BPF_K`
const BPF_RET_K: u16 = 0x06;
/// `BPF_ALU | BPF_AND | BPF_K`
const BPF_ALU_AND_K: u16 = 0x04 | 0x50;

// linux/seccomp.h
const RET_ALLOW: u32 = 0x7fff_0000;
const RET_ERRNO: u32 = 0x0005_0000;

// Offsets in `struct seccomp_data`: the call's number, the architecture, the low 32 bits of the
// first two arguments (little-endian). The kernel reads these arguments as `int` (`pid_t`,
// `which`, `who`), so the low half is all it sees.
const NR: u32 = 0;
const ARCH: u32 = 4;
const ARG0: u32 = 16;
const ARG1: u32 = 24;

/// `which` of `setpriority` that names a process (`PRIO_PROCESS`), and of `ioprio_set`
/// (`IOPRIO_WHO_PROCESS`)
const PRIO_PROCESS: u32 = 0;
const IOPRIO_WHO_PROCESS: u32 = 1;

/// What a call's number asks for
#[derive(Clone, Copy)]
enum Rule {
    /// Allowed when its first argument, a pid, is 0 (the caller)
    SelfOnly,
    /// Allowed when it names the caller: `(which, who) == (which_process, 0)`
    SelfByWhich(u32),
    /// Refused with `ENOSYS`
    Unavailable,
}

/// The numbers of one architecture's calls the filter looks at
struct Calls {
    arch: u32,
    /// Cleared from the number before comparing (x32's calls are the 64-bit ones with this bit)
    clear: u32,
    prlimit64: u32,
    setpriority: u32,
    sched_setaffinity: u32,
    sched_setscheduler: u32,
    sched_setparam: u32,
    sched_setattr: u32,
    ioprio_set: u32,
    clone3: u32,
}

impl Calls {
    fn rules(&self) -> [(u32, Rule); 8] {
        [
            (self.prlimit64, Rule::SelfOnly),
            (self.sched_setaffinity, Rule::SelfOnly),
            (self.sched_setscheduler, Rule::SelfOnly),
            (self.sched_setparam, Rule::SelfOnly),
            (self.sched_setattr, Rule::SelfOnly),
            (self.setpriority, Rule::SelfByWhich(PRIO_PROCESS)),
            (self.ioprio_set, Rule::SelfByWhich(IOPRIO_WHO_PROCESS)),
            (self.clone3, Rule::Unavailable),
        ]
    }
}

/// The architectures a process of this build may make calls as: its own, then (x86-64) i386
fn architectures() -> Vec<Calls> {
    if cfg!(target_arch = "x86_64") {
        vec![
            Calls {
                arch: 0xc000_003e,  // AUDIT_ARCH_X86_64
                clear: 0x4000_0000, // __X32_SYSCALL_BIT
                prlimit64: 302,
                setpriority: 141,
                sched_setaffinity: 203,
                sched_setscheduler: 144,
                sched_setparam: 142,
                sched_setattr: 314,
                ioprio_set: 251,
                clone3: 435,
            },
            Calls {
                arch: 0x4000_0003, // AUDIT_ARCH_I386
                clear: 0,
                prlimit64: 340,
                setpriority: 97,
                sched_setaffinity: 241,
                sched_setscheduler: 156,
                sched_setparam: 154,
                sched_setattr: 351,
                ioprio_set: 289,
                clone3: 435,
            },
        ]
    } else if cfg!(target_arch = "aarch64") {
        // asm-generic numbers
        vec![Calls {
            arch: 0xc000_00b7, // AUDIT_ARCH_AARCH64
            clear: 0,
            prlimit64: 261,
            setpriority: 140,
            sched_setaffinity: 122,
            sched_setscheduler: 119,
            sched_setparam: 118,
            sched_setattr: 274,
            ioprio_set: 30,
            clone3: 435,
        }]
    } else {
        Vec::new()
    }
}

/// A program being written: instructions, with jumps to labels resolved at the end
#[derive(Default)]
struct Program {
    code: Vec<Instruction>,
    /// (instruction index, label of the true branch, label of the false branch)
    jumps: Vec<(usize, usize, usize)>,
    /// Instruction index of each label, once placed
    labels: Vec<Option<usize>>,
}

impl Program {
    fn label(&mut self) -> usize {
        self.labels.push(None);
        self.labels.len() - 1
    }

    fn place(&mut self, label: usize) {
        self.labels[label] = Some(self.code.len());
    }

    fn op(&mut self, code: u16, k: u32) {
        self.code.push(Instruction {
            code,
            jt: 0,
            jf: 0,
            k,
        });
    }

    fn load(&mut self, offset: u32) {
        self.op(BPF_LD_W_ABS, offset);
    }

    /// If the accumulator equals `k`, go to `yes`, else to `no`
    fn jump_eq(&mut self, k: u32, yes: usize, no: usize) {
        self.jumps.push((self.code.len(), yes, no));
        self.op(BPF_JEQ_K, k);
    }

    fn ret(&mut self, action: u32) {
        self.op(BPF_RET_K, action);
    }

    /// The instructions, jumps resolved (each forward, within 255 instructions)
    fn finish(mut self) -> Option<Vec<Instruction>> {
        for (at, yes, no) in self.jumps {
            let offset = |label: usize| -> Option<u8> {
                let target = self.labels[label]?;
                u8::try_from(target.checked_sub(at + 1)?).ok()
            };
            self.code[at].jt = offset(yes)?;
            self.code[at].jf = offset(no)?;
        }
        Some(self.code)
    }
}

/// The filter for this build's architecture; `None` where none is made (see the module)
pub fn filter() -> Option<Filter> {
    program().map(|code| Filter(code.into()))
}

fn program() -> Option<Vec<Instruction>> {
    let arches = architectures();
    if arches.is_empty() {
        return None;
    }
    let mut p = Program::default();
    let allow = p.label();
    let eperm = p.label();
    let enosys = p.label();
    let self_only = p.label();
    let by_which: Vec<(u32, usize)> = [PRIO_PROCESS, IOPRIO_WHO_PROCESS]
        .into_iter()
        .map(|which| (which, p.label()))
        .collect();
    let blocks: Vec<usize> = arches.iter().map(|_| p.label()).collect();
    // Which architecture: a call made as one this filter does not know is let through.
    p.load(ARCH);
    for (i, calls) in arches.iter().enumerate() {
        let next = p.label();
        p.jump_eq(calls.arch, blocks[i], next);
        p.place(next);
    }
    p.ret(RET_ALLOW);
    for (i, calls) in arches.iter().enumerate() {
        p.place(blocks[i]);
        p.load(NR);
        if calls.clear != 0 {
            p.op(BPF_ALU_AND_K, !calls.clear);
        }
        for (nr, rule) in calls.rules() {
            let target = match rule {
                Rule::SelfOnly => self_only,
                Rule::SelfByWhich(which) => by_which
                    .iter()
                    .find(|(w, _)| *w == which)
                    .map(|(_, l)| *l)?,
                Rule::Unavailable => enosys,
            };
            let next = p.label();
            p.jump_eq(nr, target, next);
            p.place(next);
        }
        p.ret(RET_ALLOW);
    }
    p.place(self_only);
    p.load(ARG0);
    p.jump_eq(0, allow, eperm);
    for (which, label) in by_which {
        p.place(label);
        let who = p.label();
        p.load(ARG0);
        p.jump_eq(which, who, eperm);
        p.place(who);
        p.load(ARG1);
        p.jump_eq(0, allow, eperm);
    }
    p.place(allow);
    p.ret(RET_ALLOW);
    p.place(eperm);
    p.ret(RET_ERRNO | libc::EPERM as u32);
    p.place(enosys);
    p.ret(RET_ERRNO | libc::ENOSYS as u32);
    p.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `program` on one call as the kernel would (the few instructions it uses).
    fn run(program: &[Instruction], arch: u32, nr: u32, args: [u32; 2]) -> u32 {
        let mut acc = 0u32;
        let mut pc = 0usize;
        for _ in 0..program.len() {
            let i = program[pc];
            match i.code {
                BPF_LD_W_ABS => {
                    acc = match i.k {
                        NR => nr,
                        ARCH => arch,
                        ARG0 => args[0],
                        ARG1 => args[1],
                        other => panic!("load of offset {other}"),
                    }
                }
                BPF_ALU_AND_K => acc &= i.k,
                BPF_JEQ_K => {
                    pc += usize::from(if acc == i.k { i.jt } else { i.jf });
                }
                BPF_RET_K => return i.k,
                other => panic!("instruction {other:#x}"),
            }
            pc += 1;
        }
        panic!("ran off the end")
    }

    #[test]
    fn a_call_may_change_itself_only() {
        let Some(program) = program() else { return };
        let arches = architectures();
        let eperm = RET_ERRNO | libc::EPERM as u32;
        let enosys = RET_ERRNO | libc::ENOSYS as u32;
        for calls in &arches {
            let run = |nr, args| run(&program, calls.arch, nr, args);
            for nr in [
                calls.prlimit64,
                calls.sched_setaffinity,
                calls.sched_setscheduler,
                calls.sched_setparam,
                calls.sched_setattr,
            ] {
                assert_eq!(run(nr, [0, 0]), RET_ALLOW, "{nr} on itself");
                assert_eq!(run(nr, [4242, 0]), eperm, "{nr} on another");
            }
            assert_eq!(run(calls.setpriority, [PRIO_PROCESS, 0]), RET_ALLOW);
            assert_eq!(run(calls.setpriority, [PRIO_PROCESS, 4242]), eperm);
            assert_eq!(run(calls.setpriority, [2, 0]), eperm, "PRIO_USER");
            assert_eq!(run(calls.ioprio_set, [IOPRIO_WHO_PROCESS, 0]), RET_ALLOW);
            assert_eq!(run(calls.ioprio_set, [IOPRIO_WHO_PROCESS, 4242]), eperm);
            assert_eq!(run(calls.ioprio_set, [3, 0]), eperm, "IOPRIO_WHO_USER");
            assert_eq!(run(calls.clone3, [0, 0]), enosys);
            // Everything else passes: read, write, clone, kill (Landlock scopes signals).
            for nr in [0, 1, 56, 62, 39] {
                assert_eq!(run(nr, [4242, 4242]), RET_ALLOW, "{nr}");
            }
            if calls.clear != 0 {
                assert_eq!(run(calls.prlimit64 | calls.clear, [4242, 0]), eperm, "x32");
                assert_eq!(run(calls.prlimit64 | calls.clear, [0, 0]), RET_ALLOW, "x32");
            }
        }
        // An architecture the filter does not know passes.
        assert_eq!(
            run(&program, 0x1234, arches[0].prlimit64, [4242, 0]),
            RET_ALLOW
        );
    }

    #[test]
    fn this_builds_numbers_are_the_systems() {
        let Some(calls) = architectures().into_iter().next() else {
            return;
        };
        let libc_numbers = [
            (calls.prlimit64, libc::SYS_prlimit64),
            (calls.setpriority, libc::SYS_setpriority),
            (calls.sched_setaffinity, libc::SYS_sched_setaffinity),
            (calls.sched_setscheduler, libc::SYS_sched_setscheduler),
            (calls.sched_setparam, libc::SYS_sched_setparam),
            (calls.sched_setattr, libc::SYS_sched_setattr),
            (calls.ioprio_set, libc::SYS_ioprio_set),
            (calls.clone3, libc::SYS_clone3),
        ];
        for (ours, system) in libc_numbers {
            assert_eq!(libc::c_long::from(ours), system);
        }
    }
}
