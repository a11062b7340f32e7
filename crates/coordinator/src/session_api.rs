//! The session RPCs of the client API: open, load, unload, show, watch and close a session.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};
use tonic::Status;
use toolsrv_proto::v1::{LoadToolRequest, OpenSessionRequest, SessionState, UnloadToolRequest};

use crate::State;
use crate::sessions::Session;

/// How long a watcher lets changes settle before it recomputes: a registry change reaches every
/// host's view within moments, and one message for all of them beats one per host.
const SETTLE: Duration = Duration::from_millis(50);

fn state_of(state: &State, session: &Session) -> SessionState {
    session.state(
        &state.fleet,
        &state.registry.catalog(),
        state.sessions.idle(),
    )
}

pub fn open(state: &State, client: &str, req: OpenSessionRequest) -> Result<SessionState, Status> {
    let profile = req.profile.unwrap_or_default();
    let session = state.sessions.open(client, profile, req.hosts)?;
    tracing::info!(session = %session.id, owner = %client, "session opened");
    Ok(state_of(state, &session))
}

pub fn load(state: &State, client: &str, req: LoadToolRequest) -> Result<SessionState, Status> {
    let session = state.sessions.get(client, &req.session)?;
    session.load(&state.fleet, &state.registry.catalog(), &req.tool)?;
    Ok(state_of(state, &session))
}

pub fn unload(state: &State, client: &str, req: UnloadToolRequest) -> Result<SessionState, Status> {
    let session = state.sessions.get(client, &req.session)?;
    session.unload(&req.tool)?;
    Ok(state_of(state, &session))
}

pub fn get(state: &State, client: &str, id: &str) -> Result<SessionState, Status> {
    let session = state.sessions.get(client, id)?;
    Ok(state_of(state, &session))
}

pub fn close(state: &State, client: &str, id: &str) -> Result<(), Status> {
    state.sessions.close(client, id)?;
    tracing::info!(session = %id, owner = %client, "session closed");
    Ok(())
}

/// Marks `tool` used in `client`'s session `id` (a call made for it); refused when the session
/// is not the caller's.
pub fn touch(state: &State, client: &str, id: &str, tool: &str) -> Result<(), Status> {
    state.sessions.get(client, id)?.touch(tool);
    Ok(())
}

/// Streams the session's state now and after every change, until the watcher goes away, the
/// session ends (then NOT_FOUND) or the coordinator shuts down.
pub fn watch(
    state: &Arc<State>,
    client: &str,
    id: &str,
    tx: mpsc::Sender<Result<SessionState, Status>>,
) -> Result<(), Status> {
    let session = state.sessions.get(client, id)?;
    let guard = session.attach();
    let mut loads = session.subscribe();
    let mut fleet = state.fleet.subscribe();
    let state = state.clone();
    state.tasks.clone().spawn(async move {
        let _guard = guard;
        let mut sent = None;
        loop {
            let now = state_of(&state, &session);
            if sent != Some(now.generation) {
                sent = Some(now.generation);
                if tx.send(Ok(now)).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                () = tx.closed() => return,
                () = state.shutdown.cancelled() => return,
                () = session.closed.cancelled() => {
                    let _ = tx.send(Err(Status::not_found(format!("session `{}` ended", session.id)))).await;
                    return;
                }
                changed = loads.changed() => if changed.is_err() { return },
                event = fleet.recv() => match event {
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            }
            tokio::time::sleep(SETTLE).await;
            // What came meanwhile is covered by the state computed next.
            while !matches!(fleet.try_recv(), Err(broadcast::error::TryRecvError::Empty | broadcast::error::TryRecvError::Closed)) {}
            loads.mark_unchanged();
        }
    });
    Ok(())
}
