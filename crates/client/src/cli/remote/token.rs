//! `toolctl token create`: a one-time join token for a host, printed alone on stdout.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{ConnArgs, connect};
use crate::cli::exit;

/// Creates a token for `host_id`; prints it on stdout, and on stderr when it expires, the CA pin
/// and the command that joins the host.
pub async fn create(conn: &ConnArgs, host_id: &str, ttl: Option<&str>, labels: &[String]) -> u8 {
    let ttl = match ttl.map(toolsrv_tls::enroll::parse_duration).transpose() {
        Ok(Some(t)) if t < Duration::from_secs(1) => {
            eprintln!("toolctl: --ttl must be at least 1s");
            return exit::USAGE;
        }
        Ok(t) => t,
        Err(e) => {
            eprintln!("toolctl: --ttl: {e}");
            return exit::USAGE;
        }
    };
    let mut bound = BTreeMap::new();
    for item in labels.iter().filter(|s| !s.is_empty()) {
        let Some((k, v)) = item.split_once('=') else {
            eprintln!("toolctl: --label {item}: expected KEY=VALUE");
            return exit::USAGE;
        };
        if let Err(e) = toolsrv_tls::enroll::check_label(k, v) {
            eprintln!("toolctl: --label {item}: {e}");
            return exit::USAGE;
        }
        bound.insert(k.to_string(), v.to_string());
    }
    let remote = match connect(conn).await {
        Ok(r) => r,
        Err(code) => return code,
    };
    match remote.client.create_join_token(host_id, ttl, bound).await {
        Ok(created) => {
            println!("{}", created.token);
            eprintln!(
                "toolctl: token for host `{}`, single use, expires {} UTC; CA pin {}",
                toolsrv_tls::normalize_name(host_id),
                toolsrv_tls::enroll::utc(created.expires_unix),
                created.ca_pin
            );
            if remote.addr.starts_with("https://") {
                eprintln!(
                    "toolctl: on the host: toolsrv agent --join TOKEN --coordinator {} --ca-pin {} \
                     --state-dir DIR",
                    remote.addr, created.ca_pin
                );
            }
            0
        }
        Err(e) => remote.fail("creating a join token", &e),
    }
}
