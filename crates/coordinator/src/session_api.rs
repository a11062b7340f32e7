//! The session RPCs of the client API: open, load, unload, show, watch, list and close sessions.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};
use tonic::Status;
use toolsrv_proto::v1::{LoadToolRequest, OpenSessionRequest, SessionState, UnloadToolRequest};

use crate::State;
use crate::fleet::HostEntry;
use crate::sessions::Session;

/// How long a watcher lets changes settle before it recomputes: a registry change reaches every
/// host's view within moments, and one message for all of them beats one per host.
const SETTLE: Duration = Duration::from_millis(50);

/// The hosts `session` spans: this replica's that its selector picks and, with replicas, the
/// other replicas' (with their views), a host linked here winning; sorted by id.
async fn hosts_of(state: &State, session: &Session) -> Vec<HostEntry> {
    let mut hosts = session.local_hosts(&state.fleet);
    let Some(replicas) = &state.replicas else {
        return hosts;
    };
    for remote in replicas
        .remote_entries(session.selector(), session.owner())
        .await
    {
        match hosts.binary_search_by(|h| h.id.cmp(&remote.id)) {
            Ok(i) if !hosts[i].online() => hosts[i] = remote,
            Ok(_) => {}
            Err(i) => hosts.insert(i, remote),
        }
    }
    hosts
}

async fn state_of(state: &State, session: &Session) -> SessionState {
    let hosts = hosts_of(state, session).await;
    session.state(
        &hosts,
        &state.registry.catalog(),
        state.sessions.idle(),
        &state.policy.now(),
    )
}

pub async fn open(
    state: &State,
    client: &str,
    req: OpenSessionRequest,
) -> Result<SessionState, Status> {
    let profile = req.profile.unwrap_or_default();
    let session = state.sessions.open(client, profile, req.hosts)?;
    let hosts = hosts_of(state, &session).await;
    let (opened, left_out) = session.state_fitted(
        &hosts,
        &state.registry.catalog(),
        state.sessions.idle(),
        &state.policy.now(),
    );
    if let Some(bytes) = left_out {
        // Nothing made: the client gets the error, not a session whose tools are left out.
        state.sessions.close(client, &session.id)?;
        return Err(crate::sessions::SessionError::TooLarge {
            what: "the profile's autoLoad".to_string(),
            bytes,
            max: crate::sessions::MAX_STATE_BYTES,
        }
        .into());
    }
    tracing::info!(session = %session.id, owner = %client, "session opened");
    Ok(opened)
}

pub async fn load(
    state: &State,
    client: &str,
    req: LoadToolRequest,
) -> Result<SessionState, Status> {
    let session = state.sessions.get(client, &req.session)?;
    let hosts = hosts_of(state, &session).await;
    let catalog = state.registry.catalog();
    let policy = state.policy.now();
    session.load(&hosts, &catalog, &req.tool, &policy)?;
    Ok(session.state(&hosts, &catalog, state.sessions.idle(), &policy))
}

pub async fn unload(
    state: &State,
    client: &str,
    req: UnloadToolRequest,
) -> Result<SessionState, Status> {
    let session = state.sessions.get(client, &req.session)?;
    session.unload(&req.tool)?;
    Ok(state_of(state, &session).await)
}

pub async fn get(state: &State, client: &str, id: &str) -> Result<SessionState, Status> {
    let session = state.sessions.get(client, id)?;
    Ok(state_of(state, &session).await)
}

/// The states of the sessions `client` opened on this replica. With replicas, each state asks
/// the others for views it lacks (each within their wait); all are computed at once, so that a
/// replica that does not answer delays the list once, not once per session. A state not ready
/// after twice that wait is given with this replica's hosts alone.
pub async fn list(state: &State, client: &str) -> Vec<SessionState> {
    let sessions = state.sessions.owned_by(client);
    let limit = 2 * crate::replicas::PEER_WAIT;
    let states =
        crate::replicas::join_within(limit, sessions.iter().map(|s| state_of(state, s))).await;
    sessions
        .iter()
        .zip(states)
        .map(|(session, computed)| {
            computed.unwrap_or_else(|| {
                tracing::warn!(session = %session.id, "the hosts other replicas hold did not come in time for the session list");
                let hosts = session.local_hosts(&state.fleet);
                session.state(
                    &hosts,
                    &state.registry.catalog(),
                    state.sessions.idle(),
                    &state.policy.now(),
                )
            })
        })
        .collect()
}

pub fn close(state: &State, client: &str, id: &str) -> Result<(), Status> {
    state.sessions.close(client, id)?;
    tracing::info!(session = %id, owner = %client, "session closed");
    Ok(())
}

/// Marks `tool` used in `client`'s session `id` (a call made for it); refused when the session
/// is not the caller's. A session another replica keeps is left to it (not marked).
pub fn touch(state: &State, client: &str, id: &str, tool: &str) -> Result<(), Status> {
    if let Some(replicas) = &state.replicas
        && crate::sessions::replica_of(id).is_some_and(|r| r != replicas.id())
    {
        return Ok(());
    }
    state.sessions.get(client, id)?.touch(tool);
    Ok(())
}

/// Streams the session's state now and after every change, until the watcher goes away, the
/// session ends (then NOT_FOUND) or the coordinator shuts down.
pub fn watch(
    state: &Arc<State>,
    client: &str,
    id: &str,
) -> Result<mpsc::Receiver<Result<SessionState, Status>>, Status> {
    let session = state.sessions.get(client, id)?;
    let guard = session.attach();
    let mut loads = session.subscribe();
    let mut fleet = state.fleet.subscribe();
    // A new policy may offer the owner more or fewer of its tools.
    let mut settings = state.settings_applied.subscribe();
    // With replicas, the other replicas' hosts coming, going and changing their views.
    let mut remote = state.replicas.as_ref().map(|r| r.remote_events());
    // Room for one state: a watcher that reads nothing holds the one it has not taken, and
    // the next is computed only once that one is, as the newest there is then (with four, a
    // client's unread watchers held eight states each, gigabytes in all).
    let (tx, rx) = mpsc::channel(1);
    let state = state.clone();
    state.tasks.clone().spawn(async move {
        let _guard = guard;
        let mut sent = None;
        loop {
            let room = tokio::select! {
                room = tx.reserve() => match room {
                    Ok(room) => room,
                    Err(_) => return,
                },
                () = state.shutdown.cancelled() => return,
                () = session.closed.cancelled() => return ended(&tx, &session).await,
            };
            let now = state_of(&state, &session).await;
            if sent != Some(now.generation) {
                sent = Some(now.generation);
                room.send(Ok(now));
            } else {
                drop(room);
            }
            tokio::select! {
                () = tx.closed() => return,
                () = state.shutdown.cancelled() => return,
                () = session.closed.cancelled() => return ended(&tx, &session).await,
                changed = loads.changed() => if changed.is_err() { return },
                changed = settings.changed() => if changed.is_err() { return },
                event = fleet.recv() => match event {
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                event = crate::replicas::next_remote(&mut remote) => {
                    if matches!(event, Err(broadcast::error::RecvError::Closed)) {
                        return;
                    }
                }
            }
            tokio::time::sleep(SETTLE).await;
            // What came meanwhile is covered by the state computed next.
            drain(&mut fleet);
            if let Some(remote) = remote.as_mut() {
                drain(remote);
            }
            loads.mark_unchanged();
            settings.mark_unchanged();
        }
    });
    Ok(rx)
}

/// Ends a watch whose session ended, saying so as `GetSession` does (marked, so that a client
/// opens another session at once rather than watching again).
async fn ended(tx: &mpsc::Sender<Result<SessionState, Status>>, session: &Session) {
    let gone = Status::not_found(format!("session `{}` ended", session.id));
    let _ = tx.send(Err(toolsrv_proto::session_gone(gone))).await;
}

/// Takes every event waiting in `events` (missed ones count as taken).
fn drain<T: Clone>(events: &mut broadcast::Receiver<T>) {
    while !matches!(
        events.try_recv(),
        Err(broadcast::error::TryRecvError::Empty | broadcast::error::TryRecvError::Closed)
    ) {}
}
