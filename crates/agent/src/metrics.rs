//! The agent's metrics (`--metrics-listen`): its calls, its link to the coordinator, and what
//! its host offers. Labels take a handful of values each (status, stream, tool state), never a
//! tool name, call id or argument.

use toolsrv_metrics::{Counter, Family, Gauge, Histogram, Labels, Outcome, Registry};
use toolsrv_proto::v1::{CallResult, HostView, OutputStream};

/// Counters and gauges updated as the agent works; clones share them.
#[derive(Debug, Clone)]
pub struct AgentMetrics {
    calls: Family<Labels<1>, Counter>,
    running: Gauge,
    waiting: Gauge,
    duration: Histogram,
    streamed: Family<Labels<1>, Counter>,
    link_up: Gauge,
    attachments: Counter,
    revision: Gauge,
    tools: Family<Labels<1>, Gauge>,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        Self {
            calls: Family::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            duration: Histogram::new(toolsrv_metrics::duration_buckets()),
            streamed: Family::default(),
            link_up: Gauge::default(),
            attachments: Counter::default(),
            revision: Gauge::default(),
            tools: Family::default(),
        }
    }
}

impl AgentMetrics {
    /// Registers every metric of the agent in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "agent_calls",
            "Calls this agent ended, by status (ok, tool_error, timed_out, cancelled, ...)",
            self.calls.clone(),
        );
        registry.register(
            "agent_calls_running",
            "Calls holding one of this agent's call slots now",
            self.running.clone(),
        );
        registry.register(
            "agent_calls_waiting",
            "Calls waiting for a free call slot (--max-concurrent-calls)",
            self.waiting.clone(),
        );
        registry.register(
            "agent_call_duration_seconds",
            "Time from a call's arrival at this agent to its result, whatever its status",
            self.duration.clone(),
        );
        registry.register(
            "agent_streamed_bytes",
            "Output bytes this agent's calls sent to the coordinator, by stream",
            self.streamed.clone(),
        );
        registry.register(
            "agent_link_up",
            "1 while this agent is attached to the coordinator, else 0",
            self.link_up.clone(),
        );
        registry.register(
            "agent_attachments",
            "Times this agent attached to the coordinator (a reconnect counts again)",
            self.attachments.clone(),
        );
        registry.register(
            "catalog_revision",
            "The catalog revision of this agent's latest view of its host",
            self.revision.clone(),
        );
        registry.register(
            "agent_tools",
            "Tools of the catalog on this host, by state (visible: a variant matches; hidden: none does)",
            self.tools.clone(),
        );
    }

    /// A call arrived; the guard records its end (a dropped guard counts as `cancelled`).
    pub fn call(&self) -> CallMeter {
        let m = self.clone();
        CallMeter(Outcome::new(Box::new(move |status, elapsed| {
            m.calls.get_or_create(&[("status", status)]).inc();
            m.duration.observe(elapsed.as_secs_f64());
        })))
    }

    /// A call waits for a slot until the guard is dropped.
    pub fn waiting(&self) -> SlotWait {
        self.waiting.inc();
        SlotWait(self.waiting.clone())
    }

    /// A call holds a slot until the guard is dropped.
    pub fn running(&self) -> SlotWait {
        self.running.inc();
        SlotWait(self.running.clone())
    }

    pub fn streamed(&self, stream: OutputStream, bytes: usize) {
        let name = match stream {
            OutputStream::Stderr => "stderr",
            _ => "stdout",
        };
        self.streamed
            .get_or_create(&[("stream", name)])
            .inc_by(bytes as u64);
    }

    pub fn attached(&self) {
        self.attachments.inc();
        self.link_up.set(1);
    }

    pub fn detached(&self) {
        self.link_up.set(0);
    }

    /// The view the agent reports now.
    pub fn view(&self, view: &HostView) {
        self.revision
            .set(i64::try_from(view.catalog_revision).unwrap_or(i64::MAX));
        let visible = view.tools.iter().filter(|t| t.visible).count();
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.tools
            .get_or_create(&[("state", "visible")])
            .set(count(visible));
        self.tools
            .get_or_create(&[("state", "hidden")])
            .set(count(view.tools.len() - visible));
    }
}

/// A gauge held up while the guard lives.
#[derive(Debug)]
pub struct SlotWait(Gauge);

impl Drop for SlotWait {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Records how a call ended.
type Record = Box<dyn FnOnce(&'static str, std::time::Duration) + Send + Sync>;

/// A call being measured; see [`AgentMetrics::call`].
#[derive(Debug)]
pub struct CallMeter(Outcome<Record>);

impl CallMeter {
    pub fn finish(self, result: &CallResult) {
        self.0.finish(toolsrv_proto::status_name(result.status));
    }
}
