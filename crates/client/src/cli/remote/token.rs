//! `toolctl token create`: a one-time join token for a host, printed alone on stdout;
//! `toolctl token list` and `toolctl token revoke ID`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;
use toolsrv_proto::v1::JoinTokenInfo;

use super::{ConnArgs, connect, write_json, write_table};
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
            crate::cli::say_out(&created.token);
            eprintln!(
                "toolctl: token {} for host `{}`, single use, expires {} UTC; CA pin {}",
                created.id,
                toolsrv_tls::normalize_name(host_id),
                toolsrv_tls::enroll::utc(created.expires_unix),
                created.ca_pin
            );
            if remote.addr.starts_with("https://") {
                eprintln!(
                    "toolctl: on the host: TOOLSRV_JOIN_TOKEN=TOKEN toolsrv agent --coordinator {} \
                     --ca-pin {} --state-dir DIR",
                    remote.addr, created.ca_pin
                );
            }
            0
        }
        Err(e) => remote.fail("creating a join token", &e),
    }
}

fn when(unix: i64) -> String {
    if unix == 0 {
        String::new()
    } else {
        toolsrv_tls::enroll::utc(unix)
    }
}

fn token_json(t: &JoinTokenInfo) -> serde_json::Value {
    let opt = |v: i64| (v != 0).then_some(v);
    json!({
        "id": t.id, "host_id": t.host_id, "labels": t.labels, "state": t.state,
        "created_by": t.created_by, "created_unix": t.created_unix,
        "expires_unix": t.expires_unix, "used_unix": opt(t.used_unix),
        "revoked_unix": opt(t.revoked_unix),
        "revoked_by": (!t.revoked_by.is_empty()).then_some(&t.revoked_by),
    })
}

/// `toolctl token list [--json]`.
pub async fn list(conn: &ConnArgs, json_out: bool) -> u8 {
    let remote = match connect(conn).await {
        Ok(r) => r,
        Err(code) => return code,
    };
    let tokens = match remote.client.join_tokens().await {
        Ok(t) => t,
        Err(e) => return remote.fail("listing the join tokens", &e),
    };
    let mut out = std::io::stdout().lock();
    let written = if json_out {
        let list: Vec<_> = tokens.iter().map(token_json).collect();
        write_json(&mut out, &json!(list))
    } else {
        let rows: Vec<Vec<String>> = tokens
            .iter()
            .map(|t| {
                let labels: Vec<String> =
                    t.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                let ended = match t.state.as_str() {
                    "used" => when(t.used_unix),
                    "revoked" => format!("{} by {}", when(t.revoked_unix), t.revoked_by),
                    _ => String::new(),
                };
                vec![
                    t.id.clone(),
                    t.host_id.clone(),
                    t.state.clone(),
                    when(t.expires_unix),
                    t.created_by.clone(),
                    labels.join(","),
                    ended,
                ]
            })
            .collect();
        write_table(
            &mut out,
            &[
                "ID",
                "HOST",
                "STATE",
                "EXPIRES",
                "BY",
                "LABELS",
                "USED/REVOKED",
            ],
            &rows,
        )
    };
    super::written(written, "the join tokens")
}

/// `toolctl token revoke ID`.
pub async fn revoke(conn: &ConnArgs, id: &str) -> u8 {
    let remote = match connect(conn).await {
        Ok(r) => r,
        Err(code) => return code,
    };
    match remote.client.revoke_join_token(id).await {
        Ok(token) => {
            eprintln!(
                "toolctl: join token {} for host `{}` revoked: it can no longer enroll a host",
                token.id, token.host_id
            );
            0
        }
        Err(e) => remote.fail(&format!("revoking join token {id}"), &e),
    }
}
