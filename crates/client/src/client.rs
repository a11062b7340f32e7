//! The async client: one mTLS channel to a coordinator and a typed wrapper per RPC.

use tonic::Streaming;
use tonic::transport::Channel;
use toolsrv_proto::v1::tools_client::ToolsClient;
use toolsrv_proto::v1::{
    ApprovalRequest, ApproveRequest, CallEvent, CallRequest, CallResult, CallerPolicy,
    CatalogEvent, DescribeToolRequest, FanOutEvent, FanOutRequest, HostInfo, ListApprovalsRequest,
    ListHostsRequest, ListToolsRequest, ListToolsResponse, OutputStream, ToolDefinition,
    WatchCatalogRequest, call_event, fan_out_event,
};
use toolsrv_tls::{Role, TlsError, TlsFiles};

use crate::ClientError;

/// Largest message sent or accepted: the limit the coordinator keeps to
/// ([`toolsrv_proto::limits::MAX_MESSAGE_BYTES`]; tonic's default of 4 MiB would refuse a
/// call result the coordinator may send).
pub use toolsrv_proto::limits::MAX_MESSAGE_BYTES as MAX_MESSAGE_SIZE;

/// How long a request waits for the coordinator to begin its answer (a streamed answer's
/// messages are not bounded, only its start). A coordinator that is gone is noticed sooner, by
/// HTTP/2 pings; this bounds one that is stuck, whose connection still answers them.
pub const ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(60);

/// Where the coordinator is and who we are.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// The coordinator's URL, `https://host:port`.
    pub addr: String,
    /// Our client certificate and key, and the CA the coordinator's certificate must chain to.
    pub tls: TlsFiles,
}

/// A connection to a coordinator's client API. Cheap to clone; clones share the connection.
#[derive(Debug, Clone)]
pub struct Client {
    pub(crate) inner: ToolsClient<Channel>,
    /// The connection, for the services besides `Tools` (join tokens).
    pub(crate) channel: Channel,
}

impl Client {
    /// Loads the credentials and connects now; fails if the coordinator cannot be reached or does not
    /// present a coordinator certificate from our CA. When the connection is lost, the next RPC
    /// reconnects, reading the credential files again (so renewed certificates are used).
    ///
    /// With TLS 1.3 a coordinator that refuses *our* certificate is only noticed on the first RPC.
    ///
    /// `addr` may name several coordinator replicas, comma-separated: they are tried in turn,
    /// from one picked at random, and the first that answers is used; when its connection is
    /// lost, the next RPC goes to the first that answers from the one used last.
    pub async fn connect(opts: &ConnectOptions) -> Result<Self, ClientError> {
        check_dates(&opts.tls.cert)?;
        let urls: Vec<&str> = opts
            .addr
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        if urls.len() <= 1 {
            let channel = toolsrv_tls::connect_reloading_within(
                &opts.addr,
                &opts.tls,
                Role::Coordinator,
                ANSWER_WITHIN,
            )
            .await?;
            return Ok(Self::from_channel(channel));
        }
        let start = {
            use std::hash::BuildHasher;
            std::collections::hash_map::RandomState::new().hash_one(std::time::Instant::now())
                as usize
                % urls.len()
        };
        // From a replica picked at random, so that clients spread; every later connection of
        // the channel goes to the first replica that answers, so a client whose replica went
        // away carries on through another.
        let rotated: Vec<&str> = urls[start..]
            .iter()
            .chain(&urls[..start])
            .copied()
            .collect();
        toolsrv_tls::connect_replicas_within(&rotated, &opts.tls, Role::Coordinator, ANSWER_WITHIN)
            .await
            .map(Self::from_channel)
            .map_err(|e| match e {
                toolsrv_tls::TlsError::Connect(why) => toolsrv_tls::TlsError::Connect(format!(
                    "no coordinator replica answered: {why}"
                ))
                .into(),
                other => other.into(),
            })
    }

    /// Connects through the control socket of a running `toolctl master` (see [`crate::control`]):
    /// no credentials needed, and no TCP, TLS or HTTP/2 set-up beyond a local socket.
    pub async fn connect_control(path: impl AsRef<std::path::Path>) -> Result<Self, ClientError> {
        crate::control::connect(path.as_ref()).await
    }

    /// Wraps a channel built elsewhere, such as [`toolsrv_tls::lazy_channel`].
    pub fn from_channel(channel: Channel) -> Self {
        Self {
            inner: ToolsClient::new(channel.clone())
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
            channel,
        }
    }

    /// Every host of the fleet, sorted by id. A large fleet comes in pages; this asks for
    /// every one.
    pub async fn hosts(&self) -> Result<Vec<HostInfo>, ClientError> {
        let mut hosts = Vec::new();
        let mut token = String::new();
        loop {
            let request = ListHostsRequest {
                page_token: token.clone(),
            };
            let page = self.inner.clone().list_hosts(request).await?.into_inner();
            hosts.extend(page.hosts);
            if page.next_page_token.is_empty() {
                return Ok(hosts);
            }
            // Tokens are host ids, increasing: one that is not would page forever.
            if page.next_page_token <= token {
                return Err(ClientError::Protocol(format!(
                    "listing hosts: the coordinator answered page token `{token}` with `{}`, \
                     which does not move on; report it as a coordinator bug",
                    page.next_page_token
                )));
            }
            token = page.next_page_token;
        }
    }

    /// The tools `host` offers (and, with `include_hidden`, those it does not, with the reason).
    ///
    /// A large listing comes in pages; this asks for every one. Should the catalog revision of
    /// the host's view change between pages, the listing starts over (a few times at most).
    pub async fn tools(
        &self,
        host: &str,
        include_hidden: bool,
    ) -> Result<ListToolsResponse, ClientError> {
        const ATTEMPTS: usize = 4;
        let mut attempt = 1;
        loop {
            let (listing, consistent) = self.all_pages(host, include_hidden).await?;
            if consistent || attempt == ATTEMPTS {
                return Ok(listing);
            }
            attempt += 1;
        }
    }

    /// Every page of a listing, merged; false when the catalog revision changed between pages.
    async fn all_pages(
        &self,
        host: &str,
        include_hidden: bool,
    ) -> Result<(ListToolsResponse, bool), ClientError> {
        let page = |page_token: String| {
            let request = ListToolsRequest {
                host: host.to_string(),
                include_hidden,
                page_token,
            };
            let mut client = self.inner.clone();
            async move { client.list_tools(request).await }
        };
        let mut all = page(String::new()).await?.into_inner();
        let mut consistent = true;
        while !all.next_page_token.is_empty() {
            let token = std::mem::take(&mut all.next_page_token);
            let next = page(token.clone()).await?.into_inner();
            // Tokens are tool names, increasing: one that is not would page forever.
            if !next.next_page_token.is_empty() && next.next_page_token <= token {
                return Err(ClientError::Protocol(format!(
                    "listing the tools of host `{host}`: the coordinator answered page token \
                     `{token}` with `{}`, which does not move on; report it as a coordinator bug",
                    next.next_page_token
                )));
            }
            consistent &= next.catalog_revision == all.catalog_revision;
            all.catalog_revision = next.catalog_revision;
            all.tools.extend(next.tools);
            all.next_page_token = next.next_page_token;
        }
        Ok((all, consistent))
    }

    /// One tool's definition as `host` resolves it.
    pub async fn describe(&self, host: &str, tool: &str) -> Result<ToolDefinition, ClientError> {
        Ok(self.describe_tool(host, tool).await?.definition)
    }

    /// [`Client::describe`], and whether the tool is the host's own rather than the catalog's.
    pub async fn describe_tool(&self, host: &str, tool: &str) -> Result<Described, ClientError> {
        let request = DescribeToolRequest {
            host: host.to_string(),
            tool: tool.to_string(),
        };
        let response = self.inner.clone().describe_tool(request).await?;
        let host_only = response
            .metadata()
            .get(toolsrv_proto::HOST_ONLY_METADATA)
            .is_some_and(|v| v.as_bytes() == b"true");
        // Absent from a coordinator that predates it; one that does not decode is not trusted
        // to say anything.
        let policy = response
            .metadata()
            .get_bin(toolsrv_proto::CALLER_POLICY_METADATA)
            .and_then(|v| v.to_bytes().ok())
            .and_then(|b| <CallerPolicy as prost::Message>::decode(b).ok());
        Ok(Described {
            definition: response.into_inner(),
            host_only,
            policy,
        })
    }

    /// Starts a call. Read the stream to its result; dropping it early cancels the call on the host.
    pub async fn call(&self, request: CallRequest) -> Result<CallStream, ClientError> {
        let stream = self.inner.clone().call(request).await?.into_inner();
        Ok(CallStream {
            inner: stream,
            done: false,
        })
    }

    /// Runs a call to its end, collecting its output. An approval the call waits for is left to
    /// whoever may decide it (the call is denied if nobody does in time); to answer approval
    /// requests as the caller, read [`Client::call`]'s stream and use [`Client::decide`].
    pub async fn call_to_end(&self, request: CallRequest) -> Result<CallOutcome, ClientError> {
        let mut stream = self.call(request).await?;
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        while let Some(update) = stream.next().await {
            match update? {
                call_event::Event::Output(chunk) => {
                    if chunk.stream == OutputStream::Stderr as i32 {
                        stderr.extend_from_slice(&chunk.data);
                    } else {
                        stdout.extend_from_slice(&chunk.data);
                    }
                }
                call_event::Event::Result(result) => {
                    return Ok(CallOutcome {
                        stdout,
                        stderr,
                        result,
                    });
                }
                call_event::Event::Approval(_) => {}
            }
        }
        // `CallStream` reports a missing result as an error before it ends.
        Err(ClientError::Protocol(
            "the call stream ended without a result".into(),
        ))
    }

    /// Starts a fan-out. Read the stream to its summary; dropping it early cancels the calls not yet done.
    pub async fn fan_out(&self, request: FanOutRequest) -> Result<FanOutStream, ClientError> {
        let stream = self.inner.clone().fan_out(request).await?.into_inner();
        Ok(FanOutStream {
            inner: stream,
            done: false,
        })
    }

    /// The pending approval requests this client may decide, oldest first.
    pub async fn approvals(&self) -> Result<Vec<ApprovalRequest>, ClientError> {
        let response = self
            .inner
            .clone()
            .list_approvals(ListApprovalsRequest::default())
            .await?;
        Ok(response.into_inner().requests)
    }

    /// Pending request `id` with its arguments whole (the list cuts them at 4 KiB).
    pub async fn approval(&self, id: &str) -> Result<ApprovalRequest, ClientError> {
        let response = self
            .inner
            .clone()
            .list_approvals(ListApprovalsRequest { id: id.to_string() })
            .await?;
        response
            .into_inner()
            .requests
            .into_iter()
            .next()
            .ok_or_else(|| ClientError::Protocol(format!("no request `{id}` in the answer")))
    }

    /// Approves (`approve`) or denies one pending request by its id.
    pub async fn decide(&self, id: &str, approve: bool, reason: &str) -> Result<(), ClientError> {
        let request = ApproveRequest {
            id: id.to_string(),
            approve,
            reason: reason.to_string(),
        };
        self.inner.clone().approve(request).await?;
        Ok(())
    }

    /// Catalog and fleet changes, starting with a snapshot event; endless until dropped.
    pub async fn watch(&self) -> Result<WatchStream, ClientError> {
        let stream = self
            .inner
            .clone()
            .watch_catalog(WatchCatalogRequest {})
            .await?
            .into_inner();
        Ok(WatchStream { inner: stream })
    }
}

/// One tool's definition on one host, and where it comes from.
#[derive(Debug, Clone)]
pub struct Described {
    pub definition: ToolDefinition,
    /// The host's own tool (from its agent's own tools directories): what it says is that
    /// host's word, not the catalog's.
    pub host_only: bool,
    /// What the coordinator's policy says of this client calling the tool there (`None` from
    /// a coordinator that does not say).
    pub policy: Option<CallerPolicy>,
}

/// A call's output and result, collected.
#[derive(Debug, Clone)]
pub struct CallOutcome {
    /// Everything the tool wrote to stdout (up to the host's output cap).
    pub stdout: Vec<u8>,
    /// Everything the tool wrote to stderr.
    pub stderr: Vec<u8>,
    /// How the call ended.
    pub result: CallResult,
}

/// The events of one call: output chunks, then exactly one result, then `None`.
#[derive(Debug)]
pub struct CallStream {
    inner: Streaming<CallEvent>,
    done: bool,
}

impl CallStream {
    /// The next event. A stream that ends without a result yields an error instead, so a caller that
    /// reads until `None` has always seen a result or an error.
    pub async fn next(&mut self) -> Option<Result<call_event::Event, ClientError>> {
        if self.done {
            return None;
        }
        let item = match self.inner.message().await {
            Ok(Some(CallEvent { event: Some(event) })) => {
                self.done = matches!(event, call_event::Event::Result(_));
                return Some(Ok(event));
            }
            Ok(Some(CallEvent { event: None })) => {
                ClientError::Protocol("the coordinator sent an empty call event".into())
            }
            Ok(None) => ClientError::Protocol(
                "the call stream ended without a result: the coordinator may have shut down".into(),
            ),
            Err(status) => status.into(),
        };
        self.done = true;
        Some(Err(item))
    }
}

/// One fan-out event and the host it is about (empty for the summary).
#[derive(Debug, Clone)]
pub struct HostEvent {
    /// The host id; empty for the summary.
    pub host: String,
    /// Output, a host's result, or the summary.
    pub event: fan_out_event::Event,
}

/// The events of a fan-out: output and results tagged by host, then exactly one summary, then `None`.
#[derive(Debug)]
pub struct FanOutStream {
    inner: Streaming<FanOutEvent>,
    done: bool,
}

impl FanOutStream {
    /// The next event; a stream that ends without a summary yields an error instead.
    pub async fn next(&mut self) -> Option<Result<HostEvent, ClientError>> {
        if self.done {
            return None;
        }
        let item = match self.inner.message().await {
            Ok(Some(FanOutEvent {
                host,
                event: Some(event),
            })) => {
                self.done = matches!(event, fan_out_event::Event::Summary(_));
                return Some(Ok(HostEvent { host, event }));
            }
            Ok(Some(FanOutEvent { host, event: None })) => ClientError::Protocol(format!(
                "the coordinator sent an empty fan-out event for host `{host}`"
            )),
            Ok(None) => ClientError::Protocol(
                "the fan-out stream ended without a summary: the coordinator may have shut down"
                    .into(),
            ),
            Err(status) => status.into(),
        };
        self.done = true;
        Some(Err(item))
    }
}

/// Catalog events as they happen.
#[derive(Debug)]
pub struct WatchStream {
    inner: Streaming<CatalogEvent>,
}

impl WatchStream {
    /// The next event; `None` when the coordinator ended the watch (it is shutting down).
    pub async fn next(&mut self) -> Option<Result<CatalogEvent, ClientError>> {
        self.inner
            .message()
            .await
            .map_err(ClientError::from)
            .transpose()
    }
}

/// Refuses our certificate, naming its file, when this machine's clock is past its `notAfter` or
/// before its `notBefore`: the coordinator would refuse it in the handshake, which TLS 1.3 shows
/// the client only as a broken connection on its first request.
fn check_dates(cert: &std::path::Path) -> Result<(), TlsError> {
    toolsrv_tls::check_dates(
        cert,
        "the coordinator refuses it: use a new one (from the development CA: remove this file \
         and its key, then run `toolsrv pki init DIR --clients NAME` again)",
    )
}
