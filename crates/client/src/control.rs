//! The control socket: one process (`toolctl master`) keeps an mTLS connection to a coordinator
//! and serves the client API on a Unix socket, so that short-lived clients skip the TCP, TLS and
//! HTTP/2 set-up on every command (what ssh's ControlMaster does for ssh).
//!
//! The socket carries plain HTTP/2: only processes of the master's own user (or root) may use it,
//! checked on every connection from the kernel's peer credentials, and whoever can use it acts
//! with the master's client certificate. The other way round, a client talks only to a socket
//! file and a serving process of its own user or root (`trust`).

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Endpoint, Uri};
use tonic::{Request, Response, Status};
use toolsrv_proto::v1::tools_client::ToolsClient;
use toolsrv_proto::v1::tools_server::{Tools, ToolsServer};
use toolsrv_proto::v1::{
    ApproveRequest, ApproveResponse, CallEvent, CallRequest, CatalogEvent, DescribeToolRequest,
    FanOutEvent, FanOutRequest, ListApprovalsRequest, ListApprovalsResponse, ListHostsRequest,
    ListHostsResponse, ListSessionsRequest, ListSessionsResponse, ListToolsRequest,
    ListToolsResponse, ToolDefinition, WatchCatalogRequest,
};
use toolsrv_proto::v1::{
    CloseSessionResponse, FindToolsRequest, FindToolsResponse, GetSessionRequest, LoadToolRequest,
    OpenSessionRequest, SessionState, UnloadToolRequest,
};
use tower::service_fn;

use crate::client::MAX_MESSAGE_SIZE;
use crate::{Client, ClientError};

mod path;
mod trust;

pub use path::{DEFAULT_WORD, default_socket, prepare_default_dir};
use trust::Trust;

/// How long a client waits for the master to accept; it is local, so this only guards a stuck one.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a stopping master lets open RPCs finish before it ends them.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// Connects to a master's control socket now; fails if nothing accepts there, and refuses (with
/// [`ClientError::UntrustedControl`], before sending anything) a socket file or a serving process
/// of another user than ours or root. Every later connection of the channel is checked the same way.
pub(crate) async fn connect(path: &Path) -> Result<Client, ClientError> {
    connect_trusting(path, Trust::current()).await
}

async fn connect_trusting(path: &Path, trust: Trust) -> Result<Client, ClientError> {
    let unreachable = |e: &dyn std::fmt::Display| {
        ClientError::Control(format!(
            "cannot reach the control socket {}: {e}",
            path.display()
        ))
    };
    // The first connection is opened and checked here, so that a refusal comes back as itself
    // rather than as a transport error; the channel's connector then hands it over.
    let first = tokio::time::timeout(CONNECT_TIMEOUT, open_checked(path, trust))
        .await
        .map_err(|_| unreachable(&format!("no answer within {CONNECT_TIMEOUT:?}")))?
        .map_err(|e| match e {
            Open::Untrusted(e) => ClientError::UntrustedControl(e.0),
            Open::Io(e) => unreachable(&e),
        })?;
    let first = Arc::new(std::sync::Mutex::new(Some(first)));
    let target: Arc<Path> = Arc::from(path);
    // The URI is never dialled: the connector always opens the socket.
    let channel = Endpoint::from_static("http://toolctl.control")
        .connect_timeout(CONNECT_TIMEOUT)
        .connect_with_connector(service_fn(move |_: Uri| {
            let target = Arc::clone(&target);
            let first = Arc::clone(&first);
            async move {
                let seeded = first
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take();
                let stream = match seeded {
                    Some(stream) => stream,
                    None => open_checked(&target, trust)
                        .await
                        .map_err(io::Error::from)?,
                };
                Ok::<_, io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .map_err(|e| unreachable(&toolsrv_tls::error_chain(&e)))?;
    Ok(Client::from_channel(channel))
}

/// Why a connection to the control socket was not made.
enum Open {
    Io(io::Error),
    Untrusted(trust::Untrusted),
}

impl From<Open> for io::Error {
    fn from(e: Open) -> Self {
        match e {
            Open::Io(e) => e,
            Open::Untrusted(e) => io::Error::new(io::ErrorKind::PermissionDenied, e),
        }
    }
}

/// Connects to `path` once the file is known to be a socket of ours or root's, then checks who
/// accepted; nothing has been written to the stream when it is returned.
async fn open_checked(path: &Path, trust: Trust) -> Result<UnixStream, Open> {
    if !trust.check_file(path).map_err(Open::Untrusted)? {
        return Err(Open::Io(io::Error::new(
            io::ErrorKind::NotFound,
            "no such socket",
        )));
    }
    let stream = UnixStream::connect(path).await.map_err(Open::Io)?;
    // The file may have been replaced since it was inspected: the peer's credentials are what
    // tell who is really there.
    trust.check_peer(path, &stream).map_err(Open::Untrusted)?;
    Ok(stream)
}

/// What a master does besides relaying.
#[derive(Debug, Clone, Default)]
pub struct MasterOptions {
    /// Exit after this long with no client connected and no RPC in flight (`None`: never).
    pub idle_exit: Option<Duration>,
}

/// A bound control socket, and which file it is (to remove it, and only it, when done).
#[derive(Debug)]
pub struct ControlListener {
    listener: UnixListener,
    path: PathBuf,
    identity: Option<FileIdentity>,
}

/// Binds the control socket at `path`, readable and writable by our user only from the moment it
/// exists.
///
/// A socket left behind by a master that died is replaced; a live master there, or anything that
/// is not a socket (a symbolic link included, which is never followed), is an error that names
/// the path.
pub async fn bind(path: &Path) -> io::Result<ControlListener> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(path).await.is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{}: another master is serving there", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
        }
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{}: exists and is not a socket", path.display()),
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = bind_private(path)
        .and_then(|listener| {
            listener.set_nonblocking(true)?;
            UnixListener::from_std(listener)
        })
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    Ok(ControlListener {
        listener,
        path: path.to_path_buf(),
        identity: file_identity(path),
    })
}

/// Held while [`bind_private`] has the umask changed.
static UMASK_TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `bind(2)` with the umask set to leave the socket file mode 0600 as it is created.
///
/// Changing the mode afterwards by path would follow whatever is at the path by then: a symbolic
/// link swapped in after the bind would turn our `chmod` onto another file. bind(2) itself never
/// follows a link at the final component (an existing one is `EADDRINUSE`). The umask is
/// process-wide, but restored right after this one call; a file another thread creates meanwhile
/// only comes out with fewer permissions. Two binds at once take turns: otherwise each would
/// restore the umask the other set, one socket coming out with the usual umask (0755) and the
/// process left with the restricted one.
fn bind_private(path: &Path) -> io::Result<std::os::unix::net::UnixListener> {
    use nix::sys::stat::{Mode, umask};
    let _turn = UMASK_TURN.lock().unwrap_or_else(|p| p.into_inner());
    let previous = umask(Mode::S_IXUSR | Mode::S_IRWXG | Mode::S_IRWXO);
    // Tests widen the window in which two binds at once would race.
    #[cfg(test)]
    std::thread::sleep(std::time::Duration::from_millis(1));
    let bound = std::os::unix::net::UnixListener::bind(path);
    umask(previous);
    bound
}

/// Serves the client API on `socket`, relaying every RPC over `upstream`'s connection, until
/// `shutdown` fires or the master has been idle for [`MasterOptions::idle_exit`]; then lets open
/// RPCs finish for up to [`STOP_GRACE`] and ends the rest. Removes the socket file when it stops.
pub async fn serve_master(
    upstream: Client,
    socket: ControlListener,
    opts: MasterOptions,
    shutdown: CancellationToken,
) -> Result<(), ClientError> {
    let ControlListener {
        listener,
        path,
        identity: ours,
    } = socket;
    let activity = Arc::new(Activity::default());
    let (conns, incoming) = mpsc::channel::<io::Result<Counted>>(16);
    let stop = shutdown.child_token();
    let acceptor = tokio::spawn(accept_loop(
        listener,
        conns,
        Arc::clone(&activity),
        stop.clone(),
    ));
    let idle = opts
        .idle_exit
        .map(|after| tokio::spawn(idle_watch(Arc::clone(&activity), after, stop.clone())));

    let relay = Relay {
        upstream: upstream.inner.clone(),
        activity: Arc::clone(&activity),
    };
    let service = ToolsServer::new(relay)
        .max_decoding_message_size(MAX_MESSAGE_SIZE)
        .max_encoding_message_size(MAX_MESSAGE_SIZE);
    let server = toolsrv_tls::bounded_server(toolsrv_tls::STREAMS_PER_CONNECTION)
        .add_service(service)
        .add_service(crate::enroll::relay(upstream.channel.clone()))
        .serve_with_incoming_shutdown(
            ReceiverStream::new(incoming),
            stop.clone().cancelled_owned(),
        );
    tokio::pin!(server);
    // A graceful stop waits for every open RPC, and a relayed `watch` never ends by itself: after
    // the grace period the server is dropped, which ends the rest (and cancels their calls).
    let served = tokio::select! {
        served = &mut server => served,
        () = async {
            stop.cancelled().await;
            tokio::time::sleep(STOP_GRACE).await;
        } => {
            tracing::info!(grace = ?STOP_GRACE, "control socket: ending the RPCs still open");
            Ok(())
        }
    };
    stop.cancel();
    acceptor.abort();
    if let Some(idle) = idle {
        idle.abort();
    }
    // Someone may have replaced the socket since (a new master after ours was deleted): only
    // remove the file we bound.
    if ours.is_some() && file_identity(&path) == ours {
        let _ = std::fs::remove_file(&path);
    }
    served.map_err(|e| ClientError::Control(format!("serving {}: {e}", path.display())))
}

/// Device, inode and, where the file system records it, creation time (a replacement may reuse
/// the inode number; a `chmod` changes the change time, so that one would not do).
type FileIdentity = (u64, u64, Option<std::time::SystemTime>);

/// Which file is at `path`, to tell our socket from a replacement.
fn file_identity(path: &Path) -> Option<FileIdentity> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.created().ok()))
}

/// Accepts connections, refusing processes of other users, until `stop`.
async fn accept_loop(
    listener: UnixListener,
    conns: mpsc::Sender<io::Result<Counted>>,
    activity: Arc<Activity>,
    stop: CancellationToken,
) {
    let own_uid = nix::unistd::geteuid().as_raw();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: say so and give the system a moment.
                tracing::warn!(error = %e, "control socket: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        match stream.peer_cred() {
            Ok(cred) if cred.uid() == own_uid || cred.uid() == 0 => {}
            Ok(cred) => {
                tracing::warn!(
                    uid = cred.uid(),
                    pid = ?cred.pid(),
                    "control socket: refused a process of another user"
                );
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "control socket: cannot read the peer's credentials");
                continue;
            }
        }
        let counted = Counted::new(stream, Arc::clone(&activity));
        if conns.send(Ok(counted)).await.is_err() {
            return;
        }
    }
}

/// Fires `stop` once nothing has been connected or in flight for `after`.
async fn idle_watch(activity: Arc<Activity>, after: Duration, stop: CancellationToken) {
    loop {
        // While busy, look again later: the end of the last activity moves the deadline.
        let wake = if activity.busy() {
            Instant::now() + after
        } else {
            activity.last_change() + after
        };
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(wake) => {}
        }
        if !activity.busy() && activity.last_change().elapsed() >= after {
            tracing::info!(after = ?after, "control socket: idle, exiting");
            stop.cancel();
            return;
        }
    }
}

/// Open connections and RPCs in flight, and when either last changed.
#[derive(Debug)]
struct Activity {
    open: AtomicUsize,
    last_change: std::sync::Mutex<Instant>,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            open: AtomicUsize::new(0),
            last_change: std::sync::Mutex::new(Instant::now()),
        }
    }
}

impl Activity {
    fn busy(&self) -> bool {
        self.open.load(Ordering::SeqCst) > 0
    }

    fn last_change(&self) -> Instant {
        *self
            .last_change
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn enter(self: &Arc<Self>) -> Busy {
        self.open.fetch_add(1, Ordering::SeqCst);
        self.touch();
        Busy(Arc::clone(self))
    }

    fn touch(&self) {
        *self
            .last_change
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
    }
}

/// Counts as activity while alive.
#[derive(Debug)]
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
        self.0.touch();
    }
}

/// A client connection that counts as activity while open.
struct Counted {
    stream: UnixStream,
    _busy: Busy,
}

impl Counted {
    fn new(stream: UnixStream, activity: Arc<Activity>) -> Self {
        Self {
            stream,
            _busy: activity.enter(),
        }
    }
}

impl tonic::transport::server::Connected for Counted {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The client API, each RPC passed on unchanged over the master's connection. A client that goes
/// away drops the upstream stream, which cancels the call at the coordinator as a direct client would.
struct Relay {
    upstream: ToolsClient<tonic::transport::Channel>,
    activity: Arc<Activity>,
}

impl Relay {
    /// Passes a server stream on, counting as activity until it ends or the client drops it.
    fn relay<T: Send + 'static>(&self, stream: tonic::Streaming<T>) -> Response<BoxStream<T>> {
        let busy = self.activity.enter();
        Response::new(Box::pin(stream.map(move |item| {
            let _busy = &busy;
            item
        })))
    }
}

#[tonic::async_trait]
impl Tools for Relay {
    type CallStream = BoxStream<CallEvent>;
    type FanOutStream = BoxStream<FanOutEvent>;
    type WatchCatalogStream = BoxStream<CatalogEvent>;
    type WatchSessionStream = BoxStream<SessionState>;

    async fn list_hosts(
        &self,
        req: Request<ListHostsRequest>,
    ) -> Result<Response<ListHostsResponse>, Status> {
        self.upstream.clone().list_hosts(req.into_inner()).await
    }

    async fn list_tools(
        &self,
        req: Request<ListToolsRequest>,
    ) -> Result<Response<ListToolsResponse>, Status> {
        self.upstream.clone().list_tools(req.into_inner()).await
    }

    async fn describe_tool(
        &self,
        req: Request<DescribeToolRequest>,
    ) -> Result<Response<ToolDefinition>, Status> {
        self.upstream.clone().describe_tool(req.into_inner()).await
    }

    async fn call(&self, req: Request<CallRequest>) -> Result<Response<Self::CallStream>, Status> {
        let stream = self.upstream.clone().call(req.into_inner()).await?;
        Ok(self.relay(stream.into_inner()))
    }

    async fn fan_out(
        &self,
        req: Request<FanOutRequest>,
    ) -> Result<Response<Self::FanOutStream>, Status> {
        let stream = self.upstream.clone().fan_out(req.into_inner()).await?;
        Ok(self.relay(stream.into_inner()))
    }

    async fn watch_catalog(
        &self,
        req: Request<WatchCatalogRequest>,
    ) -> Result<Response<Self::WatchCatalogStream>, Status> {
        let stream = self
            .upstream
            .clone()
            .watch_catalog(req.into_inner())
            .await?;
        Ok(self.relay(stream.into_inner()))
    }

    async fn list_approvals(
        &self,
        req: Request<ListApprovalsRequest>,
    ) -> Result<Response<ListApprovalsResponse>, Status> {
        self.upstream.clone().list_approvals(req.into_inner()).await
    }

    async fn approve(
        &self,
        req: Request<ApproveRequest>,
    ) -> Result<Response<ApproveResponse>, Status> {
        self.upstream.clone().approve(req.into_inner()).await
    }

    async fn revoke(
        &self,
        req: Request<toolsrv_proto::v1::RevokeRequest>,
    ) -> Result<Response<toolsrv_proto::v1::RevokeResponse>, Status> {
        self.upstream.clone().revoke(req.into_inner()).await
    }

    async fn unrevoke(
        &self,
        req: Request<toolsrv_proto::v1::UnrevokeRequest>,
    ) -> Result<Response<toolsrv_proto::v1::UnrevokeResponse>, Status> {
        self.upstream.clone().unrevoke(req.into_inner()).await
    }

    async fn list_revocations(
        &self,
        req: Request<toolsrv_proto::v1::ListRevocationsRequest>,
    ) -> Result<Response<toolsrv_proto::v1::ListRevocationsResponse>, Status> {
        self.upstream
            .clone()
            .list_revocations(req.into_inner())
            .await
    }

    async fn find_tools(
        &self,
        req: Request<FindToolsRequest>,
    ) -> Result<Response<FindToolsResponse>, Status> {
        self.upstream.clone().find_tools(req.into_inner()).await
    }

    async fn open_session(
        &self,
        req: Request<OpenSessionRequest>,
    ) -> Result<Response<SessionState>, Status> {
        self.upstream.clone().open_session(req.into_inner()).await
    }

    async fn load_tool(
        &self,
        req: Request<LoadToolRequest>,
    ) -> Result<Response<SessionState>, Status> {
        self.upstream.clone().load_tool(req.into_inner()).await
    }

    async fn unload_tool(
        &self,
        req: Request<UnloadToolRequest>,
    ) -> Result<Response<SessionState>, Status> {
        self.upstream.clone().unload_tool(req.into_inner()).await
    }

    async fn get_session(
        &self,
        req: Request<GetSessionRequest>,
    ) -> Result<Response<SessionState>, Status> {
        self.upstream.clone().get_session(req.into_inner()).await
    }

    async fn watch_session(
        &self,
        req: Request<GetSessionRequest>,
    ) -> Result<Response<Self::WatchSessionStream>, Status> {
        let stream = self
            .upstream
            .clone()
            .watch_session(req.into_inner())
            .await?;
        Ok(self.relay(stream.into_inner()))
    }

    async fn close_session(
        &self,
        req: Request<GetSessionRequest>,
    ) -> Result<Response<CloseSessionResponse>, Status> {
        self.upstream.clone().close_session(req.into_inner()).await
    }

    async fn list_sessions(
        &self,
        req: Request<ListSessionsRequest>,
    ) -> Result<Response<ListSessionsResponse>, Status> {
        self.upstream.clone().list_sessions(req.into_inner()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process's umask, read while no bind has it changed.
    fn process_umask() -> String {
        let _turn = UMASK_TURN.lock().unwrap_or_else(|p| p.into_inner());
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("Umask:"))
            .unwrap()
            .trim()
            .to_string()
    }

    #[test]
    fn sockets_bound_at_once_are_each_private_and_leave_the_umask_as_it_was() {
        use std::os::unix::fs::PermissionsExt;
        let before = process_umask();
        let dir = tempfile::tempdir().unwrap();
        let start = std::sync::Arc::new(std::sync::Barrier::new(8));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let dir = dir.path().to_path_buf();
                let start = std::sync::Arc::clone(&start);
                std::thread::spawn(move || {
                    start.wait();
                    (0..50)
                        .map(|i| {
                            let path = dir.join(format!("{t}-{i}.sock"));
                            drop(bind_private(&path).unwrap());
                            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for thread in threads {
            for mode in thread.join().unwrap() {
                assert_eq!(mode, 0o600, "{mode:o}");
            }
        }
        assert_eq!(process_umask(), before);
    }

    #[tokio::test]
    async fn bind_replaces_a_stale_socket_and_refuses_what_is_not_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctl.sock");

        // A master that died leaves its socket file behind: nobody accepts there any more.
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let listener = bind(&path).await.unwrap();
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&path).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);

        // A live one is left alone.
        let err = bind(&path).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert!(err.to_string().contains("another master"), "{err}");
        drop(listener);

        // Anything else at the path is never deleted.
        let file = dir.path().join("notes.txt");
        std::fs::write(&file, "keep me").unwrap();
        let err = bind(&file).await.unwrap_err();
        assert!(err.to_string().contains("is not a socket"), "{err}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
    }

    #[tokio::test]
    async fn bind_never_follows_a_symlink_at_the_path() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep me").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
        let path = dir.path().join("ctl.sock");
        std::os::unix::fs::symlink(&victim, &path).unwrap();

        let err = bind(&path).await.unwrap_err();
        assert!(err.to_string().contains("is not a socket"), "{err}");
        assert!(std::fs::symlink_metadata(&path).unwrap().is_symlink());
        let mode = std::fs::metadata(&victim).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");
    }

    /// A socket swapped for a symlink right after bind(2) must not get the target's mode changed:
    /// the file is created private, nothing is changed by path afterwards. The swap races the
    /// bind, so this tries many times; a master that changes the mode by path loses some of them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nothing_is_changed_by_path_after_bind() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
        let path = dir.path().join("ctl.sock");
        let staged = dir.path().join("staged-link");

        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swaps = Arc::new(AtomicUsize::new(0));
        let swapper = {
            let (path, staged, victim) = (path.clone(), staged.clone(), victim.clone());
            let (stop, swaps) = (Arc::clone(&stop), Arc::clone(&swaps));
            std::thread::spawn(move || {
                use std::os::unix::fs::FileTypeExt;
                while !stop.load(Ordering::Relaxed) {
                    let socket_there =
                        std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_socket());
                    if socket_there {
                        let _ = std::fs::remove_file(&staged);
                        std::os::unix::fs::symlink(&victim, &staged).unwrap();
                        if std::fs::rename(&staged, &path).is_ok() {
                            swaps.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut bound = 0;
        while (bound < 2000 || swaps.load(Ordering::Relaxed) < 30) && Instant::now() < deadline {
            let _ = std::fs::remove_file(&path);
            if let Ok(listener) = bind(&path).await {
                bound += 1;
                let mode = std::fs::metadata(&victim).unwrap().permissions().mode();
                assert_eq!(
                    mode & 0o777,
                    0o644,
                    "bind {bound} changed the symlink's target"
                );
                drop(listener);
            }
        }
        stop.store(true, Ordering::Relaxed);
        swapper.join().unwrap();
        let swapped = swaps.load(Ordering::Relaxed);
        assert!(bound > 0 && swapped > 0, "bound {bound}, swapped {swapped}");
    }

    #[tokio::test]
    async fn a_stopping_master_removes_its_socket_but_not_a_replacement() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctl.sock");
        // Nothing is relayed here, so the upstream is never dialled.
        let upstream =
            Client::from_channel(Endpoint::from_static("http://127.0.0.1:1").connect_lazy());
        let opts = MasterOptions::default();

        let shutdown = CancellationToken::new();
        let socket = bind(&path).await.unwrap();
        let master = tokio::spawn(serve_master(
            upstream.clone(),
            socket,
            opts.clone(),
            shutdown.clone(),
        ));
        assert!(path.exists());
        shutdown.cancel();
        master.await.unwrap().unwrap();
        assert!(!path.exists(), "its own socket is removed");

        let shutdown = CancellationToken::new();
        let socket = bind(&path).await.unwrap();
        let master = tokio::spawn(serve_master(upstream, socket, opts, shutdown.clone()));
        std::fs::remove_file(&path).unwrap();
        let _replacement = UnixListener::bind(&path).unwrap();
        shutdown.cancel();
        master.await.unwrap().unwrap();
        assert!(path.exists(), "another process's socket is left alone");
    }

    #[tokio::test]
    async fn a_missing_master_is_a_control_error_naming_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nobody.sock");
        let err = connect(&path).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_idle_watch_waits_for_the_last_activity_to_end() {
        let activity = Arc::new(Activity::default());
        let stop = CancellationToken::new();
        let busy = activity.enter();
        let watch = tokio::spawn(idle_watch(
            Arc::clone(&activity),
            Duration::from_secs(10),
            stop.clone(),
        ));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!stop.is_cancelled(), "busy: never idle");
        drop(busy);
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(!stop.is_cancelled(), "idle for 9 s of 10");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(stop.is_cancelled(), "idle for 11 s");
        watch.await.unwrap();
    }
}
