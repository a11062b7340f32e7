//! A tiny in-process coordinator: each Attach is handed to the test as a pair of channels.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use toolsrv_proto::v1::agent_link_server::{AgentLink, AgentLinkServer};
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::{AgentMessage, BlobChunk, CoordinatorMessage, FetchBlobRequest};

/// One attached agent, as the test sees it.
pub struct Attached {
    pub from_agent: Streaming<AgentMessage>,
    pub to_agent: mpsc::Sender<Result<CoordinatorMessage, Status>>,
}

impl Attached {
    /// The next message other than a keepalive, within `within`.
    pub async fn next(&mut self, within: Duration) -> Option<Out> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let msg = tokio::time::timeout_at(deadline, self.from_agent.message())
                .await
                .expect("timed out waiting for the agent")
                .ok()??;
            match msg.msg {
                Some(Out::Keepalive(_)) => continue,
                other => return other,
            }
        }
    }

    pub async fn send(&self, msg: In) {
        self.to_agent
            .send(Ok(CoordinatorMessage { msg: Some(msg) }))
            .await
            .unwrap();
    }
}

#[derive(Clone)]
pub struct Fake {
    attached: mpsc::Sender<Attached>,
    pub blobs: Arc<Mutex<HashMap<String, Vec<u8>>>>,
    /// Status codes to refuse the next attaches with.
    pub refuse: Arc<Mutex<Vec<Status>>>,
    /// The TLS identity of each attaching peer (`None` over plain TCP).
    pub peers: Arc<Mutex<Vec<Option<toolsrv_tls::Identity>>>>,
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl AgentLink for Fake {
    type AttachStream = BoxStream<CoordinatorMessage>;
    type FetchBlobStream = BoxStream<BlobChunk>;

    async fn attach(
        &self,
        request: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let peer = toolsrv_tls::peer_of(&request).map(|p| p.identity.clone());
        self.peers.lock().unwrap().push(peer);
        if let Some(status) = self.refuse.lock().unwrap().pop() {
            return Err(status);
        }
        let (to_agent, rx) = mpsc::channel(64);
        let _ = self
            .attached
            .send(Attached {
                from_agent: request.into_inner(),
                to_agent,
            })
            .await;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn fetch_blob(
        &self,
        request: Request<FetchBlobRequest>,
    ) -> Result<Response<Self::FetchBlobStream>, Status> {
        let sha = request.into_inner().sha256;
        let data = self
            .blobs
            .lock()
            .unwrap()
            .get(&sha)
            .cloned()
            .ok_or_else(|| Status::not_found(sha))?;
        let chunks: Vec<_> = data
            .chunks(1000)
            .map(|c| Ok(BlobChunk { data: c.to_vec() }))
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }
}

/// Serves a fake coordinator on 127.0.0.1 (plain TCP); attaches arrive on the returned receiver.
pub async fn serve(stop: CancellationToken) -> (SocketAddr, Fake, mpsc::Receiver<Attached>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (fake, rx) = fake();
    let server = tonic::transport::Server::builder()
        .add_service(AgentLinkServer::new(fake.clone()))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop.cancelled_owned());
    tokio::spawn(server);
    (addr, fake, rx)
}

/// [`serve`] over mutual TLS with the coordinator credentials `creds`.
pub async fn serve_tls(
    stop: CancellationToken,
    creds: toolsrv_tls::TlsFiles,
) -> (SocketAddr, Fake, mpsc::Receiver<Attached>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (fake, rx) = fake();
    let creds = toolsrv_tls::ServerCreds::new(creds).unwrap();
    let incoming = toolsrv_tls::incoming(listener, creds.subscribe());
    let server = tonic::transport::Server::builder()
        .add_service(AgentLinkServer::new(fake.clone()))
        .serve_with_incoming_shutdown(incoming, stop.cancelled_owned());
    tokio::spawn(async move {
        let _creds = creds;
        server.await
    });
    (addr, fake, rx)
}

fn fake() -> (Fake, mpsc::Receiver<Attached>) {
    let (tx, rx) = mpsc::channel(8);
    let fake = Fake {
        attached: tx,
        blobs: Arc::default(),
        refuse: Arc::default(),
        peers: Arc::default(),
    };
    (fake, rx)
}

/// Collects a call's output until its CallFinished.
pub async fn call_output(
    agent: &mut Attached,
    call_id: u64,
) -> (Vec<u8>, toolsrv_proto::v1::CallResult) {
    let mut output = Vec::new();
    loop {
        match agent.next(Duration::from_secs(20)).await {
            Some(Out::Output(o)) if o.call_id == call_id => {
                output.extend(o.chunk.unwrap().data);
            }
            Some(Out::Finished(f)) if f.call_id == call_id => return (output, f.result.unwrap()),
            Some(Out::View(_)) => {}
            other => panic!("unexpected message for call {call_id}: {other:?}"),
        }
    }
}
