//! Client side: tonic channels whose connections go through our own rustls
//! config (so the server's role is checked), not tonic's TLS.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tonic::codegen::http::Uri;
use tonic::transport::{Channel, Endpoint};

use crate::error::chain;
use crate::{Role, TlsError, TlsFiles, client_config};

/// How long TCP connect plus TLS handshake may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 ping interval, so a dead coordinator is noticed within seconds.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// How long to wait for a ping's answer.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects now to `url` (`https://host:port`) and fails if the server
/// cannot be reached or does not pass `config`'s checks.
pub async fn connect(url: &str, config: Arc<ClientConfig>) -> Result<Channel, TlsError> {
    let (endpoint, connector) = prepare(url, Source::Fixed(config))?;
    dial(url, endpoint, connector).await
}

/// Like [`connect`], with the configuration read from `files` (the peer must have role
/// `expect`), and read again for every later connection the channel makes, so that a
/// long-lived channel picks up renewed certificates when it reconnects.
pub async fn connect_reloading(
    url: &str,
    files: &TlsFiles,
    expect: Role,
) -> Result<Channel, TlsError> {
    reloading(url, files, expect, None).await
}

/// [`connect_reloading`] for a client waiting on answers: a request whose response has not
/// begun within `answer_within` fails (`CANCELLED`, "Timeout expired") instead of waiting for
/// as long as the connection lives. A streaming response's messages are not bounded, only the
/// wait for it to begin; a coordinator that is stuck, not gone, still answers HTTP/2 pings.
pub async fn connect_reloading_within(
    url: &str,
    files: &TlsFiles,
    expect: Role,
    answer_within: Duration,
) -> Result<Channel, TlsError> {
    reloading(url, files, expect, Some(answer_within)).await
}

/// [`connect_reloading_within`] for servers that stand in for each other (coordinator
/// replicas): each connection the channel makes, the first and every reconnection, goes to the
/// first of `urls` that answers, trying them in turn from the one that answered last. A channel
/// whose server went away reaches another on its next request, so its clones (and whatever
/// holds them) carry on there.
pub async fn connect_replicas_within(
    urls: &[&str],
    files: &TlsFiles,
    expect: Role,
    answer_within: Duration,
) -> Result<Channel, TlsError> {
    let (endpoint, connector) = prepare_replicas(urls, reloaded(files, expect)?)?;
    dial(&urls.join(","), endpoint.timeout(answer_within), connector).await
}

fn reloaded(files: &TlsFiles, expect: Role) -> Result<Source, TlsError> {
    let first = client_config(files, expect)?;
    Ok(Source::Files {
        files: files.clone(),
        expect,
        first: Arc::new(Mutex::new(Some(first))),
    })
}

async fn reloading(
    url: &str,
    files: &TlsFiles,
    expect: Role,
    answer_within: Option<Duration>,
) -> Result<Channel, TlsError> {
    let (mut endpoint, connector) = prepare(url, reloaded(files, expect)?)?;
    if let Some(within) = answer_within {
        endpoint = endpoint.timeout(within);
    }
    dial(url, endpoint, connector).await
}

/// A channel to `url` that connects on first use and reconnects as needed.
pub fn lazy_channel(url: &str, config: Arc<ClientConfig>) -> Result<Channel, TlsError> {
    let (endpoint, connector) = prepare(url, Source::Fixed(config))?;
    Ok(endpoint.connect_with_connector_lazy(connector))
}

async fn dial(url: &str, endpoint: Endpoint, connector: TlsConnector) -> Result<Channel, TlsError> {
    endpoint
        .connect_with_connector(connector)
        .await
        .map_err(|e| {
            let untrusted =
                std::iter::successors(Some(&e as &(dyn std::error::Error + 'static)), |e| {
                    e.source()
                })
                .find_map(|e| {
                    // An io::Error's source is its payload's source, not the payload itself.
                    e.downcast_ref::<PeerNotTrusted>().or_else(|| {
                        e.downcast_ref::<io::Error>()?
                            .get_ref()?
                            .downcast_ref::<PeerNotTrusted>()
                    })
                });
            match untrusted {
                Some(why) => TlsError::PeerNotTrusted(format!("cannot connect to {url}: {why}")),
                None => TlsError::Connect(format!("cannot connect to {url}: {}", chain(&e))),
            }
        })
}

/// A handshake that failed on the peer's certificate, in words that say which side's files to
/// change: rustls's own (`invalid peer certificate: BadSignature`) name neither the CA nor
/// what to do.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct PeerNotTrusted(String);

/// [`PeerNotTrusted`] for a handshake with `host:port` that failed with `e`, when `e` is about
/// the peer's certificate.
fn peer_not_trusted(host: &str, port: u16, e: &io::Error) -> Option<PeerNotTrusted> {
    use rustls::CertificateError as C;
    let rustls::Error::InvalidCertificate(why) = e.get_ref()?.downcast_ref::<rustls::Error>()?
    else {
        return None;
    };
    let what = match why {
        C::BadSignature | C::UnknownIssuer => "was not issued by a CA this side trusts (its --ca \
            file, TOOLSRV_CA): point that at the CA that issued the server's certificate, or \
            issue the server's certificate from this CA"
            .to_string(),
        C::NotValidForName | C::NotValidForNameContext { .. } => format!(
            "does not name `{host}`: connect by a name or address it carries, or issue it with \
             this one (`toolsrv pki init DIR --coordinator-names {host}`)"
        ),
        C::Expired | C::ExpiredContext { .. } => {
            "has expired: renew it (or check this machine's clock)".to_string()
        }
        C::NotValidYet | C::NotValidYetContext { .. } => {
            "is not valid yet: check the clocks of both machines".to_string()
        }
        C::Revoked => "is revoked".to_string(),
        _ => return None,
    };
    Some(PeerNotTrusted(format!(
        "TLS handshake with {host}:{port}: the server's certificate {what} (rustls: {why:?})"
    )))
}

/// Where a connection's TLS configuration comes from.
#[derive(Debug, Clone)]
enum Source {
    /// One configuration for every connection.
    Fixed(Arc<ClientConfig>),
    /// Read from the files for each connection; `first` is the one already read to check them.
    Files {
        files: TlsFiles,
        expect: Role,
        first: Arc<Mutex<Option<Arc<ClientConfig>>>>,
    },
}

impl Source {
    fn config(&self) -> io::Result<Arc<ClientConfig>> {
        match self {
            Source::Fixed(config) => Ok(Arc::clone(config)),
            Source::Files {
                files,
                expect,
                first,
            } => {
                let seeded = first
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take();
                match seeded {
                    Some(config) => Ok(config),
                    None => client_config(files, *expect)
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string())),
                }
            }
        }
    }
}

fn prepare(url: &str, config: Source) -> Result<(Endpoint, TlsConnector), TlsError> {
    prepare_replicas(&[url], config)
}

/// The endpoint (the first URL's: tonic's requests name it, the connector picks the server)
/// and a connector over every one of `urls`.
fn prepare_replicas(urls: &[&str], config: Source) -> Result<(Endpoint, TlsConnector), TlsError> {
    let mut targets = Vec::with_capacity(urls.len());
    let mut first = None;
    for url in urls {
        let (uri, target) = target(url)?;
        first.get_or_insert(uri);
        targets.push(target);
    }
    let Some(uri) = first else {
        return Err(TlsError::InvalidName {
            what: "URL",
            value: String::new(),
            msg: "no URL given".into(),
        });
    };
    let endpoint = Endpoint::from(uri)
        .connect_timeout(CONNECT_TIMEOUT.saturating_mul(u32::try_from(urls.len()).unwrap_or(1)))
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .tcp_nodelay(true);
    let connector = TlsConnector {
        config,
        targets: targets.into(),
        current: Arc::default(),
    };
    Ok((endpoint, connector))
}

/// One server of a connector: `url`'s host, port and the name its certificate must carry, with
/// the URI tonic is given (plain http: the TLS is the connector's).
fn target(url: &str) -> Result<(Uri, Target), TlsError> {
    let bad = |msg: &str| TlsError::InvalidName {
        what: "URL",
        value: url.to_string(),
        msg: msg.to_string(),
    };
    let rest = url
        .strip_prefix("https://")
        .ok_or_else(|| bad("expected https://host:port"))?;
    // Plain http for tonic: the TLS is done by our connector.
    let uri: Uri = format!("http://{rest}")
        .parse()
        .map_err(|e| bad(&format!("not a valid URL: {e}")))?;
    let host = uri
        .host()
        .ok_or_else(|| bad("no host: expected https://host:port"))?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    // `http::Uri` takes `:99999`, `:0` and `:` and then has no port, or port 0: not 443.
    let authority = uri.authority().map_or("", |a| a.as_str());
    let given = match authority.rsplit_once(':') {
        Some((_, port)) if !authority.ends_with(']') => Some(port),
        _ => None,
    };
    let port = match given {
        None => 443,
        Some(port) => match port.parse::<u16>() {
            Ok(n) if n != 0 => n,
            _ => {
                return Err(bad(&format!(
                    "`{port}` is not a port number (1 to 65535): expected https://host:port"
                )));
            }
        },
    };
    let server_name = ServerName::try_from(host.clone()).map_err(|e| {
        bad(&format!(
            "host {host:?} is not a DNS name or IP address: {e}"
        ))
    })?;
    let target = Target {
        host,
        port,
        server_name,
    };
    Ok((uri, target))
}

/// How long a TCP connect to one of a name's several addresses may take before the next is
/// tried.
const ADDRESS_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a TCP connect to each of `count` addresses may take: [`ADDRESS_TIMEOUT`] when there
/// are several (or [`CONNECT_TIMEOUT`] shared among them, if longer), and a lone address all of
/// [`CONNECT_TIMEOUT`] but half a second, so that the dial's own bound does not cut our message
/// off. Linux sends a SYN again after 1 s and 3 s: 2 s left room for one retry only, and on a
/// link losing 30 % of its packets 2 of 8 calls then failed to connect; a lone address gets two.
fn per_address(count: usize) -> Duration {
    match u32::try_from(count) {
        Ok(0 | 1) => CONNECT_TIMEOUT.saturating_sub(Duration::from_millis(500)),
        Ok(n) => ADDRESS_TIMEOUT.max(CONNECT_TIMEOUT / n),
        Err(_) => ADDRESS_TIMEOUT,
    }
}

/// Connects to the first of `addrs` that answers, trying them in turn from `start` (so that
/// clients given a name with several addresses spread over them, each starting elsewhere),
/// each within `per_address` (so that an address that swallows packets costs that long, not
/// the whole dial). The error is the last address's, naming it.
async fn connect_any(
    addrs: &[SocketAddr],
    start: usize,
    per_address: Duration,
) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the name has no address");
    for i in 0..addrs.len() {
        let addr = addrs[(start + i) % addrs.len()];
        match tokio::time::timeout(per_address, TcpStream::connect(addr)).await {
            Ok(Ok(tcp)) => return Ok(tcp),
            Ok(Err(e)) => last = io::Error::new(e.kind(), format!("{addr}: {e}")),
            Err(_) => {
                last = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{addr}: no answer within {per_address:?}"),
                );
            }
        }
    }
    Err(last)
}

/// A tower service that dials TCP and runs the rustls handshake, with the servers given at
/// construction (tonic passes the first one's URI anyway): the one that answered last first,
/// then the others in turn.
#[derive(Debug, Clone)]
struct TlsConnector {
    config: Source,
    targets: Arc<[Target]>,
    /// The target that answered last.
    current: Arc<AtomicUsize>,
}

/// One server a [`TlsConnector`] may dial.
#[derive(Debug, Clone)]
struct Target {
    host: String,
    port: u16,
    server_name: ServerName<'static>,
}

impl Target {
    /// TCP, then TLS with `config`; each failure says which step failed, for which address.
    async fn dial(
        &self,
        config: Arc<ClientConfig>,
    ) -> Result<TokioIo<TlsStream<TcpStream>>, io::Error> {
        let (host, port) = (self.host.as_str(), self.port);
        let failed = |what: &'static str| {
            move |e: io::Error| io::Error::new(e.kind(), format!("{what} {host}:{port}: {e}"))
        };
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(failed("cannot resolve"))?
            .collect();
        let start = fastrand::usize(..addrs.len().max(1));
        let tcp = connect_any(&addrs, start, per_address(addrs.len()))
            .await
            .map_err(failed("TCP connect to"))?;
        tcp.set_nodelay(true)?;
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|e| match peer_not_trusted(host, port, &e) {
                Some(why) => io::Error::new(e.kind(), why),
                None => failed("TLS handshake with")(e),
            })?;
        Ok(TokioIo::new(tls))
    }
}

type ConnectFuture =
    Pin<Box<dyn Future<Output = Result<TokioIo<TlsStream<TcpStream>>, io::Error>> + Send>>;

impl tower::Service<Uri> for TlsConnector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let config = this.config.config()?;
            let count = this.targets.len();
            let first = this.current.load(Ordering::Relaxed);
            let mut failures = Vec::new();
            for i in 0..count {
                let at = (first + i) % count;
                match this.targets[at].dial(Arc::clone(&config)).await {
                    Ok(io) => {
                        this.current.store(at, Ordering::Relaxed);
                        return Ok(io);
                    }
                    Err(e) => failures.push(e),
                }
            }
            match failures.len() {
                0 => Err(io::Error::new(io::ErrorKind::NotFound, "no server to dial")),
                1 => Err(failures.remove(0)),
                _ => Err(io::Error::new(
                    failures[0].kind(),
                    failures
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("; "),
                )),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A loopback port nothing listens on (bound, then closed).
    fn refused() -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }

    #[tokio::test]
    async fn each_address_is_tried_in_turn_from_the_start_given() {
        let a = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let b = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (a, b) = (a.local_addr().unwrap(), b.local_addr().unwrap());
        let wait = Duration::from_secs(2);
        // Two live addresses: the start decides which, so clients starting apart spread.
        for (start, want) in [(0, a), (1, b), (2, a)] {
            let tcp = connect_any(&[a, b], start, wait).await.unwrap();
            assert_eq!(tcp.peer_addr().unwrap(), want, "start {start}");
        }
        // A refused address is passed over, wherever it is.
        let dead = refused();
        for start in 0..2 {
            let tcp = connect_any(&[dead, a], start, wait).await.unwrap();
            assert_eq!(tcp.peer_addr().unwrap(), a);
        }
        // None answers: the error names the last one tried.
        let (d1, d2) = (refused(), refused());
        let err = connect_any(&[d1, d2], 0, wait).await.unwrap_err();
        assert!(err.to_string().contains(&d2.to_string()), "{err}");
        let err = connect_any(&[], 0, wait).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    /// A listener whose accept queue is full, not drained: Linux drops the SYNs of further
    /// connections, so connecting to it hangs, as to a host that swallows packets, until the
    /// queue is drained. Returns it with the connections that filled the queue.
    async fn full_listener() -> (tokio::net::TcpListener, Vec<TcpStream>) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let full = socket.listen(0).unwrap();
        let addr = full.local_addr().unwrap();
        let mut held = Vec::new();
        for _ in 0..16 {
            match tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(addr)).await {
                Ok(Ok(tcp)) => held.push(tcp),
                Ok(Err(e)) => panic!("connecting to the full listener: {e}"),
                Err(_) => return (full, held),
            }
        }
        panic!("the listener's queue never filled ({} held)", held.len());
    }

    #[tokio::test]
    async fn an_address_that_does_not_answer_costs_its_bound_not_the_dial() {
        let (full, _held) = full_listener().await;
        let silent = full.local_addr().unwrap();
        let live = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let live = live.local_addr().unwrap();
        let per_address = Duration::from_millis(300);
        let started = std::time::Instant::now();
        let tcp = connect_any(&[silent, live], 0, per_address).await.unwrap();
        assert_eq!(tcp.peer_addr().unwrap(), live);
        assert!(started.elapsed() >= per_address, "{:?}", started.elapsed());
        let err = connect_any(&[silent], 0, per_address).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("no answer within"), "{err}");
    }

    #[test]
    fn a_port_out_of_range_is_refused_not_taken_for_443() {
        for (url, port) in [
            ("https://127.0.0.1:8443", 8443),
            ("https://example.org", 443),
            ("https://[::1]:7443", 7443),
            ("https://[::1]", 443),
        ] {
            assert_eq!(target(url).unwrap().1.port, port, "{url}");
        }
        for url in [
            "https://127.0.0.1:99999",
            "https://127.0.0.1:65536",
            "https://127.0.0.1:0",
            "https://127.0.0.1:",
            "https://[::1]:70000",
        ] {
            let err = target(url).unwrap_err().to_string();
            assert!(err.contains("is not a port number"), "{url}: {err}");
        }
    }

    #[test]
    fn a_lone_address_has_time_for_two_syn_retries_and_several_share_the_dial() {
        // Linux sends the SYN again 1 s and 3 s after the first.
        assert!(per_address(1) > Duration::from_secs(3));
        assert!(per_address(1) < CONNECT_TIMEOUT);
        assert_eq!(per_address(0), per_address(1));
        assert_eq!(per_address(2), CONNECT_TIMEOUT / 2);
        assert_eq!(per_address(8), ADDRESS_TIMEOUT);
        assert_eq!(per_address(usize::MAX), ADDRESS_TIMEOUT);
    }

    #[tokio::test]
    async fn a_lone_address_whose_first_two_syns_are_lost_is_still_reached() {
        // The full listener drops SYNs until its queue is drained, at 1.5 s: the SYN sent
        // again at 3 s gets through, where a 2 s bound gave up first.
        let (full, held) = full_listener().await;
        let addr = full.local_addr().unwrap();
        let drain = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let mut accepted = Vec::new();
            while let Ok(Ok((tcp, _))) =
                tokio::time::timeout(Duration::from_secs(4), full.accept()).await
            {
                accepted.push(tcp);
            }
            accepted.len()
        });
        let started = std::time::Instant::now();
        let tcp = connect_any(&[addr], 0, per_address(1)).await;
        let took = started.elapsed();
        assert!(tcp.is_ok(), "{tcp:?} after {took:?}");
        assert!(took >= Duration::from_millis(1500), "{took:?}");
        assert!(drain.await.unwrap() > held.len());
    }
}
