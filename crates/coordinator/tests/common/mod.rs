//! An in-process coordinator on a loopback port with a development PKI, and gRPC clients for
//! each identity, for tests that need the real services but no processes. (It stays here, not
//! in `toolsrv-testkit`: a testkit depending on this crate would be built against a second copy
//! of it.)
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)] // Test fixture: fail loudly.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Streaming;
use tonic::transport::Channel;
use toolsrv_coordinator::CoordinatorConfig;
use toolsrv_proto::limits::MAX_MESSAGE_BYTES;
use toolsrv_proto::v1::agent_link_client::AgentLinkClient;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::tools_client::ToolsClient;
use toolsrv_proto::v1::{
    AgentMessage, CallEvent, CallResult, CoordinatorMessage, Hello, HostInfo, HostView,
    ListHostsRequest, ToolDefinition, ToolStatus, agent_message, call_event,
};
use toolsrv_tls::{Identity, Role, TlsFiles};

/// Every wait in these tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(20);

/// A running coordinator; dropping it stops it.
pub struct Coordinator {
    pub dir: tempfile::TempDir,
    pub url: String,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Coordinator {
    /// Starts a coordinator whose tools path holds `tools` (file name, content), with agents
    /// `web-1`, `web-2` and clients `alice`, `bob` in its PKI; `configure` adjusts the config.
    pub async fn start(
        tools: &[(&str, &str)],
        configure: impl FnOnce(&mut CoordinatorConfig, &Path),
    ) -> Self {
        Self::start_with(&["web-1", "web-2"], tools, configure).await
    }

    /// [`Coordinator::start`] with agent certificates for `agents` instead.
    pub async fn start_with(
        agents: &[&str],
        tools: &[(&str, &str)],
        configure: impl FnOnce(&mut CoordinatorConfig, &Path),
    ) -> Self {
        toolsrv_tls::install_crypto_provider();
        let dir = tempfile::tempdir().unwrap();
        let pki = dir.path().join("pki");
        toolsrv_testkit::write_pki(&pki, agents, &["alice", "bob"]).unwrap();
        let tools_dir = dir.path().join("tools");
        std::fs::create_dir_all(&tools_dir).unwrap();
        for (name, content) in tools {
            toolsrv_testkit::write(&tools_dir, name, content);
        }
        let mut config = CoordinatorConfig::new(
            vec![tools_dir],
            TlsFiles::in_dir(&pki, &Identity::Coordinator),
        );
        configure(&mut config, dir.path());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                toolsrv_coordinator::serve(config, listener, Default::default(), stop)
                    .await
                    .unwrap();
            }
        });
        Self {
            dir,
            url,
            stop,
            task: Some(task),
        }
    }

    pub fn pki(&self) -> PathBuf {
        self.dir.path().join("pki")
    }

    pub fn tools_dir(&self) -> PathBuf {
        self.dir.path().join("tools")
    }

    /// The certificate files of `identity`.
    pub fn files(&self, identity: &Identity) -> TlsFiles {
        TlsFiles::in_dir(&self.pki(), identity)
    }

    async fn channel(&self, identity: &Identity) -> Channel {
        let config = toolsrv_tls::client_config(&self.files(identity), Role::Coordinator).unwrap();
        let mut last = None;
        // The server task may not be accepting yet.
        for _ in 0..100 {
            match toolsrv_tls::connect(&self.url, config.clone()).await {
                Ok(channel) => return channel,
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("cannot connect to {}: {last:?}", self.url);
    }

    /// The client API as `identity`.
    pub async fn tools(&self, identity: &Identity) -> ToolsClient<Channel> {
        ToolsClient::new(self.channel(identity).await)
    }

    /// The agent link as `identity`.
    pub async fn agent_link(&self, identity: &Identity) -> AgentLinkClient<Channel> {
        AgentLinkClient::new(self.channel(identity).await)
    }

    /// Attaches as agent `hello.host_id` with its certificate and sends `hello`; returns the
    /// sender of the agent's next messages and the coordinator's messages.
    /// [`Coordinator::attach`] as agent `host_id`, with an otherwise default Hello.
    pub async fn attach_as(
        &self,
        host_id: &str,
    ) -> (mpsc::Sender<AgentMessage>, Streaming<CoordinatorMessage>) {
        self.attach(Hello {
            host_id: host_id.into(),
            agent_version: "test".into(),
            ..Hello::default()
        })
        .await
    }

    /// [`Coordinator::attach_as`], then a view of the first whole catalog sent in which the
    /// tools `visible` are visible (with a default definition) and no other.
    pub async fn attach_offering(
        &self,
        host_id: &str,
        visible: &[&str],
    ) -> (mpsc::Sender<AgentMessage>, Streaming<CoordinatorMessage>) {
        let (out, mut inbound) = self.attach_as(host_id).await;
        let revision = catalog_revision(&mut inbound).await;
        let tools = visible
            .iter()
            .map(|name| ToolStatus {
                name: (*name).into(),
                visible: true,
                definition: Some(ToolDefinition::default()),
                ..ToolStatus::default()
            })
            .collect();
        let view = HostView {
            catalog_revision: revision,
            tools,
            more: false,
        };
        let view = AgentMessage {
            msg: Some(agent_message::Msg::View(view)),
        };
        out.send(view).await.unwrap();
        (out, inbound)
    }

    pub async fn attach(
        &self,
        hello: Hello,
    ) -> (mpsc::Sender<AgentMessage>, Streaming<CoordinatorMessage>) {
        let mut link = self
            .agent_link(&agent(&hello.host_id))
            .await
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let (tx, rx) = mpsc::channel(4);
        let hello = AgentMessage {
            msg: Some(agent_message::Msg::Hello(hello)),
        };
        tx.send(hello).await.unwrap();
        let inbound = link
            .attach(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        (tx, inbound)
    }

    /// Host `id` as the client API lists it to `alice`.
    pub async fn host(&self, id: &str) -> Option<HostInfo> {
        let hosts = self
            .tools(&client("alice"))
            .await
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .list_hosts(ListHostsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .hosts;
        hosts.into_iter().find(|h| h.host_id == id)
    }

    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            tokio::time::timeout(WAIT, task).await.unwrap().unwrap();
        }
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The revision of the first whole catalog an attached agent is sent, within [`WAIT`].
pub async fn catalog_revision(inbound: &mut Streaming<CoordinatorMessage>) -> u64 {
    loop {
        let msg = tokio::time::timeout(WAIT, inbound.message())
            .await
            .expect("the coordinator answers")
            .unwrap()
            .unwrap();
        if let Some(In::Catalog(update)) = msg.msg
            && !update.more
        {
            return update.revision;
        }
    }
}

/// The result a call's event stream ends with, within [`WAIT`].
pub async fn call_result(events: &mut Streaming<CallEvent>) -> CallResult {
    tokio::time::timeout(WAIT, async {
        while let Some(event) = events.next().await {
            if let Some(call_event::Event::Result(result)) = event.unwrap().event {
                return result;
            }
        }
        panic!("the call stream ended without a result");
    })
    .await
    .expect("the call ends within the wait")
}

pub fn client(name: &str) -> Identity {
    Identity::Client(name.into())
}

pub fn agent(id: &str) -> Identity {
    Identity::Agent(id.into())
}

/// The next message of `kind` from the coordinator, within the wait.
pub async fn next<T>(
    inbound: &mut Streaming<CoordinatorMessage>,
    kind: impl Fn(In) -> Option<T>,
) -> T {
    tokio::time::timeout(WAIT, async {
        loop {
            let msg = inbound.message().await.unwrap().expect("the link stays up");
            if let Some(found) = msg.msg.and_then(&kind) {
                return found;
            }
        }
    })
    .await
    .expect("the coordinator sends it within the wait")
}

/// The records of `event` in the audit log of a coordinator configured with
/// `audit.jsonl` in its directory.
pub fn audited(coordinator: &Coordinator, event: &str) -> Vec<serde_json::Value> {
    let audit = std::fs::read_to_string(coordinator.dir.path().join("audit.jsonl")).unwrap();
    audit
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["event"] == event)
        .collect()
}
