//! A stand-in for the one Kubernetes API endpoint the coordinator uses: `POST
//! /apis/authentication.k8s.io/v1/tokenreviews`, over HTTPS on a loopback port, answering as
//! the API server does for projected service account tokens (audiences intersected with the
//! request's; unauthenticated when none is left; the pod's node and name in `user.extra`).
//! No cluster can run on a test machine; the shapes here follow the `authentication.k8s.io/v1`
//! API reference.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use crate::error::{Result, TestkitError};

/// The bearer token the coordinator must present (written to [`FakeKubeApi::token_file`]).
pub const COORDINATOR_TOKEN: &str = "coordinator-service-account-token";

/// What the API knows about one service account token.
#[derive(Debug, Clone)]
pub struct ServiceAccountToken {
    /// `namespace/name`.
    pub service_account: String,
    /// The audiences the token was issued for.
    pub audiences: Vec<String>,
    /// The node of the pod it is bound to; `None`: not bound to a pod.
    pub node: Option<String>,
    pub pod: String,
    /// An expired token: reviewed as unauthenticated.
    pub expired: bool,
}

#[derive(Debug, Default)]
struct Shared {
    tokens: BTreeMap<String, ServiceAccountToken>,
    /// Every review request body received.
    reviews: Vec<Value>,
    /// Answer every request with this status instead (e.g. 500).
    fail_with: Option<u16>,
}

/// The stand-in API server; stops when dropped.
#[derive(Debug)]
pub struct FakeKubeApi {
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    /// The CA of its certificate.
    pub ca: PathBuf,
    /// A file holding [`COORDINATOR_TOKEN`].
    pub token_file: PathBuf,
    shared: Arc<Mutex<Shared>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeKubeApi {
    /// Starts it, writing its CA and the coordinator's token into `dir`.
    pub fn start(dir: &Path) -> Result<Self> {
        let failed = |reason: String| TestkitError::Certificate {
            stem: "kube-api".into(),
            reason,
        };
        let ca_key = rcgen::KeyPair::generate().map_err(|e| failed(e.to_string()))?;
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())
            .map_err(|e| failed(e.to_string()))?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "kubernetes");
        let ca_cert = ca_params
            .self_signed(&ca_key)
            .map_err(|e| failed(e.to_string()))?;
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let key = rcgen::KeyPair::generate().map_err(|e| failed(e.to_string()))?;
        let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .map_err(|e| failed(e.to_string()))?;
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(|e| failed(e.to_string()))?;
        let ca = dir.join("kube-ca.pem");
        let token_file = dir.join("kube-token");
        for (path, text) in [
            (&ca, ca_cert.pem()),
            (&token_file, format!("{COORDINATOR_TOKEN}\n")),
        ] {
            std::fs::write(path, text)
                .map_err(|e| TestkitError::io(format!("cannot write {}", path.display()), e))?;
        }
        let config = rustls::ServerConfig::builder_with_provider(toolsrv_tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| failed(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .map_err(|e| failed(e.to_string()))?;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .map_err(|e| TestkitError::io("cannot bind the Kubernetes API stand-in", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| TestkitError::io("no local address", e))?
            .port();
        listener
            .set_nonblocking(true)
            .map_err(|e| TestkitError::io("cannot set non-blocking", e))?;
        let shared = Arc::new(Mutex::new(Shared::default()));
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let serve_shared = shared.clone();
        let thread = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(serve(listener, Arc::new(config), serve_shared, stopped));
        });
        Ok(Self {
            url: format!("https://127.0.0.1:{port}"),
            ca,
            token_file,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Makes `token` known to the API.
    pub fn add_token(&self, token: &str, what: ServiceAccountToken) {
        self.lock().tokens.insert(token.to_string(), what);
    }

    /// Every review request body received so far.
    pub fn reviews(&self) -> Vec<Value> {
        self.lock().reviews.clone()
    }

    /// Answers every later request with HTTP `status` (`None`: answer normally).
    pub fn fail_with(&self, status: Option<u16>) {
        self.lock().fail_with = status;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for FakeKubeApi {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve(
    listener: std::net::TcpListener,
    config: Arc<rustls::ServerConfig>,
    shared: Arc<Mutex<Shared>>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    loop {
        let (tcp, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(_) => continue,
            },
            _ = &mut stopped => return,
        };
        let acceptor = acceptor.clone();
        let shared = shared.clone();
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(tcp).await else {
                return;
            };
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, std::convert::Infallible>(answer(req, &shared).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                .await;
        });
    }
}

type Body = http_body_util::Full<bytes::Bytes>;

fn respond(status: u16, body: &Value) -> hyper::Response<Body> {
    let mut response = hyper::Response::new(Body::from(body.to_string()));
    *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

fn status_body(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

async fn answer(
    req: hyper::Request<hyper::body::Incoming>,
    shared: &Mutex<Shared>,
) -> hyper::Response<Body> {
    use http_body_util::BodyExt;
    let lock = || shared.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(code) = lock().fail_with {
        return respond(code, &status_body(code, "InternalError", "failing as told"));
    }
    if req.method() != hyper::Method::POST
        || req.uri().path() != "/apis/authentication.k8s.io/v1/tokenreviews"
    {
        return respond(
            404,
            &status_body(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        );
    }
    let bearer = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    if bearer != format!("Bearer {COORDINATOR_TOKEN}") {
        return respond(401, &status_body(401, "Unauthorized", "Unauthorized"));
    }
    let Ok(body) = req.into_body().collect().await else {
        return respond(400, &status_body(400, "BadRequest", "unreadable body"));
    };
    let Ok(review) = serde_json::from_slice::<Value>(&body.to_bytes()) else {
        return respond(400, &status_body(400, "BadRequest", "not JSON"));
    };
    lock().reviews.push(review.clone());
    if review["apiVersion"] != "authentication.k8s.io/v1" || review["kind"] != "TokenReview" {
        return respond(
            400,
            &status_body(
                400,
                "BadRequest",
                "expected an authentication.k8s.io/v1 TokenReview",
            ),
        );
    }
    let token = review["spec"]["token"].as_str().unwrap_or_default();
    let wanted: Vec<String> = review["spec"]["audiences"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    let known = lock().tokens.get(token).cloned();
    let unauthenticated = |error: &str| {
        respond(
            201,
            &json!({
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "metadata": {"creationTimestamp": null},
                "spec": review["spec"],
                "status": {"user": {}, "error": error},
            }),
        )
    };
    let Some(known) = known else {
        return unauthenticated("[invalid bearer token, token lookup failed]");
    };
    if known.expired {
        return unauthenticated("[invalid bearer token, service account token has expired]");
    }
    let audiences: Vec<String> = if wanted.is_empty() {
        known.audiences.clone()
    } else {
        wanted
            .iter()
            .filter(|a| known.audiences.contains(a))
            .cloned()
            .collect()
    };
    if audiences.is_empty() {
        return unauthenticated(
            "[invalid bearer token, token audiences is invalid for the target audiences]",
        );
    }
    let (ns, name) = known
        .service_account
        .split_once('/')
        .unwrap_or(("default", "default"));
    let mut extra = serde_json::Map::new();
    if let Some(node) = &known.node {
        extra.insert(
            "authentication.kubernetes.io/node-name".into(),
            json!([node]),
        );
        extra.insert(
            "authentication.kubernetes.io/pod-name".into(),
            json!([known.pod]),
        );
        extra.insert(
            "authentication.kubernetes.io/credential-id".into(),
            json!(["JTI=0"]),
        );
    }
    respond(
        201,
        &json!({
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "metadata": {"creationTimestamp": null},
            "spec": review["spec"],
            "status": {
                "authenticated": true,
                "user": {
                    "username": format!("system:serviceaccount:{ns}:{name}"),
                    "uid": "0d5b4c2e-8f1a-4d7e-9c55-3f1f2f7a9b10",
                    "groups": ["system:serviceaccounts", format!("system:serviceaccounts:{ns}"), "system:authenticated"],
                    "extra": extra,
                },
                "audiences": audiences,
            },
        }),
    )
}
