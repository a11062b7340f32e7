//! The process's own figures, read from `/proc/self` at every scrape: memory, CPU time, open
//! files, threads and start time (the same series Prometheus client libraries call
//! `process_*`, under the `toolsrv_` prefix).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;

use crate::encode_gauge;

/// Registered by [`crate::registry`]; on systems without `/proc` it reports nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessCollector;

/// What `/proc/self` says, in base units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessStats {
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub cpu_seconds: f64,
    pub threads: u64,
    /// Unix time.
    pub start_time_seconds: u64,
    pub open_fds: u64,
    pub max_fds: Option<u64>,
}

impl ProcessStats {
    /// The current process's figures; `None` where `/proc` is missing or unreadable.
    pub fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // The command name (field 2) may hold spaces and parentheses: fields are counted
        // after its last ')'.
        let rest = stat.get(stat.rfind(')')? + 1..)?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // `rest` starts at field 3 (state): field N is fields[N - 3].
        let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        let ticks = clock_ticks()?;
        let page = page_size()?;
        let cpu_ticks = field(14)? + field(15)?;
        let start_ticks = field(22)?;
        Some(Self {
            resident_bytes: field(24)? * page,
            virtual_bytes: field(23)?,
            cpu_seconds: cpu_ticks as f64 / ticks as f64,
            threads: field(20)?,
            start_time_seconds: boot_time()? + start_ticks / ticks,
            open_fds: std::fs::read_dir("/proc/self/fd").ok()?.count() as u64,
            max_fds: max_open_files(),
        })
    }
}

#[allow(unsafe_code)]
fn clock_ticks() -> Option<u64> {
    // SAFETY: sysconf reads a constant of the system; it has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|t| *t > 0)
}

#[allow(unsafe_code)]
fn page_size() -> Option<u64> {
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().filter(|p| *p > 0)
}

fn boot_time() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines()
        .find_map(|line| line.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

fn max_open_files() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    // "Max open files            1024                 1048576              files"
    line.split_whitespace().nth(3)?.parse().ok()
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(stats) = ProcessStats::read() else {
            return Ok(());
        };
        let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        encode_gauge(
            &mut encoder,
            "process_resident_memory_bytes",
            "Resident memory of this process",
            gauge(stats.resident_bytes),
        )?;
        encode_gauge(
            &mut encoder,
            "process_virtual_memory_bytes",
            "Virtual memory of this process",
            gauge(stats.virtual_bytes),
        )?;
        let cpu = ConstCounter::new(stats.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "CPU time (user and system) this process has used",
            None,
            cpu.metric_type(),
        )?)?;
        encode_gauge(
            &mut encoder,
            "process_threads",
            "Threads of this process",
            gauge(stats.threads),
        )?;
        encode_gauge(
            &mut encoder,
            "process_start_time_seconds",
            "When this process started (Unix time)",
            gauge(stats.start_time_seconds),
        )?;
        encode_gauge(
            &mut encoder,
            "process_open_fds",
            "File descriptors this process has open",
            gauge(stats.open_fds),
        )?;
        if let Some(max) = stats.max_fds {
            encode_gauge(
                &mut encoder,
                "process_max_fds",
                "The most file descriptors this process may open (RLIMIT_NOFILE)",
                gauge(max),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn figures_of_this_process_are_plausible() {
        let before = ProcessStats::read().unwrap();
        let keep: Vec<u8> = vec![1; 8 << 20];
        let files: Vec<_> = (0..64)
            .map(|_| std::fs::File::open("/proc/self/stat").unwrap())
            .collect();
        let after = ProcessStats::read().unwrap();
        assert!(
            after.resident_bytes >= before.resident_bytes + (7 << 20),
            "{before:?} {after:?}"
        );
        assert!(after.virtual_bytes >= after.resident_bytes);
        // Other tests of this binary open and close files meanwhile: only a floor holds.
        assert!(after.open_fds >= 64, "{after:?}");
        assert!(after.threads >= 1);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(after.start_time_seconds <= now + 1 && after.start_time_seconds + 3600 > now);
        assert!(after.max_fds.unwrap() >= after.open_fds);
        drop((std::hint::black_box(keep), files));
    }
}
