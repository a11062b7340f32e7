//! Our etcd v3 client, generated from `proto/` (a subset of etcd's API): one gRPC channel per
//! member, each request sent to one member, the one that answered last. A transport failure or
//! a member without a leader moves the next request to the next member (round robin); the retry
//! loops decide whether there is a next request. Every request requires a leader and has a
//! deadline; the watch and lease keep-alive streams use the same channels.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};

use crate::config::ClusterConfig;
use crate::error::{ClusterError, Fault, classify};
use pb::etcdserverpb::kv_client::KvClient;
use pb::etcdserverpb::lease_client::LeaseClient;
use pb::etcdserverpb::watch_client::WatchClient;
use pb::etcdserverpb::{
    LeaseKeepAliveRequest, LeaseKeepAliveResponse, WatchCreateRequest, WatchRequest, WatchResponse,
    watch_request,
};

/// The generated messages and clients.
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic
)]
pub(crate) mod pb {
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
}

/// The gRPC metadata etcd reads to refuse a request at once when the member has no leader,
/// instead of holding it until an election ends (etcd's `rpctypes.MetadataRequireLeaderKey`).
const REQUIRE_LEADER: (&str, &str) = ("hasleader", "true");

/// The largest response accepted: a listing of every host of a large fleet exceeds tonic's
/// default of 4 MiB long before it troubles etcd.
const MAX_RESPONSE: usize = 64 << 20;

/// A client of an etcd cluster. Clones share the channels and the member in use.
#[derive(Debug, Clone)]
pub(crate) struct EtcdClient {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    members: Vec<Member>,
    /// The member requests go to: the last that answered, or the next after one that failed.
    current: AtomicUsize,
    timeout: Duration,
}

#[derive(Debug)]
struct Member {
    url: String,
    channel: Channel,
}

impl EtcdClient {
    /// A channel per endpoint of `config`, connected on first use: a member that is down when
    /// the replica starts is tried like one that went down later.
    pub(crate) fn new(config: &ClusterConfig) -> Result<Self, ClusterError> {
        let timeout = config.request_timeout;
        let tls = match &config.tls {
            Some(tls) => Some(
                toolsrv_tls::web_pki_client_config(&tls.ca, Some((&tls.cert, &tls.key))).map_err(
                    |e| ClusterError::Invalid {
                        what: "etcd TLS files".into(),
                        detail: e.to_string(),
                    },
                )?,
            ),
            None => None,
        };
        let mut members = Vec::with_capacity(config.endpoints.len());
        for url in &config.endpoints {
            let invalid = |detail: String| ClusterError::Invalid {
                what: format!("etcd endpoint {url}"),
                detail,
            };
            let channel = match &tls {
                // Our own rustls connector: tonic's TLS stays off in the workspace.
                Some(tls) => toolsrv_tls::lazy_channel(url, tls.clone())
                    .map_err(|e| invalid(e.to_string()))?,
                None => Endpoint::from_shared(url.clone())
                    .map_err(|e| invalid(format!("not a valid URL: {e}")))?
                    .connect_timeout(timeout)
                    .http2_keep_alive_interval(timeout)
                    .keep_alive_timeout(timeout)
                    .keep_alive_while_idle(true)
                    .tcp_nodelay(true)
                    .connect_lazy(),
            };
            members.push(Member {
                url: url.clone(),
                channel,
            });
        }
        if members.is_empty() {
            return Err(ClusterError::Invalid {
                what: "etcd endpoints".into(),
                detail: "none given".into(),
            });
        }
        Ok(Self {
            inner: Arc::new(Inner {
                members,
                current: AtomicUsize::new(0),
                timeout,
            }),
        })
    }

    /// The member to use now, by index.
    fn pick(&self) -> (usize, &Member) {
        let members = &self.inner.members;
        let i = self.inner.current.load(Ordering::Relaxed) % members.len();
        (i, &members[i])
    }

    /// Records that member `i` failed with `fault`, which names it from here on: unless another
    /// request already moved on, the next one goes to the next member if this one is down or
    /// has no leader (another may have one).
    fn failed(&self, i: usize, fault: Fault) -> Fault {
        let members = &self.inner.members;
        let fault = fault.at(&members[i].url);
        if matches!(fault, Fault::NoLeader(_) | Fault::Unreachable(_)) {
            let next = (i + 1) % members.len();
            if self
                .inner
                .current
                .compare_exchange(i, next, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                tracing::debug!(failed = %members[i].url, next = %members[next].url, ?fault, "etcd member failed; moving on");
            }
        }
        fault
    }

    /// `message` with a leader required and the request deadline.
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.metadata_mut().insert(
            REQUIRE_LEADER.0,
            MetadataValue::from_static(REQUIRE_LEADER.1),
        );
        request.set_timeout(self.inner.timeout);
        request
    }

    /// The deadline exceeded on member `i`.
    fn timed_out(&self, i: usize, what: &str) -> Fault {
        self.failed(
            i,
            Fault::Unreachable(format!(
                "no answer to {what} within {:?}",
                self.inner.timeout
            )),
        )
    }

    /// One unary call of the KV service on the current member.
    pub(crate) async fn kv<Req, Resp, F, Fut>(
        &self,
        what: &'static str,
        message: Req,
        call: F,
    ) -> Result<Resp, Fault>
    where
        F: FnOnce(KvClient<Channel>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let (i, member) = self.pick();
        let client = KvClient::new(member.channel.clone()).max_decoding_message_size(MAX_RESPONSE);
        self.finish(i, what, call(client, self.request(message)))
            .await
    }

    /// One unary call of the Lease service on the current member.
    pub(crate) async fn lease<Req, Resp, F, Fut>(
        &self,
        what: &'static str,
        message: Req,
        call: F,
    ) -> Result<Resp, Fault>
    where
        F: FnOnce(LeaseClient<Channel>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let (i, member) = self.pick();
        let client = LeaseClient::new(member.channel.clone());
        self.finish(i, what, call(client, self.request(message)))
            .await
    }

    async fn finish<Resp>(
        &self,
        i: usize,
        what: &str,
        call: impl Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    ) -> Result<Resp, Fault> {
        match tokio::time::timeout(self.inner.timeout, call).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(self.failed(i, classify(&status))),
            Err(_) => Err(self.timed_out(i, what)),
        }
    }

    /// Opens a watch stream with one watcher, `create`, on the current member.
    pub(crate) async fn watch(&self, create: WatchCreateRequest) -> Result<WatchStream, Fault> {
        let first = WatchRequest {
            request_union: Some(watch_request::RequestUnion::CreateRequest(create)),
        };
        // The request side stays open (pending) for as long as the watch: etcd ends a stream
        // whose client side is closed.
        let requests = tokio_stream::once(first).chain(tokio_stream::pending());
        let (i, member) = self.pick();
        let mut client =
            WatchClient::new(member.channel.clone()).max_decoding_message_size(MAX_RESPONSE);
        let opened =
            tokio::time::timeout(self.inner.timeout, client.watch(self.request(requests))).await;
        match opened {
            Ok(Ok(response)) => Ok(WatchStream {
                client: self.clone(),
                member: i,
                responses: response.into_inner(),
            }),
            Ok(Err(status)) => Err(self.failed(i, classify(&status))),
            Err(_) => Err(self.timed_out(i, "watch")),
        }
    }

    /// Opens a keep-alive stream for `lease` on the current member and renews it once: the
    /// stream, and the TTL etcd answered (zero or less: the lease is gone).
    pub(crate) async fn keep_alive(&self, lease: i64) -> Result<(KeepAlive, i64), Fault> {
        let (tx, rx) = mpsc::channel(1);
        // The first renewal is queued before the call: etcd answers the call with it.
        tx.try_send(LeaseKeepAliveRequest { id: lease })
            .map_err(|e| Fault::Permanent(format!("cannot queue a lease renewal: {e}")))?;
        let (i, member) = self.pick();
        let mut client = LeaseClient::new(member.channel.clone());
        let request = self.request(ReceiverStream::new(rx));
        let opened = tokio::time::timeout(self.inner.timeout, client.lease_keep_alive(request));
        let responses = match opened.await {
            Ok(Ok(response)) => response.into_inner(),
            Ok(Err(status)) => return Err(self.failed(i, classify(&status))),
            Err(_) => return Err(self.timed_out(i, "lease keep-alive")),
        };
        let mut stream = KeepAlive {
            client: self.clone(),
            member: i,
            lease,
            requests: tx,
            responses,
        };
        let ttl = stream.answer().await?;
        Ok((stream, ttl))
    }
}

/// A watch stream on one member.
#[derive(Debug)]
pub(crate) struct WatchStream {
    client: EtcdClient,
    member: usize,
    responses: tonic::Streaming<WatchResponse>,
}

impl WatchStream {
    /// The next response; `None` when the member ended the stream. A failed stream, or one
    /// that etcd cancelled because the member lost its leader, moves the client to the next
    /// member.
    pub(crate) async fn message(&mut self) -> Result<Option<WatchResponse>, Fault> {
        match self.responses.message().await {
            Ok(Some(response)) => {
                if response.canceled && response.cancel_reason.contains("no leader") {
                    self.client
                        .failed(self.member, Fault::NoLeader(response.cancel_reason.clone()));
                }
                Ok(Some(response))
            }
            Ok(None) => {
                self.client.failed(
                    self.member,
                    Fault::Unreachable("the watch stream ended".into()),
                );
                Ok(None)
            }
            Err(status) => Err(self.client.failed(self.member, classify(&status))),
        }
    }
}

/// A lease keep-alive stream on one member.
#[derive(Debug)]
pub(crate) struct KeepAlive {
    client: EtcdClient,
    member: usize,
    lease: i64,
    requests: mpsc::Sender<LeaseKeepAliveRequest>,
    responses: tonic::Streaming<LeaseKeepAliveResponse>,
}

impl KeepAlive {
    /// Renews the lease once: the TTL etcd answered (zero or less: the lease is gone).
    pub(crate) async fn renew(&mut self) -> Result<i64, Fault> {
        let renewal = LeaseKeepAliveRequest { id: self.lease };
        if self.requests.send(renewal).await.is_err() {
            return Err(self.client.failed(
                self.member,
                Fault::Unreachable("the keep-alive stream is closed".into()),
            ));
        }
        self.answer().await
    }

    async fn answer(&mut self) -> Result<i64, Fault> {
        match self.responses.message().await {
            Ok(Some(response)) => Ok(response.ttl),
            Ok(None) => Err(self.client.failed(
                self.member,
                Fault::Unreachable("the keep-alive stream ended".into()),
            )),
            Err(status) => Err(self.client.failed(self.member, classify(&status))),
        }
    }
}

/// The end of the range of keys starting with `prefix`: the prefix with its last byte below
/// 0xff incremented and what follows dropped; `\0` (no end) when every byte is 0xff.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        let cases: [(&[u8], &[u8]); 5] = [
            (b"/toolsrv/", b"/toolsrv0"),
            (b"a", b"b"),
            (b"a\xff", b"b"),
            (b"\xff\xff", b"\0"),
            (b"", b"\0"),
        ];
        for (prefix, want) in cases {
            assert_eq!(prefix_end(prefix), want, "{prefix:?}");
        }
    }

    fn client(n: usize) -> EtcdClient {
        let endpoints = (0..n)
            .map(|i| format!("http://127.0.0.1:{}", 1 + i))
            .collect();
        EtcdClient::new(&ClusterConfig::new(endpoints, "r1", "https://r1")).unwrap()
    }

    #[tokio::test]
    async fn a_failed_member_moves_requests_to_the_next_one() {
        let c = client(3);
        assert_eq!(c.pick().0, 0);
        // A refusal that no other member would fix stays.
        let _ = c.failed(0, Fault::LeaseNotFound("gone".into()));
        assert_eq!(c.pick().0, 0);
        let fault = c.failed(0, Fault::Unreachable("refused".into()));
        assert_eq!(
            fault,
            Fault::Unreachable("http://127.0.0.1:1: refused".into())
        );
        assert_eq!(c.pick().0, 1);
        // Two requests that failed on member 1 move on once, not twice.
        let _ = c.failed(1, Fault::NoLeader("no leader".into()));
        let _ = c.failed(1, Fault::NoLeader("no leader".into()));
        assert_eq!(c.pick().0, 2);
        let _ = c.failed(2, Fault::Unreachable("refused".into()));
        assert_eq!(c.pick().0, 0, "round robin");
    }

    #[tokio::test]
    async fn requests_require_a_leader() {
        let request = client(1).request(());
        assert_eq!(
            request
                .metadata()
                .get("hasleader")
                .and_then(|v| v.to_str().ok()),
            Some("true")
        );
        assert!(request.metadata().get("grpc-timeout").is_some());
    }
}
