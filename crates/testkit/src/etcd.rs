//! An etcd cluster on loopback ports for tests: N members (Debian's `etcd-server`, installed
//! if missing) in a temporary directory, each one killable and restartable, all killed on
//! drop. Client URLs are plain HTTP, or HTTPS with client certificates from a throwaway CA.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::error::{Result, TestkitError, must};
use crate::http::{ensure_program, http_get, http_post_json};
use crate::proc::{Proc, try_free_port};
use crate::wait::try_wait_for;

/// How long a member may take to report itself healthy.
const READY_WAIT: Duration = Duration::from_secs(30);

/// The CA and the client certificate an etcd with client TLS trusts.
#[derive(Debug, Clone)]
pub struct EtcdClientTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// One member: its URLs and, while it runs, its process.
#[derive(Debug)]
pub struct EtcdMember {
    pub name: String,
    pub client_url: String,
    /// Plain HTTP `/health` and `/metrics`, whatever the client URLs use.
    pub metrics_addr: String,
    args: Vec<String>,
    proc: Option<Proc>,
}

/// An etcd cluster on loopback.
#[derive(Debug)]
pub struct EtcdCluster {
    pub members: Vec<EtcdMember>,
    pub tls: Option<EtcdClientTls>,
    binary: PathBuf,
    dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `n` members with plain HTTP client URLs and waits until they are healthy.
    pub fn try_start(n: usize) -> Result<Self> {
        Self::try_start_with(n, false)
    }

    /// [`EtcdCluster::try_start`], failing the test on error.
    #[track_caller]
    pub fn start(n: usize) -> Self {
        must(Self::try_start(n))
    }

    /// Starts `n` members whose client URLs are HTTPS and require a client certificate
    /// ([`EtcdCluster::tls`]).
    pub fn try_start_tls(n: usize) -> Result<Self> {
        Self::try_start_with(n, true)
    }

    /// [`EtcdCluster::try_start`] with etcd's own election timing (heartbeat 100 ms, election
    /// 1 s) instead of the tests' fast one, as a deployment runs it: for benchmarks that load
    /// the machine, where fast elections would keep electing.
    pub fn try_start_default_timing(n: usize) -> Result<Self> {
        Self::try_start_timed(n, false, false)
    }

    fn try_start_with(n: usize, tls: bool) -> Result<Self> {
        Self::try_start_timed(n, tls, true)
    }

    fn try_start_timed(n: usize, tls: bool, fast: bool) -> Result<Self> {
        // Members of clusters started at once by parallel tests must not find each other, and
        // a start that misses its bound on a loaded machine is tried once more, on new ports.
        match Self::try_start_once(n, tls, fast) {
            Ok(cluster) => Ok(cluster),
            Err(first) => {
                eprintln!("etcd cluster did not start ({first}); trying once more");
                Self::try_start_once(n, tls, fast)
            }
        }
    }

    fn try_start_once(n: usize, tls: bool, fast: bool) -> Result<Self> {
        static CLUSTERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let token = format!(
            "toolsrv-test-{}-{}",
            std::process::id(),
            CLUSTERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let binary = ensure_program("etcd", "etcd-server")?;
        // On a tmpfs when there is one: etcd syncs every write, which a test's throwaway data
        // does not need and a loaded disk makes slow.
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::tempdir_in(shm).or_else(|_| tempfile::tempdir())
        } else {
            tempfile::tempdir()
        }
        .map_err(|e| TestkitError::io("cannot make a temporary directory", e))?;
        let tls = if tls {
            Some(write_certs(dir.path())?)
        } else {
            None
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut peers = Vec::new();
        let mut members = Vec::new();
        for i in 0..n {
            let name = format!("etcd{i}");
            let client_url = format!("{scheme}://127.0.0.1:{}", try_free_port()?);
            let peer_url = format!("http://127.0.0.1:{}", try_free_port()?);
            let metrics_addr = format!("127.0.0.1:{}", try_free_port()?);
            peers.push(format!("{name}={peer_url}"));
            let mut args = vec![
                format!("--name={name}"),
                format!("--data-dir={}", dir.path().join(&name).display()),
                format!("--listen-client-urls={client_url}"),
                format!("--advertise-client-urls={client_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--listen-metrics-urls=http://{metrics_addr}"),
                "--initial-cluster-state=new".into(),
                format!("--initial-cluster-token={token}"),
                // Fast elections: a lost member or leader is noticed within a second.
                format!("--heartbeat-interval={}", if fast { 50 } else { 100 }),
                format!("--election-timeout={}", if fast { 500 } else { 1000 }),
                "--logger=zap".into(),
                "--log-outputs=stderr".into(),
            ];
            if let Some(tls) = &tls {
                let server = dir.path().join("server");
                args.extend([
                    format!("--cert-file={}.pem", server.display()),
                    format!("--key-file={}-key.pem", server.display()),
                    format!("--trusted-ca-file={}", tls.ca.display()),
                    "--client-cert-auth".into(),
                ]);
            }
            members.push(EtcdMember {
                name,
                client_url,
                metrics_addr,
                args,
                proc: None,
            });
        }
        let initial = format!("--initial-cluster={}", peers.join(","));
        for member in &mut members {
            member.args.push(initial.clone());
        }
        let mut cluster = Self {
            members,
            tls,
            binary,
            dir,
        };
        for i in 0..n {
            cluster.spawn(i)?;
        }
        cluster.try_wait_healthy((0..n).collect())?;
        Ok(cluster)
    }

    /// The client URLs of every member, running or not.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    /// SIGKILL to member `i`: it vanishes mid-request, as a crashed host would.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut proc) = self.members[i].proc.take() {
            proc.kill();
        }
    }

    /// Starts member `i` again (on its data) and waits until it reports healthy.
    pub fn try_restart(&mut self, i: usize) -> Result<()> {
        self.kill(i);
        self.spawn(i)?;
        self.try_wait_healthy(vec![i])
    }

    /// [`EtcdCluster::try_restart`], failing the test on error.
    #[track_caller]
    pub fn restart(&mut self, i: usize) {
        must(self.try_restart(i));
    }

    /// Starts member `i` without waiting: a member alone cannot report healthy while the
    /// others are down.
    pub fn try_start_member(&mut self, i: usize) -> Result<()> {
        self.kill(i);
        self.spawn(i)
    }

    /// Waits until each member of `which` has a leader (`/health` true).
    pub fn try_wait_healthy(&self, which: Vec<usize>) -> Result<()> {
        for i in which {
            let member = &self.members[i];
            try_wait_for(
                &format!("etcd member {} healthy", member.name),
                READY_WAIT,
                || {
                    matches!(http_get(&member.metrics_addr, "/health"),
                        Ok((200, body)) if body.contains("true"))
                    .then_some(())
                },
            )
            .map_err(|e| TestkitError::Failed {
                what: format!("starting etcd member {}", member.name),
                detail: format!("{e}\n{}", self.log_tail(i)),
            })?;
        }
        Ok(())
    }

    /// The index of the member that is the leader now, as the running members' metrics say
    /// (`etcd_server_is_leader 1`); `None` while there is none.
    pub fn leader(&self) -> Option<usize> {
        self.members.iter().position(|member| {
            member.proc.is_some()
                && matches!(http_get(&member.metrics_addr, "/metrics"),
                    Ok((200, body)) if body.lines().any(|l| l.trim() == "etcd_server_is_leader 1"))
        })
    }

    /// Deletes `key` through the HTTP gateway of the first running member (plain HTTP client
    /// URLs only): what an operator restoring an old backup, say, does behind the replicas' back.
    pub fn try_delete(&self, key: &str) -> Result<()> {
        let failed = |detail: String| TestkitError::Failed {
            what: format!("deleting etcd key {key}"),
            detail,
        };
        let member = self
            .members
            .iter()
            .find(|m| m.proc.is_some())
            .ok_or_else(|| failed("no member runs".into()))?;
        let addr = member
            .client_url
            .strip_prefix("http://")
            .ok_or_else(|| failed(format!("{} is not a plain HTTP URL", member.client_url)))?;
        let body = serde_json::json!({ "key": base64(key.as_bytes()) }).to_string();
        match http_post_json(addr, "/v3/kv/deleterange", &body)? {
            (200, _) => Ok(()),
            (status, answer) => Err(failed(format!("HTTP {status}: {answer}"))),
        }
    }

    /// [`EtcdCluster::try_delete`], failing the test on error.
    #[track_caller]
    pub fn delete(&self, key: &str) {
        must(self.try_delete(key));
    }

    /// The end of member `i`'s log.
    pub fn log_tail(&self, i: usize) -> String {
        self.members[i]
            .proc
            .as_ref()
            .map(|p| p.log_tail(20))
            .unwrap_or_default()
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let member = &mut self.members[i];
        let mut cmd = Command::new(&self.binary);
        cmd.args(&member.args);
        let log_name = format!("{}-{}", member.name, next_run());
        member.proc = Some(Proc::try_spawn(&log_name, cmd, self.dir.path())?);
        Ok(())
    }
}

/// Standard base64 with padding, as etcd's JSON gateway takes keys and values.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A number per start, so that a restarted member's log does not overwrite the first.
fn next_run() -> usize {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A throwaway CA, a server certificate for 127.0.0.1 (`server.pem`) and a client certificate
/// (`client.pem`), with their keys.
fn write_certs(dir: &Path) -> Result<EtcdClientTls> {
    let failed = |what: &str, e: rcgen::Error| TestkitError::Certificate {
        stem: what.to_string(),
        reason: e.to_string(),
    };
    let write = |name: &str, pem: String| {
        let path = dir.join(name);
        std::fs::write(&path, pem)
            .map_err(|e| TestkitError::io(format!("cannot write {}", path.display()), e))?;
        Ok::<_, TestkitError>(path)
    };
    let ca_key = rcgen::KeyPair::generate().map_err(|e| failed("etcd CA", e))?;
    let mut ca_params = rcgen::CertificateParams::default();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    let ca_cert = ca_params
        .self_signed(&ca_key)
        .map_err(|e| failed("etcd CA", e))?;
    let ca = write("etcd-ca.pem", ca_cert.pem())?;
    let issuer = rcgen::Issuer::from_ca_cert_pem(&ca_cert.pem(), ca_key)
        .map_err(|e| failed("etcd CA", e))?;
    let issue = |stem: &str, usage: rcgen::ExtendedKeyUsagePurpose| {
        let key = rcgen::KeyPair::generate().map_err(|e| failed(stem, e))?;
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .map_err(|e| failed(stem, e))?;
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        params.extended_key_usages = vec![usage];
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(|e| failed(stem, e))?;
        let cert_path = write(&format!("{stem}.pem"), cert.pem())?;
        let key_path = dir.join(format!("{stem}-key.pem"));
        crate::pki::write_key(&key_path, &key.serialize_pem())?;
        Ok::<_, TestkitError>((cert_path, key_path))
    };
    issue("server", rcgen::ExtendedKeyUsagePurpose::ServerAuth)?;
    let (cert, key) = issue("client", rcgen::ExtendedKeyUsagePurpose::ClientAuth)?;
    Ok(EtcdClientTls { ca, cert, key })
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_pads() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("/test/catalog", "L3Rlc3QvY2F0YWxvZw=="),
        ];
        for (plain, want) in cases {
            assert_eq!(super::base64(plain.as_bytes()), want, "{plain}");
        }
    }
}
