//! `toolctl master`: hold one connection to the coordinator and serve it on a control socket, so
//! that the commands run after it skip connection set-up.

use std::time::Duration;

use crate::control::{self, MasterOptions};
use tokio_util::sync::CancellationToken;

use super::{ConnArgs, connect_direct, error_code, exit};

pub async fn master(conn: &ConnArgs, idle_exit: Option<f64>) -> u8 {
    let path = conn.control_path().unwrap_or_else(control::default_socket);
    let idle_exit = match idle_exit.map(Duration::try_from_secs_f64) {
        None => None,
        Some(Ok(after)) if !after.is_zero() => Some(after),
        Some(_) => {
            eprintln!("toolctl: --idle-exit: must be a positive number of seconds");
            return exit::USAGE;
        }
    };
    let opts = match conn.direct() {
        Ok(opts) => opts,
        Err(e) => {
            eprintln!("toolctl: master: {e}");
            return exit::USAGE;
        }
    };
    let remote = match connect_direct(opts).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    // With TLS 1.3 a refused certificate only shows on the first RPC: find out now, not in a
    // command relayed later.
    if let Err(e) = remote.client.hosts().await {
        return remote.fail("master: the coordinator does not answer", &e);
    }
    if let Err(e) = control::prepare_default_dir(&path) {
        eprintln!("toolctl: master: cannot serve on the default control socket: {e}");
        return exit::CONFIG;
    }
    let socket = match control::bind(&path).await {
        Ok(socket) => socket,
        Err(e) => {
            eprintln!("toolctl: master: cannot serve on the control socket {e}");
            return exit::CONFIG;
        }
    };
    eprintln!(
        "toolctl master: serving {} on {} (pid {})",
        remote.addr,
        path.display(),
        std::process::id()
    );

    let shutdown = CancellationToken::new();
    let signals = tokio::spawn(stop_on_signal(shutdown.clone()));
    let served =
        control::serve_master(remote.client, socket, MasterOptions { idle_exit }, shutdown).await;
    signals.abort();
    match served {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("toolctl: master: {e}");
            error_code(&e)
        }
    }
}

/// Ctrl-C or SIGTERM stops the master (and removes its socket).
async fn stop_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let term = async {
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = super::interrupted() => {}
        () = term => {}
    }
    shutdown.cancel();
}
