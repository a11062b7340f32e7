//! `toolctl revoke IDENTITY`, `toolctl unrevoke IDENTITY` (or `revoke --undo`) and
//! `toolctl revocations`: the coordinator's deny-list of identities, for administrators.

use serde_json::json;

use crate::Revocation;

use super::{ConnArgs, connect, write_json, write_table};

/// Milliseconds since the epoch as UTC `YYYY-MM-DDTHH:MM:SSZ`.
fn utc(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil from days (Howard Hinnant's algorithm), for dates after 1970.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

fn revocation_json(r: &Revocation) -> serde_json::Value {
    json!({
        "identity": r.identity,
        "reason": r.reason,
        "revoked_by": r.revoked_by,
        "revoked_unix_ms": r.revoked_unix_ms,
    })
}

/// `toolctl revoke IDENTITY [--reason TEXT]`.
pub async fn revoke(conn: &ConnArgs, identity: &str, reason: &str) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    match remote.client.revoke(identity, reason).await {
        Ok(done) => {
            let revoked = done.revocation.unwrap_or_default();
            if done.already {
                eprintln!(
                    "toolctl: {} was revoked already (by {} at {}); nothing changed",
                    revoked.identity,
                    revoked.revoked_by,
                    utc(revoked.revoked_unix_ms)
                );
            } else {
                eprintln!(
                    "toolctl: revoked {}; {} open connection(s) closed",
                    revoked.identity, done.connections_closed
                );
            }
            0
        }
        Err(e) => remote.fail(&format!("cannot revoke {identity}"), &e),
    }
}

/// `toolctl unrevoke IDENTITY`.
pub async fn unrevoke(conn: &ConnArgs, identity: &str) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    match remote.client.unrevoke(identity).await {
        Ok(removed) => {
            eprintln!(
                "toolctl: lifted the revocation of {}; its certificates are accepted again",
                removed.identity
            );
            0
        }
        Err(e) => remote.fail(&format!("cannot lift the revocation of {identity}"), &e),
    }
}

/// `toolctl revocations [--json]`.
pub async fn revocations(conn: &ConnArgs, json_out: bool) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let list = match remote.client.revocations().await {
        Ok(list) => list,
        Err(e) => return remote.fail("cannot list the revocations", &e),
    };
    let mut out = std::io::stdout().lock();
    let written = if json_out {
        let list: Vec<_> = list.iter().map(revocation_json).collect();
        write_json(&mut out, &json!(list))
    } else {
        let rows: Vec<Vec<String>> = list
            .iter()
            .map(|r| {
                vec![
                    r.identity.clone(),
                    r.revoked_by.clone(),
                    utc(r.revoked_unix_ms),
                    r.reason.clone(),
                ]
            })
            .collect();
        write_table(&mut out, &["IDENTITY", "BY", "REVOKED", "REASON"], &rows)
    };
    super::written(written, "the revocations")
}

#[cfg(test)]
mod tests {
    use super::utc;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_767_225_599_000), "2025-12-31T23:59:59Z");
    }
}
