//! Plain HTTP for tests: a bounded GET (metrics endpoints, Prometheus' API) or JSON POST (etcd's
//! HTTP gateway) and a Prometheus
//! server started on loopback.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::error::{Result, TestkitError};
use crate::proc::{Proc, try_free_port};
use crate::wait::try_wait_for;

/// `GET path` from `addr` (`127.0.0.1:PORT`) over HTTP/1.0 (so the answer is never chunked),
/// within 10 s: the status code and the body.
pub fn http_get(addr: &str, path: &str) -> Result<(u16, String)> {
    http_request(addr, "GET", path, None)
}

/// `POST path` of a JSON `body` to `addr`, as [`http_get`] does a GET.
pub fn http_post_json(addr: &str, path: &str, body: &str) -> Result<(u16, String)> {
    http_request(addr, "POST", path, Some(body))
}

fn http_request(addr: &str, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String)> {
    let io = |what: &str, e| TestkitError::io(format!("{method} http://{addr}{path}: {what}"), e);
    let mut conn = TcpStream::connect(addr).map_err(|e| io("cannot connect", e))?;
    let limit = Some(Duration::from_secs(10));
    conn.set_read_timeout(limit).map_err(|e| io("socket", e))?;
    conn.set_write_timeout(limit).map_err(|e| io("socket", e))?;
    let mut request = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    if let Some(body) = body {
        request.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ));
    } else {
        request.push_str("\r\n");
    }
    conn.write_all(request.as_bytes())
        .map_err(|e| io("write", e))?;
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).map_err(|e| io("read", e))?;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            failed(
                format!("{method} http://{addr}{path}"),
                format!("no HTTP status in {head:?}"),
            )
        })?;
    Ok((status, body.to_string()))
}

fn failed(what: String, detail: String) -> TestkitError {
    TestkitError::Failed { what, detail }
}

/// Installs `package` with apt-get when `program` is not on the PATH (a test that needs a
/// program installs it or fails, never skips).
pub fn ensure_program(program: &str, package: &str) -> Result<PathBuf> {
    let find = || {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(program))
                .find(|p| p.is_file())
        })
    };
    if let Some(found) = find() {
        return Ok(found);
    }
    let status = Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends", package])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .map_err(|e| TestkitError::io(format!("{program} is missing and apt-get cannot run"), e))?;
    if !status.success() {
        return Err(failed(
            format!("installing {program} (`apt-get install {package}`)"),
            format!("{status}; install it by hand"),
        ));
    }
    find().ok_or_else(|| {
        failed(
            format!("installing {package}"),
            format!("{program} is not on the PATH after it"),
        )
    })
}

/// A Prometheus server on a loopback port scraping `targets` every second.
#[derive(Debug)]
pub struct Prometheus {
    pub addr: String,
    pub proc: Proc,
}

impl Prometheus {
    /// Starts Prometheus (Debian package `prometheus`, installed if missing) with its data in
    /// `dir`, and waits until it is ready.
    pub fn try_start(dir: &Path, targets: &[String]) -> Result<Self> {
        let binary = ensure_program("prometheus", "prometheus")?;
        let port = try_free_port()?;
        let addr = format!("127.0.0.1:{port}");
        let list = targets
            .iter()
            .map(|t| format!("'{t}'"))
            .collect::<Vec<_>>()
            .join(", ");
        let config = dir.join("prometheus.yml");
        crate::files::try_write_file(
            &config,
            &format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: toolsrv\n    static_configs:\n      - targets: [{list}]\n"
            ),
            false,
        )?;
        let mut cmd = Command::new(binary);
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn");
        let proc = Proc::try_spawn("prometheus", cmd, dir)?;
        let prometheus = Self { addr, proc };
        try_wait_for("Prometheus ready", Duration::from_secs(30), || {
            matches!(http_get(&prometheus.addr, "/-/ready"), Ok((200, _))).then_some(())
        })?;
        Ok(prometheus)
    }

    /// The result vector of an instant query (`/api/v1/query`), URL-encoded by the caller.
    pub fn query(&self, encoded: &str) -> Result<Vec<Value>> {
        let (status, body) = http_get(&self.addr, &format!("/api/v1/query?query={encoded}"))?;
        let what = || format!("Prometheus query {encoded}");
        let json: Value = serde_json::from_str(&body)
            .map_err(|e| failed(what(), format!("{status}, not JSON: {e}: {body}")))?;
        match json["data"]["result"].as_array() {
            Some(result) if status == 200 => Ok(result.clone()),
            _ => Err(failed(what(), format!("{status} {body}"))),
        }
    }

    /// Scrape targets as Prometheus sees them: (scrape URL, health, last error).
    pub fn targets(&self) -> Result<Vec<(String, String, String)>> {
        let (_, body) = http_get(&self.addr, "/api/v1/targets")?;
        let json: Value = serde_json::from_str(&body)
            .map_err(|e| failed("Prometheus targets".into(), format!("{e}: {body}")))?;
        Ok(json["data"]["activeTargets"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                let s = |k: &str| t[k].as_str().unwrap_or_default().to_string();
                (s("scrapeUrl"), s("health"), s("lastError"))
            })
            .collect())
    }
}
