//! Running as one of several replicas (`--etcd`): the links this replica holds are claimed in
//! etcd ([`toolsrv_cluster`]), every replica's claims make the routing table, and a request for
//! a host whose link another replica holds is relayed to that replica.
//!
//! The relay is the client API itself: the entering replica calls the owner's `Tools` service
//! with its own coordinator certificate and the client's name in [`ON_BEHALF_OF`]. Only a
//! coordinator certificate may speak for a client ([`crate::identity`]), and a relayed request
//! ([`RELAYED`]) is never relayed again, so a route that changed meanwhile ends in a refusal,
//! not a loop. Output streams through with HTTP/2 flow control on both legs: a slow client
//! stops the entering replica reading, which stops the owner reading, which stops granting the
//! agent credit. A client that goes away drops the relayed stream, and the owner cancels the
//! call on the host.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::broadcast;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Request, Status};
use toolsrv_cluster::{Cluster, ClusterConfig, ClusterEvent, ClusterHealth, HostRecord};
use toolsrv_proto::v1::enrollment_client::EnrollmentClient;
use toolsrv_proto::v1::join_tokens_client::JoinTokensClient;
use toolsrv_proto::v1::tools_client::ToolsClient;
use toolsrv_proto::v1::{
    ApprovalRequest, ApproveRequest, CallRequest, CallResult, CallStatus, CatalogEvent,
    CatalogEventKind, FindToolsRequest, FindToolsResponse, HostFacts, HostInfo, HostState,
    JoinRequest, JoinResponse, JoinTokenInfo, ListApprovalsRequest, ListJoinTokensRequest,
    ListSessionsRequest, ListToolsRequest, RevokeJoinTokenRequest, RevokeJoinTokenResponse,
    SandboxFacts, SessionState, WatchCatalogRequest, call_event,
};
use toolsrv_registry::{Catalog, Registry};

use crate::State;
use crate::calls::{CallSpec, Event};
use crate::fleet::HostEntry;

/// How long a replica waits for another one's answer to a question about its own state.
pub(crate) const PEER_WAIT: Duration = Duration::from_secs(3);
/// Views of other replicas' hosts fetched at once for a session.
const VIEW_FETCHES: usize = 64;

/// The metadata naming the client a replica relays for.
pub const ON_BEHALF_OF: &str = "toolsrv-on-behalf-of";
/// The metadata marking a relayed request (value: the relaying replica's id).
pub const RELAYED: &str = "toolsrv-relayed-by";

/// This replica's place among the others.
#[derive(Debug)]
pub(crate) struct Replicas {
    pub cluster: Cluster,
    /// Client config with the coordinator's own certificate, for calls to other replicas.
    tls: Arc<rustls::ClientConfig>,
    peers: Mutex<HashMap<String, Channel>>,
    /// Hosts another replica held that have no link now, with their last record, until they
    /// attach again somewhere: offline, or reconnecting when their replica went away.
    gone: Mutex<BTreeMap<String, Gone>>,
    /// `WatchCatalog`'s events of hosts other replicas hold: online and offline from the
    /// routing table, view changes from each other replica's own watch.
    remote_events: broadcast::Sender<CatalogEvent>,
    /// The view revision of each host other replicas hold, and how many tools it has visible,
    /// as their watches told.
    remote_views: Mutex<HashMap<String, (u64, u32)>>,
    /// Views of hosts other replicas hold, fetched for sessions (see [`Replicas::remote_entries`]).
    mirror: Mutex<Mirror>,
    /// Shares equal definitions among the mirrored views.
    interner: crate::views::Interner,
}

/// The views of other replicas' hosts fetched so far. A host's entry is dropped when its
/// replica's watch says its view changed; a fetch that started before that is not kept.
#[derive(Debug, Default)]
struct Mirror {
    views: HashMap<String, Mirrored>,
    /// Bumped at every invalidation.
    epoch: u64,
    /// The epoch of each host's last invalidation.
    invalidated: HashMap<String, u64>,
}

#[derive(Debug)]
struct Mirrored {
    /// The link the view was fetched over: another link is another view.
    link_id: String,
    view: Arc<crate::views::StoredView>,
}

impl Replicas {
    /// Joins the replicas: takes a lease and registers this replica in etcd.
    pub async fn join(
        config: ClusterConfig,
        tls: &toolsrv_tls::TlsFiles,
    ) -> Result<Self, crate::CoordinatorError> {
        let tls = toolsrv_tls::client_config(tls, toolsrv_tls::Role::Coordinator)?;
        let id = config.replica_id.clone();
        let cluster = Cluster::join(config)
            .await
            .map_err(|e| crate::CoordinatorError::Cluster(e.to_string()))?;
        tracing::info!(replica = %id, replicas = cluster.replicas().len(), "joined the replicas on etcd");
        Ok(Self {
            cluster,
            tls,
            peers: Mutex::new(HashMap::new()),
            gone: Mutex::new(BTreeMap::new()),
            remote_events: broadcast::channel(1024).0,
            remote_views: Mutex::new(HashMap::new()),
            mirror: Mutex::new(Mirror::default()),
            interner: crate::views::Interner::default(),
        })
    }

    pub fn id(&self) -> &str {
        self.cluster.replica_id()
    }

    /// The record of `host` when another replica holds its link.
    pub fn remote(&self, host: &str) -> Option<HostRecord> {
        self.cluster.route(host).filter(|r| r.owner != self.id())
    }

    /// The last record of `host` when the replica that held it went away from etcd and the
    /// host has attached nowhere since (reconnecting). That replica may be alive still, cut off
    /// from etcd only: it keeps serving the links it holds ("serving the hosts held here"),
    /// and their agents have no reason to move. Requests for such a host are relayed to it on
    /// the chance; one that is really gone does not answer, and the request says so.
    pub fn last_holder(&self, host: &str) -> Option<HostRecord> {
        self.lock_gone()
            .get(host)
            .filter(|g| {
                g.state == HostState::Reconnecting
                    && g.record.owner != self.id()
                    && !g.record.owner_url.is_empty()
            })
            .map(|g| g.record.clone())
    }

    /// Hosts that had a link to another replica and have none now (offline, or reconnecting)
    /// that `selector` picks: a fan-out reports them rather than leaving them out.
    pub fn select_gone(&self, selector: &crate::selector::Selector) -> Vec<String> {
        self.lock_gone()
            .iter()
            .filter(|(id, g)| {
                let labels = labels_of(&g.record.facts, "label.");
                selector.matches(&candidate(id, &g.record, &labels))
            })
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The replica that last held `host`, when it is one of the hosts another replica held and
    /// none holds now.
    pub fn last_owner(&self, host: &str) -> Option<(String, HostState)> {
        self.lock_gone()
            .get(host)
            .map(|g| (g.record.owner.clone(), g.state))
    }

    /// The record of this replica's link `link_id` to `host`, as other replicas see the host.
    fn record_of(&self, host: &HostEntry, link_id: &str) -> HostRecord {
        HostRecord {
            owner: self.id().to_string(),
            owner_url: self
                .cluster
                .replica(self.id())
                .map(|r| r.advertise_url)
                .unwrap_or_default(),
            link_id: link_id.to_string(),
            facts: facts_of(host),
            attached_unix: host.connected_unix_ms / 1000,
        }
    }

    /// Tells the other replicas the labels of the hosts in `ids` changed (new `--host-labels`):
    /// each claim this replica still holds is rewritten with the host's labels now. A claim
    /// etcd cannot take now is logged, and corrected at the host's next link.
    pub async fn relabelled(&self, fleet: &crate::fleet::Fleet, ids: Vec<String>) {
        for id in ids {
            let Some(host) = fleet.get(&id) else { continue };
            let Some(link) = host.link.as_ref().filter(|_| host.online()) else {
                continue;
            };
            let record = self.record_of(&host, &link.link_id);
            if let Err(e) = self.cluster.update_claim(&id, record).await {
                tracing::warn!(host = %id, error = %e, "cannot give the host's new labels to the other replicas; they see them at its next link");
            }
        }
    }

    /// Records that this replica holds `host`'s link `link_id`; refused (UNAVAILABLE) while
    /// etcd cannot take the claim, so the agent tries again (perhaps elsewhere).
    pub async fn claim(&self, host: &HostEntry, link_id: &str) -> Result<(), Status> {
        let record = self.record_of(host, link_id);
        match self.cluster.claim(&host.id, record).await {
            Ok(claim) => {
                if let Some(previous) = claim.previous.filter(|p| p.owner != self.id()) {
                    tracing::info!(host = %host.id, from = %previous.owner, "host moved to this replica");
                }
                self.lock_gone().remove(&host.id);
                Ok(())
            }
            Err(e) => {
                tracing::warn!(host = %host.id, error = %e, "cannot claim the host's link in etcd; refusing the link");
                Err(Status::unavailable(format!(
                    "this coordinator replica cannot record the link in etcd ({e}); retry, or \
                     attach to another replica"
                )))
            }
        }
    }

    /// Gives up the claim of a link that ended (in the background; a claim already replaced
    /// by a newer link is left alone).
    pub fn release(self: &Arc<Self>, host: &str, link_id: &str) {
        let (this, host, link_id) = (self.clone(), host.to_string(), link_id.to_string());
        tokio::spawn(async move {
            if let Err(e) = this.cluster.release(&host, &link_id).await {
                tracing::warn!(host = %host, error = %e, "cannot release the host's claim; its lease will");
            }
        });
    }

    /// A channel to the replica at `url` (made once, connected on first use).
    fn channel(&self, url: &str) -> Result<Channel, Status> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(channel) = peers.get(url) {
            return Ok(channel.clone());
        }
        let channel = toolsrv_tls::lazy_channel(url, self.tls.clone())
            .map_err(|e| Status::unavailable(format!("cannot reach replica {url}: {e}")))?;
        peers.insert(url.to_string(), channel.clone());
        Ok(channel)
    }

    /// Whether a connection to the replica at `url` can be made now (within the connect
    /// timeout); why not.
    pub async fn reach(&self, url: &str) -> Result<(), String> {
        toolsrv_tls::connect(url, self.tls.clone())
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// A `Tools` client to the owner of `record`, and `msg` wrapped as a request relayed for
    /// `client`.
    pub fn relay<T>(
        &self,
        record: &HostRecord,
        client: &str,
        msg: T,
    ) -> Result<(ToolsClient<Channel>, Request<T>), Status> {
        let channel = self.channel(&record.owner_url)?;
        let tools = ToolsClient::new(channel)
            .max_decoding_message_size(toolsrv_proto::limits::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(toolsrv_proto::limits::MAX_MESSAGE_BYTES);
        Ok((tools, self.to_peer(Some(client), msg)?))
    }

    /// Agrees in etcd on the revision of `catalog` (a scan of this replica's tools path) and
    /// serves it at that revision: another replica's revision when it serves the same tools,
    /// otherwise a new one above every revision served so far. Returns the revision.
    pub async fn agree_catalog(
        &self,
        registry: &Registry,
        catalog: &Catalog,
    ) -> Result<u64, toolsrv_cluster::ClusterError> {
        let served = registry.catalog();
        let proposed = if catalog.same_tools(&served) {
            served.revision
        } else {
            served.revision + 1
        };
        let agreed = self
            .cluster
            .agree_catalog(&catalog.content_digest(), proposed)
            .await?;
        if registry.publish(catalog, agreed.revision) {
            if agreed.revision != served.revision {
                tracing::info!(
                    revision = agreed.revision,
                    "serving the catalog revision agreed by the replicas"
                );
            }
        } else {
            // Not expected: an agreement never goes below one this replica served.
            tracing::warn!(
                revision = agreed.revision,
                serving = registry.catalog().revision,
                "the agreed catalog revision is below the one served; keeping it"
            );
        }
        Ok(agreed.revision)
    }

    /// `WatchCatalog`'s events of hosts other replicas hold.
    pub fn remote_events(&self) -> broadcast::Receiver<CatalogEvent> {
        self.remote_events.subscribe()
    }

    /// Tells watchers of a host another replica holds (or held).
    fn emit_remote(
        &self,
        state: &State,
        kind: CatalogEventKind,
        host: &str,
        (view_revision, visible_tools): (u64, u32),
    ) {
        let event = CatalogEvent {
            kind: kind as i32,
            revision: state.fleet.revision(),
            host: host.to_string(),
            view_revision,
            visible_tools,
            ..CatalogEvent::default()
        };
        // No watchers is fine.
        let _ = self.remote_events.send(event);
    }

    /// Whether a local event about `host` is stale for a fleet-wide watch: its going offline
    /// here, when another replica holds its link now.
    pub fn hides_local(&self, event: &CatalogEvent) -> bool {
        event.kind == CatalogEventKind::HostOffline as i32 && self.remote(&event.host).is_some()
    }

    /// The other live replicas, each as a record to relay to.
    fn peers(&self) -> Vec<HostRecord> {
        self.cluster
            .replicas()
            .into_iter()
            .filter(|r| r.id != self.id())
            .map(|r| HostRecord {
                owner: r.id,
                owner_url: r.advertise_url,
                ..HostRecord::default()
            })
            .collect()
    }

    /// The approval requests `client` may decide on the other replicas (where relayed calls
    /// wait for them), from those that answer within [`PEER_WAIT`].
    pub async fn remote_approvals(&self, client: &str) -> Vec<ApprovalRequest> {
        self.gather("approval requests", |peer| async move {
            let (mut tools, request) =
                self.relay(&peer, client, ListApprovalsRequest::default())?;
            Ok(tools.list_approvals(request).await?.into_inner().requests)
        })
        .await
    }

    /// Every other replica's answer to `ask`, all asked at once: with each replica's id, `None`
    /// for one that did not answer within [`PEER_WAIT`].
    async fn ask_all<T, F, Fut>(&self, ask: F) -> Vec<(String, Option<Result<T, Status>>)>
    where
        F: Fn(HostRecord) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let peers = self.peers();
        let owners: Vec<String> = peers.iter().map(|p| p.owner.clone()).collect();
        let answers = join_within(PEER_WAIT, peers.into_iter().map(ask)).await;
        owners.into_iter().zip(answers).collect()
    }

    /// What every other replica answers `ask` within [`PEER_WAIT`], gathered (all asked at
    /// once); one that fails or is late is logged (`what` it was asked for) and left out.
    async fn gather<T, F, Fut>(&self, what: &str, ask: F) -> Vec<T>
    where
        F: Fn(HostRecord) -> Fut,
        Fut: Future<Output = Result<Vec<T>, Status>>,
    {
        let mut all = Vec::new();
        for (owner, answer) in self.ask_all(ask).await {
            match answer {
                Some(Ok(items)) => all.extend(items),
                Some(Err(e)) => {
                    tracing::warn!(replica = %owner, what, error = %toolsrv_proto::text::printable_line(e.message(), 1024), "cannot list what another replica keeps")
                }
                None => {
                    tracing::warn!(replica = %owner, what, "another replica did not list what it keeps in time")
                }
            }
        }
        all
    }

    /// The sessions `client` opened on the other replicas, from those that answer within
    /// [`PEER_WAIT`].
    pub async fn remote_sessions(&self, client: &str) -> Vec<SessionState> {
        self.gather("sessions", |peer| async move {
            let (mut tools, request) = self.relay(&peer, client, ListSessionsRequest {})?;
            Ok(tools.list_sessions(request).await?.into_inner().sessions)
        })
        .await
    }

    /// The tools of the hosts the other replicas hold, ranked by each against `req` (relayed
    /// for `client`), from those that answer within [`PEER_WAIT`].
    pub async fn remote_matches(
        &self,
        client: &str,
        req: &FindToolsRequest,
    ) -> Vec<FindToolsResponse> {
        self.gather("matching tools", |peer| async move {
            let (mut tools, request) = self.relay(&peer, client, req.clone())?;
            Ok(vec![tools.find_tools(request).await?.into_inner()])
        })
        .await
    }

    /// The hosts other replicas hold that `selector` picks, for a session of `client`: each
    /// with its view as its replica has it, fetched from that replica ([`VIEW_FETCHES`] at a
    /// time, all within [`PEER_WAIT`]) the first time and after each change its replica's
    /// watch reports, and kept meanwhile. A host whose view cannot be fetched shows as syncing,
    /// without tools.
    pub async fn remote_entries(
        &self,
        selector: &crate::selector::Selector,
        client: &str,
    ) -> Vec<HostEntry> {
        // Selected from the routing table before the mirror is locked: a whole fleet's records
        // are read and matched, which other sessions' requests need not wait for.
        let selected = self.select_remote(selector);
        let (mut entries, mut fetch, epoch) = {
            let mut mirror = self.lock_mirror();
            // Hosts no other replica holds any more are forgotten.
            let elsewhere = |id: &str| self.cluster.route(id).is_some_and(|r| r.owner != self.id());
            mirror.views.retain(|id, _| elsewhere(id));
            mirror.invalidated.retain(|id, _| elsewhere(id));
            let (mut entries, mut fetch) = (Vec::new(), Vec::new());
            for (id, record) in selected {
                match mirror.views.get(&id) {
                    Some(m) if m.link_id == record.link_id => {
                        entries.push(remote_entry(&id, &record, Some(m.view.clone())));
                    }
                    _ => fetch.push((id, record)),
                }
            }
            (entries, fetch, mirror.epoch)
        };
        // All within one PEER_WAIT, however many there are and however slow a replica is: what
        // has not come by then shows as syncing, and is asked for again next time.
        let slots = tokio::sync::Semaphore::new(VIEW_FETCHES);
        let fetched = join_within(
            PEER_WAIT,
            fetch.iter().map(|(id, record)| {
                let slots = &slots;
                async move {
                    let _slot = slots.acquire().await;
                    self.fetch_view(id, record, client).await
                }
            }),
        )
        .await;
        let mut mirror = self.lock_mirror();
        for ((id, record), view) in fetch.drain(..).zip(fetched) {
            let view = match view {
                Some(Ok(view)) => Some(Arc::new(view)),
                Some(Err(e)) => {
                    tracing::debug!(host = %id, replica = %record.owner, error = %e.message(), "cannot fetch the view of another replica's host");
                    None
                }
                None => {
                    tracing::debug!(host = %id, replica = %record.owner, "the view of another replica's host did not come in time");
                    None
                }
            };
            // Kept unless its replica said it changed while it was on its way.
            let current = mirror.invalidated.get(&id).is_none_or(|at| *at <= epoch);
            if let (Some(view), true) = (&view, current) {
                mirror.views.insert(
                    id.clone(),
                    Mirrored {
                        link_id: record.link_id.clone(),
                        view: view.clone(),
                    },
                );
            }
            entries.push(remote_entry(&id, &record, view));
        }
        entries
    }

    /// Drops the mirrored view of `host` (its replica says it changed); whether one was kept.
    fn invalidate(&self, host: &str) -> bool {
        let mut mirror = self.lock_mirror();
        mirror.epoch += 1;
        let epoch = mirror.epoch;
        mirror.invalidated.insert(host.to_string(), epoch);
        mirror.views.remove(host).is_some()
    }

    fn lock_mirror(&self) -> std::sync::MutexGuard<'_, Mirror> {
        // Every change is whole under the lock: a poisoned one is consistent.
        self.mirror.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The whole view of `host` (hidden tools too), page by page, from the replica of `record`.
    async fn fetch_view(
        &self,
        host: &str,
        record: &HostRecord,
        client: &str,
    ) -> Result<crate::views::StoredView, Status> {
        /// More pages than any view within `MAX_VIEW_BYTES` has.
        const MAX_PAGES: usize = 256;
        let mut view = toolsrv_proto::v1::HostView::default();
        let mut page_token = String::new();
        for _ in 0..MAX_PAGES {
            let list = ListToolsRequest {
                host: host.to_string(),
                include_hidden: true,
                page_token,
            };
            let (mut tools, request) = self.relay(record, client, list)?;
            let page = tools.list_tools(request).await?.into_inner();
            view.catalog_revision = page.catalog_revision;
            view.tools.extend(page.tools);
            if page.next_page_token.is_empty() {
                return Ok(self.interner.store(view));
            }
            page_token = page.next_page_token;
        }
        Err(Status::internal(format!(
            "the view of {host} on replica {} has more than {MAX_PAGES} pages",
            record.owner
        )))
    }

    /// Decides a request that is not pending here on the replica where it is: `Ok(true)` when
    /// one had it, `Ok(false)` when none did; a refusal (not allowed to decide) passes through.
    /// Request `id` whole from the replica that holds it, for `client`: `None` when none does.
    pub async fn approval_elsewhere(
        &self,
        client: &str,
        id: &str,
    ) -> Result<Option<ApprovalRequest>, Status> {
        let asked = ListApprovalsRequest { id: id.to_string() };
        let answers = self
            .ask_all(|peer| {
                let asked = asked.clone();
                async move {
                    let (mut tools, request) = self.relay(&peer, client, asked)?;
                    Ok(tools.list_approvals(request).await?.into_inner().requests)
                }
            })
            .await;
        for (_, answer) in answers {
            match answer {
                Some(Ok(mut found)) if !found.is_empty() => return Ok(Some(found.remove(0))),
                Some(Err(status)) if status.code() == tonic::Code::PermissionDenied => {
                    return Err(status);
                }
                _ => {}
            }
        }
        Ok(None)
    }

    pub async fn approve_elsewhere(
        &self,
        client: &str,
        decision: &ApproveRequest,
    ) -> Result<bool, Status> {
        // Request ids are unique: at most one replica has it, so all may be asked at once.
        let answers = self
            .ask_all(|peer| async move {
                let (mut tools, request) = self.relay(&peer, client, decision.clone())?;
                tools.approve(request).await
            })
            .await;
        let mut decided = false;
        for (owner, answer) in answers {
            match answer {
                Some(Ok(_)) => decided = true,
                Some(Err(status)) if status.code() == tonic::Code::NotFound => {}
                Some(Err(status)) if status.code() == tonic::Code::PermissionDenied => {
                    return Err(status);
                }
                Some(Err(status)) => {
                    tracing::warn!(replica = %owner, error = %toolsrv_proto::text::printable_line(status.message(), 1024), "cannot pass a decision to another replica");
                }
                None => {
                    tracing::warn!(replica = %owner, "another replica did not answer a decision in time");
                }
            }
        }
        Ok(decided)
    }

    /// A request to another replica's service: `msg` marked relayed by this replica (for
    /// `client`, when given: only the client API and the join tokens take that).
    fn to_peer<T>(&self, client: Option<&str>, msg: T) -> Result<Request<T>, Status> {
        let mut request = Request::new(msg);
        let value = |s: &str| {
            s.parse()
                .map_err(|_| Status::internal("a name that cannot be sent as metadata"))
        };
        if let Some(client) = client {
            request.metadata_mut().insert(ON_BEHALF_OF, value(client)?);
        }
        request.metadata_mut().insert(RELAYED, value(self.id())?);
        Ok(request)
    }

    /// A join with a token this replica does not know, tried on the others (the token was
    /// created through one of them, which keeps it and uses it once): the first answer of a
    /// replica that knows the token, `None` when none does.
    pub async fn join_elsewhere(
        &self,
        join: &JoinRequest,
    ) -> Option<(String, Result<JoinResponse, Status>)> {
        // A token is kept by one replica only: all may be asked at once.
        let answers = self
            .ask_all(|peer| async move {
                let request = self.to_peer(None, join.clone())?;
                let channel = self.channel(&peer.owner_url)?;
                EnrollmentClient::new(channel).join(request).await
            })
            .await;
        let mut refused = None;
        for (owner, answer) in answers {
            match answer {
                Some(Ok(response)) => return Some((owner, Ok(response.into_inner()))),
                Some(Err(status)) if status.message().starts_with(crate::enroll::UNKNOWN_TOKEN) => {
                }
                Some(Err(status)) => refused = refused.or(Some((owner, Err(status)))),
                None => {
                    tracing::warn!(replica = %owner, "another replica did not answer a join in time");
                }
            }
        }
        refused
    }

    /// The join tokens the other replicas keep, for administrator `client`.
    pub async fn remote_tokens(&self, client: &str) -> Vec<JoinTokenInfo> {
        self.gather("join tokens", |peer| async move {
            let request = self.to_peer(Some(client), ListJoinTokensRequest {})?;
            let channel = self.channel(&peer.owner_url)?;
            let listed = JoinTokensClient::new(channel)
                .list_join_tokens(request)
                .await?;
            Ok(listed.into_inner().tokens)
        })
        .await
    }

    /// Revokes a join token this replica does not keep on the replica that does.
    pub async fn revoke_token_elsewhere(
        &self,
        client: &str,
        revoke: &RevokeJoinTokenRequest,
    ) -> Option<Result<RevokeJoinTokenResponse, Status>> {
        let answers = self
            .ask_all(|peer| async move {
                let request = self.to_peer(Some(client), revoke.clone())?;
                let channel = self.channel(&peer.owner_url)?;
                JoinTokensClient::new(channel)
                    .revoke_join_token(request)
                    .await
            })
            .await;
        let mut refused = None;
        for (_, answer) in answers {
            match answer {
                Some(Ok(response)) => return Some(Ok(response.into_inner())),
                Some(Err(status)) if status.code() == tonic::Code::NotFound => {}
                Some(Err(status)) => refused = refused.or(Some(Err(status))),
                None => {
                    refused = refused.or(Some(Err(Status::deadline_exceeded(
                        "another replica did not answer in time",
                    ))));
                }
            }
        }
        refused
    }

    /// Whether another replica holds host `id`'s link now.
    pub fn routed_elsewhere(&self, id: &str) -> bool {
        self.cluster.route(id).is_some_and(|r| r.owner != self.id())
    }

    /// Hosts other replicas held that have no link now.
    pub fn gone(&self) -> BTreeMap<String, Gone> {
        self.lock_gone().clone()
    }

    /// Forgets the hosts other replicas held that have had no link for longer than `after` (if
    /// any), or that are `revoked`, telling this replica's watchers; their ids.
    pub fn forget_gone(
        &self,
        state: &State,
        after: Option<Duration>,
        revoked: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let mut forgotten = Vec::new();
        self.lock_gone().retain(|id, gone| {
            let keep = !revoked(id) && after.is_none_or(|after| gone.since.elapsed() <= after);
            if !keep {
                forgotten.push(id.clone());
            }
            keep
        });
        for id in &forgotten {
            self.emit_remote(state, CatalogEventKind::HostForgotten, id, (0, 0));
        }
        forgotten
    }

    fn lock_gone(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Gone>> {
        self.gone.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The next event of the other replicas' hosts ([`Replicas::remote_events`]); never without
/// replicas (`None`).
pub(crate) async fn next_remote(
    remote: &mut Option<broadcast::Receiver<CatalogEvent>>,
) -> Result<CatalogEvent, broadcast::error::RecvError> {
    match remote {
        Some(remote) => remote.recv().await,
        None => std::future::pending().await,
    }
}

/// A host another replica held that has no link now: its last record, whether it is offline or
/// reconnecting (its replica went away), and since when this replica has known it away.
#[derive(Debug, Clone)]
pub struct Gone {
    pub record: HostRecord,
    pub state: HostState,
    since: tokio::time::Instant,
}

impl Gone {
    fn new(record: HostRecord, state: HostState) -> Self {
        Self {
            record,
            state,
            since: tokio::time::Instant::now(),
        }
    }
}

/// Runs one call on a host another replica holds, passing its events to `emit`; the result.
pub(crate) async fn relay_call<F, Fut>(
    state: &State,
    replicas: &Replicas,
    record: &HostRecord,
    host: &str,
    spec: &CallSpec,
    mut emit: F,
) -> CallResult
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    let lost = |message: String| CallResult::not_run(CallStatus::Offline, message);
    // This replica's policy first, on the facts and trusted labels the owner recorded: a call
    // it denies goes no further (the owner checks again, and asks for approvals).
    if let Err(reason) = check_policy(state, record, host, spec) {
        let result = CallResult::not_run(CallStatus::Denied, reason);
        crate::audit::Pending::new(
            &state.audit,
            crate::audit::Record {
                client: &spec.client,
                host,
                tool: &spec.tool,
                args_sha256: &spec.args_sha256,
                fanout: spec.fanout.as_deref(),
            },
        )
        .finish(&result);
        emit(Event::Result(result.clone())).await;
        return result;
    }
    let request = CallRequest {
        host: host.to_string(),
        tool: spec.tool.clone(),
        args_json: spec.args_json.clone(),
        cwd: spec.cwd.clone(),
        timeout_ms: spec.timeout_ms,
        ..CallRequest::default()
    };
    let started = std::time::Instant::now();
    // A host whose replica went away from etcd is tried on that replica, which may hold its
    // link still: only once a connection to it is made is the call sent, so a replica that is
    // really gone leaves the call not run, not lost.
    let unreachable = if replicas.remote(host).is_none() {
        replicas.reach(&record.owner_url).await.err()
    } else {
        None
    };
    let (mut tools, request) = match replicas.relay(record, &spec.client, request) {
        Ok(r) => r,
        Err(s) => return lost(s.message().to_string()),
    };
    let result = async {
        if let Some(why) = unreachable {
            return Ok(Some(CallResult::not_run(
                CallStatus::Offline,
                format!(
                    "host `{host}` is reconnecting: replica {}, which held its link, is gone from \
                     the cluster (its etcd lease lapsed) and cannot be reached ({why}); its agent \
                     attaches to another replica within seconds if that replica is down",
                    record.owner
                ),
            )));
        }
        let mut stream = match tools.call(request).await {
            Ok(response) => response.into_inner(),
            Err(status) => return Err(status),
        };
        while let Some(event) = stream.next().await {
            let event = event?;
            let forwarded = match event.event {
                Some(call_event::Event::Output(chunk)) => emit(Event::Output(chunk)).await,
                Some(call_event::Event::Approval(request)) => emit(Event::Approval(request)).await,
                Some(call_event::Event::Result(result)) => return Ok(Some(result)),
                None => true,
            };
            if !forwarded {
                // The caller went away: dropping the stream cancels the call on the host.
                return Ok(None);
            }
        }
        Ok(None)
    }
    .await;
    let result = match result {
        Ok(Some(result)) => result,
        Ok(None) => CallResult {
            status: CallStatus::Cancelled as i32,
            message: format!(
                "the call on {host} (held by replica {}) ended without a result",
                record.owner
            ),
            ..CallResult::default()
        },
        Err(status) => relay_failed(host, record, &status),
    };
    let mut result = result;
    if result.duration_ms == 0 {
        result.duration_ms = started.elapsed().as_millis() as u64;
    }
    state.audit.relayed(
        &crate::audit::Record {
            client: &spec.client,
            host,
            tool: &spec.tool,
            args_sha256: &spec.args_sha256,
            fanout: spec.fanout.as_deref(),
        },
        &record.owner,
        &result,
    );
    if !emit(Event::Result(result.clone())).await {
        tracing::debug!(host, "the caller went away before the relayed result");
    }
    result
}

/// This replica's policy on a call to `host`, which another replica holds.
fn check_policy(
    state: &State,
    record: &HostRecord,
    host: &str,
    spec: &CallSpec,
) -> Result<(), String> {
    let trusted = labels_of(&record.facts, "trusted.");
    state
        .policy
        .now()
        .check(&spec.client, &spec.tool, &candidate(host, record, &trusted))
        .map(|_| ())
}

/// A host another replica holds as selectors and policy see it, with `labels` (its selectable
/// or its trusted ones).
fn candidate<'a>(
    id: &'a str,
    record: &'a HostRecord,
    labels: &'a BTreeMap<String, String>,
) -> crate::selector::Candidate<'a> {
    let fact = |k: &str| record.facts.get(k).map_or("", String::as_str);
    crate::selector::Candidate {
        id,
        os: fact("os"),
        arch: fact("arch"),
        hostname: fact("hostname"),
        kernel: fact("kernel"),
        sandbox: fact("sandbox"),
        labels,
    }
}

/// The result of a relay that broke: the owner is gone or refused.
fn relay_failed(host: &str, record: &HostRecord, status: &Status) -> CallResult {
    let (code, what) = match status.code() {
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown => (
            CallStatus::Lost,
            "call lost: the replica holding its link went away or cannot be reached",
        ),
        tonic::Code::PermissionDenied => (CallStatus::Denied, "refused"),
        tonic::Code::ResourceExhausted => (CallStatus::Busy, "busy"),
        _ => (CallStatus::Lost, "call lost: the relay failed"),
    };
    CallResult {
        status: code as i32,
        message: format!(
            "{host}: {what} (replica {}): {}",
            record.owner,
            toolsrv_proto::text::transport_words(status.message())
        ),
        ..CallResult::default()
    }
}

/// What the routing table keeps of a host: what selectors match and `ListHosts` shows.
pub fn facts_of(host: &HostEntry) -> BTreeMap<String, String> {
    let mut facts = BTreeMap::from([
        ("os".to_string(), host.facts.os.clone()),
        ("arch".to_string(), host.facts.arch.clone()),
        ("hostname".to_string(), host.facts.hostname.clone()),
        ("kernel".to_string(), host.facts.kernel.clone()),
        (
            "sandbox".to_string(),
            host.facts
                .sandbox
                .as_ref()
                .map(|s| s.level.clone())
                .unwrap_or_default(),
        ),
        ("agent_version".to_string(), host.agent_version.clone()),
        (
            "max_concurrent_calls".to_string(),
            host.max_concurrent_calls.to_string(),
        ),
    ]);
    for (k, v) in &host.selectable_labels {
        facts.insert(format!("label.{k}"), v.clone());
    }
    for (k, v) in &host.trusted_labels {
        facts.insert(format!("trusted.{k}"), v.clone());
    }
    facts
}

/// The labels of a record's facts under `prefix` (`label.` or `trusted.`).
pub fn labels_of(facts: &BTreeMap<String, String>, prefix: &str) -> BTreeMap<String, String> {
    facts
        .iter()
        .filter_map(|(k, v)| k.strip_prefix(prefix).map(|k| (k.to_string(), v.clone())))
        .collect()
}

/// `ListHosts`' entry of a host another replica holds (`state` online, or reconnecting).
pub fn host_info(id: &str, record: &HostRecord, state: HostState) -> HostInfo {
    let fact = |k: &str| record.facts.get(k).cloned().unwrap_or_default();
    // The level is what selectors (`sandbox=enforced`) and `toolctl hosts` read; the rest of
    // what the sandbox is made of stays with the replica that holds the host.
    let sandbox = Some(fact("sandbox"))
        .filter(|level| !level.is_empty())
        .map(|level| SandboxFacts {
            level,
            ..SandboxFacts::default()
        });
    HostInfo {
        host_id: id.to_string(),
        state: state as i32,
        facts: Some(HostFacts {
            os: fact("os"),
            arch: fact("arch"),
            hostname: fact("hostname"),
            kernel: fact("kernel"),
            labels: labels_of(&record.facts, "label.").into_iter().collect(),
            sandbox,
        }),
        agent_version: fact("agent_version"),
        max_concurrent_calls: fact("max_concurrent_calls").parse().unwrap_or_default(),
        connected_unix_ms: record.attached_unix.saturating_mul(1000),
        trusted_labels: labels_of(&record.facts, "trusted.").into_iter().collect(),
        replica: record.owner.clone(),
        ..HostInfo::default()
    }
}

/// Follows the replicas: drops local links a newer link elsewhere replaced, remembers hosts
/// whose owner went away (reconnecting), and says in the health service when etcd is not
/// usable.
pub(crate) async fn follow(state: Arc<State>, reporter: tonic_health::server::HealthReporter) {
    let Some(replicas) = state.replicas.clone() else {
        return;
    };
    let mut events = replicas.cluster.subscribe();
    let mut health = replicas.cluster.health_watch();
    // Revocations made before this subscription are in the table.
    follow_revocations(&state, &replicas);
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            changed = health.changed() => {
                if changed.is_err() {
                    return;
                }
                let now = health.borrow_and_update().clone();
                match now {
                    ClusterHealth::Ok => {
                        reporter.set_service_status(CLUSTER_HEALTH, tonic_health::ServingStatus::Serving).await;
                    }
                    ClusterHealth::Degraded(why) => {
                        tracing::warn!(reason = %why, "etcd is not usable: serving the hosts held here, refusing new links");
                        reporter.set_service_status(CLUSTER_HEALTH, tonic_health::ServingStatus::NotServing).await;
                    }
                }
            }
            event = events.recv() => match event {
                Ok(ClusterEvent::Superseded { host_id, lost_link_id, by }) => {
                    if let Some(link) = state.fleet.get(&host_id).and_then(|h| h.link)
                        && link.link_id == lost_link_id
                    {
                        tracing::info!(host = %host_id, to = %by.owner, "host attached to another replica; dropping the old link");
                        link.close(&format!("replaced by a newer link on replica {}", by.owner));
                    }
                }
                Ok(ClusterEvent::ReplicaGone { replica, hosts }) => {
                    tracing::warn!(replica = %replica.id, hosts = hosts.len(), "a replica is gone; its hosts are reconnecting");
                    for host in &hosts {
                        if replicas.cluster.route(host).is_none() && !state.fleet.get(host).is_some_and(|h| h.online()) {
                            replicas.emit_remote(&state, CatalogEventKind::HostOffline, host, (0, 0));
                        }
                    }
                    let mut gone = replicas.lock_gone();
                    for host in hosts {
                        let entry = gone.entry(host).or_insert_with(|| {
                            let record = HostRecord {
                                owner: replica.id.clone(),
                                owner_url: replica.advertise_url.clone(),
                                ..HostRecord::default()
                            };
                            Gone::new(record, HostState::Reconnecting)
                        });
                        entry.state = HostState::Reconnecting;
                    }
                }
                Ok(ClusterEvent::HostReleased { host_id, record }) if record.owner != replicas.id() => {
                    // Kept with its facts while it may come back, here or through another
                    // replica; a replica that went away made it reconnecting already. Kept
                    // before it is told offline: a revoked one is forgotten at that news.
                    replicas
                        .lock_gone()
                        .entry(host_id.clone())
                        .or_insert_with(|| Gone::new(record, HostState::Offline));
                    if replicas.cluster.route(&host_id).is_none() && !state.fleet.get(&host_id).is_some_and(|h| h.online()) {
                        replicas.emit_remote(&state, CatalogEventKind::HostOffline, &host_id, (0, 0));
                    }
                }
                Ok(ClusterEvent::HostClaimed { host_id, record }) => {
                    if record.owner != replicas.id() {
                        replicas.emit_remote(&state, CatalogEventKind::HostOnline, &host_id, (0, 0));
                    }
                    replicas.lock_gone().remove(&host_id);
                }
                Ok(ClusterEvent::Revoked { identity, record }) => {
                    revocation_changed(&state, &identity, Some(&record));
                }
                Ok(ClusterEvent::Unrevoked { identity }) => {
                    revocation_changed(&state, &identity, None);
                }
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(missed = n, "fell behind the replicas' events");
                    follow_revocations(&state, &replicas);
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

/// Serves the catalog the replicas agree on: each change of this replica's tools path waits
/// until etcd agrees on its revision (retried while etcd cannot answer: the previous revision is
/// served meanwhile), and an agreement another replica made is served here too as soon as this
/// replica's tools are the same. When they are not, the tools path is read again at once (a
/// synced directory may just be late); if they still differ, this replica keeps serving its own
/// tools at its own revision and says so.
pub(crate) async fn follow_catalog(state: Arc<State>) {
    let Some(replicas) = state.replicas.clone() else {
        return;
    };
    let registry = state.registry.clone();
    let mut scans = registry.scans();
    let mut agreements = replicas.cluster.catalog_watch();
    // A scan still waiting for its revision, and when to try again.
    let mut pending: Option<Arc<Catalog>> = None;
    let mut backoff = Duration::from_millis(500);
    let mut retry_at = tokio::time::Instant::now();
    let mut warned_about = 0;
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            changed = scans.changed() => {
                if changed.is_err() {
                    return;
                }
                pending = Some(scans.borrow_and_update().clone());
                backoff = Duration::from_millis(500);
                retry_at = tokio::time::Instant::now();
            }
            changed = agreements.changed() => {
                if changed.is_err() {
                    return;
                }
                let Some(agreed) = agreements.borrow_and_update().clone() else {
                    continue;
                };
                if agreed.revision <= registry.catalog().revision {
                    continue;
                }
                let mut scan = registry.scans().borrow().clone();
                if scan.content_digest() != agreed.digest {
                    let again = registry.clone();
                    if let Ok(Some(_)) = tokio::task::spawn_blocking(move || again.rescan()).await {
                        scan = registry.scans().borrow().clone();
                    }
                }
                if scan.content_digest() == agreed.digest {
                    registry.publish(&scan, agreed.revision);
                    if pending.as_ref().is_some_and(|p| p.same_tools(&scan)) {
                        pending = None;
                    }
                } else if agreed.revision > warned_about {
                    warned_about = agreed.revision;
                    tracing::warn!(
                        agreed = agreed.revision,
                        serving = registry.catalog().revision,
                        "another replica serves other tools at a newer catalog revision: this \
                         replica's tools path differs; it keeps serving its own tools until they \
                         are the same"
                    );
                }
                continue;
            }
            () = tokio::time::sleep_until(retry_at), if pending.is_some() => {}
        }
        let Some(scan) = pending.clone() else {
            continue;
        };
        if tokio::time::Instant::now() < retry_at {
            continue;
        }
        match replicas.agree_catalog(&registry, &scan).await {
            Ok(_) => pending = None,
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    serving = registry.catalog().revision,
                    retry_in_ms = backoff.as_millis() as u64,
                    "the tools path changed but etcd cannot agree on its revision yet; serving \
                     the previous revision meanwhile"
                );
                retry_at = tokio::time::Instant::now() + backoff;
                backoff = (backoff * 2).min(Duration::from_secs(15));
            }
        }
    }
}

/// Takes etcd's list of revocations as this replica's: the identities it newly revokes lose
/// their links and connections here.
fn follow_revocations(state: &State, replicas: &Replicas) {
    let records = replicas.cluster.revocations();
    let ended = state.revocations.replace_with(&records, |identity, by| {
        crate::revocation::end_agent_link(state, identity, by);
    });
    if let Err(e) = ended {
        tracing::error!(error = %toolsrv_proto::text::printable_line(e.message(), 1024), "cannot keep the revocations etcd holds");
    }
}

/// One change of etcd's revocations, taken here.
fn revocation_changed(state: &State, identity: &str, record: Option<&[u8]>) {
    let taken = state
        .revocations
        .apply_remote(identity, record, |identity, by| {
            crate::revocation::end_agent_link(state, identity, by);
        });
    if let Err(e) = taken {
        tracing::error!(
            identity = %toolsrv_proto::text::printable_line(identity, 256),
            error = %toolsrv_proto::text::printable_line(e.message(), 1024),
            "cannot keep a revocation etcd holds"
        );
    }
}

/// Follows every other replica's own `WatchCatalog` (one relayed stream per replica, made again
/// when it breaks, ended when the replica goes) and passes on the view changes of the hosts
/// each one holds, so a watch through any replica sees the whole fleet's.
pub(crate) async fn follow_peer_views(state: Arc<State>) {
    let Some(replicas) = state.replicas.clone() else {
        return;
    };
    let mut events = replicas.cluster.subscribe();
    let mut peers: HashMap<String, CancellationToken> = HashMap::new();
    loop {
        let live: HashMap<String, String> = replicas
            .cluster
            .replicas()
            .into_iter()
            .filter(|r| r.id != replicas.id())
            .map(|r| (r.id, r.advertise_url))
            .collect();
        peers.retain(|id, stop| {
            let keep = live.contains_key(id);
            if !keep {
                stop.cancel();
            }
            keep
        });
        for (id, url) in live {
            if peers.contains_key(&id) {
                continue;
            }
            let stop = state.shutdown.child_token();
            peers.insert(id.clone(), stop.clone());
            state
                .tasks
                .spawn(follow_peer(state.clone(), replicas.clone(), id, url, stop));
        }
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            event = events.recv() => match event {
                Ok(ClusterEvent::ReplicaUp(_) | ClusterEvent::ReplicaGone { .. })
                | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Ok(_) => continue,
                Err(broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

/// One other replica's view changes, until `stop`.
async fn follow_peer(
    state: Arc<State>,
    replicas: Arc<Replicas>,
    peer: String,
    url: String,
    stop: CancellationToken,
) {
    let record = HostRecord {
        owner: peer.clone(),
        owner_url: url,
        ..HostRecord::default()
    };
    let mut failures = 0u32;
    loop {
        let watched = async {
            let (mut tools, request) =
                replicas.relay(&record, replicas.id(), WatchCatalogRequest {})?;
            let mut stream = tools.watch_catalog(request).await?.into_inner();
            while let Some(event) = stream.next().await {
                let event = event?;
                failures = 0;
                // Unless the table already names another holder (a link the peer is dropping);
                // a claim the table has not seen yet is the peer's.
                let elsewhere = replicas
                    .cluster
                    .route(&event.host)
                    .is_some_and(|r| r.owner != peer);
                if event.kind == CatalogEventKind::HostView as i32 && !elsewhere {
                    // The first of each host repeats what was known before a reconnection.
                    let before = replicas
                        .remote_views
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(
                            event.host.clone(),
                            (event.view_revision, event.visible_tools),
                        );
                    // A view kept for sessions may have changed even at the same revision (the
                    // host itself changed): said too, so that their watchers look again.
                    let mirrored = replicas.invalidate(&event.host);
                    let now = (event.view_revision, event.visible_tools);
                    if before != Some(now) || mirrored {
                        replicas.emit_remote(&state, CatalogEventKind::HostView, &event.host, now);
                    }
                }
            }
            Ok::<(), Status>(())
        };
        let ended = tokio::select! {
            () = stop.cancelled() => return,
            ended = watched => ended,
        };
        failures = failures.saturating_add(1);
        if let Err(status) = ended {
            tracing::debug!(replica = %peer, error = %status.message(), "the watch of another replica ended; watching again");
        }
        let wait = Duration::from_millis(250 * u64::from(failures.min(20)));
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// The health service name that says whether etcd is usable (NOT_SERVING: new links are
/// refused, the ones held are served).
pub const CLUSTER_HEALTH: &str = "toolsrv.cluster";

/// Whether a request came from another replica (never relayed again): it carries [`RELAYED`]
/// and its connection a coordinator certificate. A client or a joining host that sets the
/// header is not a replica: a relayed request skips the limits the replica it reached applied
/// (watch streams, refused joins), so the header alone must not count.
pub fn is_relayed<T>(req: &Request<T>) -> bool {
    req.metadata().get(RELAYED).is_some()
        && toolsrv_tls::peer_of(req)
            .is_some_and(|peer| peer.identity.role() == toolsrv_tls::Role::Coordinator)
}

/// The replica to relay a request about session `id` to: replicas on, the request not relayed
/// already, and the id naming another replica (sessions live where they were opened). NOT_FOUND
/// when that replica is gone, with its sessions.
pub(crate) fn session_elsewhere<'s>(
    state: &'s State,
    id: &str,
    relayed: bool,
) -> Result<Option<(&'s Arc<Replicas>, HostRecord)>, Status> {
    let Some(replicas) = &state.replicas else {
        return Ok(None);
    };
    let Some(owner) = crate::sessions::replica_of(id).filter(|r| *r != replicas.id()) else {
        return Ok(None);
    };
    if relayed {
        return Ok(None);
    }
    match replicas.cluster.replica(owner) {
        Some(replica) => Ok(Some((
            replicas,
            HostRecord {
                owner: replica.id,
                owner_url: replica.advertise_url,
                ..HostRecord::default()
            },
        ))),
        None => Err(toolsrv_proto::session_gone(Status::not_found(format!(
            "no session `{}`: it was kept by replica `{}`, which is gone (its sessions ended \
             with it)",
            toolsrv_proto::text::printable_line(id, 100),
            toolsrv_proto::text::printable_line(owner, 64)
        )))),
    }
}

/// The record of `host` when its request is to be relayed: replicas on, not relayed already,
/// no live link here, and another replica holds one.
pub(crate) fn route_elsewhere(state: &State, host: &str, relayed: bool) -> Option<HostRecord> {
    let replicas = state.replicas.as_ref()?;
    if relayed || state.fleet.get(host).is_some_and(|h| h.online()) {
        return None;
    }
    replicas.remote(host).or_else(|| replicas.last_holder(host))
}

/// Runs a call wherever its host's link is: here, or relayed to the replica that holds it.
pub(crate) async fn run_call<F, Fut>(
    state: &State,
    host: &str,
    spec: &CallSpec,
    slot: Option<crate::quota::Slot>,
    relayed: bool,
    emit: F,
) -> CallResult
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    if let (Some(record), Some(replicas)) = (
        route_elsewhere(state, host, relayed),
        state.replicas.as_deref(),
    ) {
        return relay_call(state, replicas, &record, host, spec, emit).await;
    }
    crate::calls::run(state, host, spec, slot, emit).await
}

impl Replicas {
    /// Hosts other replicas hold that `selector` picks, with their records.
    pub fn select_remote(&self, selector: &crate::selector::Selector) -> Vec<(String, HostRecord)> {
        self.cluster
            .hosts()
            .into_iter()
            .filter(|(_, r)| r.owner != self.id())
            .filter(|(id, r)| {
                let labels = labels_of(&r.facts, "label.");
                selector.matches(&candidate(id, r, &labels))
            })
            .collect()
    }

    /// Every host of the fleet as `ListHosts` shows it: the ones linked here, the ones other
    /// replicas hold, and the ones without a link (offline, or reconnecting when their replica
    /// went away), sorted by id.
    pub fn hosts(&self, state: &State) -> Vec<HostInfo> {
        let offline = |i: &HostInfo| {
            i.state == HostState::Offline as i32 || i.state == HostState::Reconnecting as i32
        };
        let mut by_id: BTreeMap<String, HostInfo> = BTreeMap::new();
        for id in state.fleet.ids() {
            if let Some(host) = state.fleet.get(&id) {
                let mut info = host.info();
                if host.online() {
                    info.replica = self.id().to_string();
                }
                by_id.insert(id, info);
            }
        }
        for (id, gone) in self.gone() {
            if by_id.get(&id).is_none_or(offline) {
                by_id.insert(id.clone(), host_info(&id, &gone.record, gone.state));
            }
        }
        let views = self.remote_views.lock().unwrap_or_else(|p| p.into_inner());
        for (id, record) in self.cluster.hosts() {
            if record.owner != self.id() && by_id.get(&id).is_none_or(offline) {
                let mut info = host_info(&id, &record, HostState::Online);
                (info.view_revision, info.visible_tools) =
                    views.get(&id).copied().unwrap_or_default();
                by_id.insert(id.clone(), info);
            }
        }
        by_id.into_values().collect()
    }
}

/// Runs `futures` together for at most `limit`; their outputs in the same order, `None` for
/// those not done by then (dropped, so cancelled).
pub(crate) async fn join_within<F: Future>(
    limit: Duration,
    futures: impl IntoIterator<Item = F>,
) -> Vec<Option<F::Output>> {
    let stop = tokio::time::sleep(limit);
    let mut pending: Vec<(usize, Pin<Box<F>>)> =
        futures.into_iter().map(Box::pin).enumerate().collect();
    let mut done: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    let mut stop = std::pin::pin!(stop);
    std::future::poll_fn(|cx| {
        pending.retain_mut(|(i, future)| match future.as_mut().poll(cx) {
            Poll::Ready(output) => {
                done[*i] = Some(output);
                false
            }
            Poll::Pending => true,
        });
        if pending.is_empty() || stop.as_mut().poll(cx).is_ready() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    done
}

/// A session's entry for `id`, which another replica holds (`record`), with `view`.
fn remote_entry(
    id: &str,
    record: &HostRecord,
    view: Option<Arc<crate::views::StoredView>>,
) -> HostEntry {
    let info = host_info(id, record, HostState::Online);
    HostEntry {
        id: id.to_string(),
        facts: info.facts.unwrap_or_default(),
        agent_version: info.agent_version,
        max_concurrent_calls: info.max_concurrent_calls,
        connected_unix_ms: info.connected_unix_ms,
        synced: view.is_some(),
        view,
        certificate_labels: BTreeMap::new(),
        trusted_labels: labels_of(&record.facts, "trusted."),
        // What the table keeps as `label.` is already the selectable set (trusted ones over).
        selectable_labels: labels_of(&record.facts, "label."),
        link: None,
        remote: Some(record.owner.clone()),
        last_seen: Arc::new(0.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn what_is_not_done_within_the_limit_is_left_out_and_cancelled() {
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        struct Flag(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let slow = |ms: u64, flag: Option<Flag>| async move {
            let _flag = flag;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            ms
        };
        let start = tokio::time::Instant::now();
        let got = join_within(
            Duration::from_secs(3),
            [
                slow(10, None),
                slow(60_000, Some(Flag(dropped.clone()))),
                slow(2_000, None),
            ],
        )
        .await;
        assert_eq!(got, [Some(10), None, Some(2_000)]);
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        assert!(
            dropped.load(std::sync::atomic::Ordering::SeqCst),
            "cancelled"
        );

        // All done early: no waiting for the limit, and the order kept.
        let start = tokio::time::Instant::now();
        let got = join_within(Duration::from_secs(3), [slow(20, None), slow(5, None)]).await;
        assert_eq!(got, [Some(20), Some(5)]);
        assert_eq!(start.elapsed(), Duration::from_millis(20));
        let none = join_within(Duration::from_secs(3), Vec::<std::future::Ready<u8>>::new()).await;
        assert!(none.is_empty());
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(20),
            "nothing to wait for"
        );
    }
}
