//! `GET /metrics` over plain HTTP/1.1: the Prometheus text format (0.0.4), or OpenMetrics when
//! the scraper asks for it in `Accept` (Prometheus does).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use toolsrv_tls::{PlainConn, PlainLimits, PlainListener};

/// The OpenMetrics content type this endpoint answers with when asked.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Encodes `registry` in the Prometheus text format, or in OpenMetrics.
pub fn encode(registry: &Registry, openmetrics: bool) -> Result<String, std::fmt::Error> {
    let mut text = String::with_capacity(8 << 10);
    if openmetrics {
        prometheus_client::encoding::text::encode(&mut text, registry)?;
    } else {
        prometheus_client::encoding::prometheus_text::encode(&mut text, registry)?;
    }
    Ok(text)
}

/// A running metrics endpoint.
#[derive(Debug)]
pub struct MetricsServer {
    pub addr: SocketAddr,
}

impl MetricsServer {
    /// Serves `registry` on `listener` until `shutdown` is cancelled. Only `GET /metrics` (and
    /// `HEAD`) is answered; every other path is 404. Connections are held within
    /// [`PlainLimits::DEFAULT`].
    pub fn spawn(
        listener: TcpListener,
        registry: Arc<Registry>,
        shutdown: CancellationToken,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let app = Router::new()
            .route("/metrics", get(scrape))
            .with_state(registry);
        let listener = Plain(PlainListener::new(
            listener,
            PlainLimits::DEFAULT,
            "metrics",
        ));
        tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "metrics endpoint failed");
            }
        });
        Ok(Self { addr })
    }
}

/// The endpoint's listener: [`PlainListener`]'s bounds on connections, for axum.
struct Plain(PlainListener);

impl axum::serve::Listener for Plain {
    type Io = PlainConn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (PlainConn, SocketAddr) {
        self.0.accept().await
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

async fn scrape(State(registry): State<Arc<Registry>>, headers: HeaderMap) -> Response {
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    // Collectors read /proc and certificate files: off the async workers.
    let encoded = tokio::task::spawn_blocking(move || encode(&registry, openmetrics)).await;
    match encoded {
        Ok(Ok(text)) => {
            let content_type = if openmetrics {
                OPENMETRICS
            } else {
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE
            };
            ([(header::CONTENT_TYPE, content_type)], text).into_response()
        }
        Ok(Err(_)) | Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "cannot encode the metrics\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::{Counter, Family, Labels};

    async fn get(addr: SocketAddr, path: &str, accept: &str) -> String {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: x\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
        );
        conn.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await.unwrap();
        answer
    }

    #[tokio::test]
    async fn serves_both_formats_and_nothing_else() {
        let mut registry = crate::registry();
        let calls = Family::<Labels<1>, Counter>::default();
        registry.register("calls", "Calls", calls.clone());
        calls.get_or_create(&[("status", "ok")]).inc_by(3);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stop = CancellationToken::new();
        let server = MetricsServer::spawn(listener, Arc::new(registry), stop.clone()).unwrap();

        let text = get(server.addr, "/metrics", "*/*").await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(text.contains("text/plain; version=0.0.4"), "{text}");
        assert!(
            text.contains("toolsrv_calls_total{status=\"ok\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("toolsrv_process_resident_memory_bytes "),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");

        let open = get(
            server.addr,
            "/metrics",
            "application/openmetrics-text;version=1.0.0,text/plain;q=0.5",
        )
        .await;
        assert!(open.contains("application/openmetrics-text"), "{open}");
        assert!(open.trim_end().ends_with("# EOF"), "{open}");

        let other = get(server.addr, "/", "*/*").await;
        assert!(other.starts_with("HTTP/1.1 404"), "{other}");
        stop.cancel();
    }
}
