//! Helpers shared by the integration tests: a PKI in a temp dir, an mTLS
//! health server that records who called, and raw TLS handshakes.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::{ClientConfig, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use toolsrv_tls::{AcceptOptions, Identity, Role, TlsFiles, client_config, incoming_with, peer_of};

/// Every wait in these tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(20);

/// A PKI with agent `web-1` and client `alice`.
pub fn pki(dir: &Path) {
    toolsrv_testkit::write_pki(dir, &["web-1"], &["alice"]).unwrap();
}

pub fn files(dir: &Path, id: &Identity) -> TlsFiles {
    TlsFiles::in_dir(dir, id)
}

pub fn alice() -> Identity {
    Identity::Client("alice".into())
}

/// A running health server; dropping it shuts the server down.
pub struct Server {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Identity>>>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Server {
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(WAIT, task).await.unwrap().unwrap();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Serves tonic-health through `incoming`, with an interceptor that records
/// the caller's identity and refuses calls without one.
pub async fn serve(creds: watch::Receiver<Arc<ServerConfig>>) -> Server {
    serve_on("127.0.0.1:0", creds).await
}

/// [`serve`] on another loopback address.
pub async fn serve_on(bind: &str, creds: watch::Receiver<Arc<ServerConfig>>) -> Server {
    serve_with(bind, creds, AcceptOptions::default()).await
}

/// [`serve_on`] with other accept timeouts.
pub async fn serve_with(
    bind: &str,
    creds: watch::Receiver<Arc<ServerConfig>>,
    timeouts: AcceptOptions,
) -> Server {
    let listener = TcpListener::bind(bind).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .layer(tonic::service::InterceptorLayer::new(
                move |req: tonic::Request<()>| match peer_of(&req) {
                    Some(peer) => {
                        record.lock().unwrap().push(peer.identity.clone());
                        Ok(req)
                    }
                    None => Err(tonic::Status::unauthenticated("no peer identity")),
                },
            ))
            .add_service(health)
            .serve_with_incoming_shutdown(incoming_with(listener, creds, timeouts), async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    Server {
        addr,
        seen,
        stop: Some(stop),
        task: Some(task),
    }
}

/// Connects with `config` and calls Health/Check; `Err` if either fails.
pub async fn check(url: &str, config: Arc<ClientConfig>) -> Result<(), String> {
    let call = async {
        let channel = toolsrv_tls::connect(url, config)
            .await
            .map_err(|e| e.to_string())?;
        HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    tokio::time::timeout(WAIT, call)
        .await
        .expect("health check timed out")
}

pub fn client_cfg(dir: &Path, id: &Identity) -> Arc<ClientConfig> {
    client_config(&files(dir, id), Role::Coordinator).unwrap()
}

pub fn certs(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
}

pub fn key(path: &Path) -> PrivateKeyDer<'static> {
    PrivateKeyDer::from_pem_file(path).unwrap()
}

fn roots(ca: &Path) -> Arc<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(ca) {
        roots.add(c).unwrap();
    }
    Arc::new(roots)
}

/// A plain webpki client config, bypassing our own checks, so tests can
/// present credentials `client_config` would refuse.
pub fn raw_client_config(ca: &Path, client: Option<(&Path, &Path)>) -> Arc<ClientConfig> {
    let builder = ClientConfig::builder_with_provider(toolsrv_tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots(ca));
    let mut cfg = match client {
        Some((cert, k)) => builder.with_client_auth_cert(certs(cert), key(k)).unwrap(),
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(cfg)
}

/// A server config from any certificate, bypassing `server_config`'s
/// coordinator check.
pub fn raw_server_config(ca: &Path, cert: &Path, k: &Path) -> Arc<ServerConfig> {
    let provider = toolsrv_tls::provider();
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(ca), provider.clone())
            .build()
            .unwrap();
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(cert), key(k))
        .unwrap();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(cfg)
}

/// Runs one TLS handshake against `addr` and returns the server's leaf.
pub async fn server_leaf(addr: SocketAddr, config: Arc<ClientConfig>) -> CertificateDer<'static> {
    let hs = async {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = ServerName::IpAddress(addr.ip().into());
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .unwrap();
        tls.get_ref().1.peer_certificates().unwrap()[0].clone()
    };
    tokio::time::timeout(WAIT, hs).await.unwrap()
}

/// Signs a certificate with the CA of `dir` outside `pki`'s rules (any
/// SANs, any EKUs) and writes `<stem>.pem` and `<stem>-key.pem`.
pub fn sign_custom(
    dir: &Path,
    stem: &str,
    sans: Vec<rcgen::SanType>,
    ekus: Vec<rcgen::ExtendedKeyUsagePurpose>,
) -> TlsFiles {
    toolsrv_testkit::sign_with_ca(dir, stem, sans, ekus).unwrap()
}

pub fn uri_san(id: &Identity) -> rcgen::SanType {
    toolsrv_testkit::uri_san(id).unwrap()
}
