//! Process-level pieces: logging, shutdown on SIGTERM/SIGINT, the address file.

use odfs_rpc::Shutdown;
use std::net::SocketAddr;
use std::path::Path;
use tokio::sync::watch;

/// Logs to stderr; `RUST_LOG` overrides `default_level`.
pub fn init_logging(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false).try_init();
}

/// Runs `f` unless shutdown is asked for first (None then): a daemon still starting up —
/// waiting for an unreachable mgmtd — stops at once on SIGTERM instead of after its timeout.
pub async fn until_shutdown<F: std::future::Future>(shutdown: &Shutdown, f: F) -> Option<F::Output> {
    let mut s = shutdown.clone();
    if *s.borrow() {
        return None;
    }
    tokio::select! {
        r = f => Some(r),
        _ = s.changed() => None,
    }
}

/// A shutdown channel that fires on SIGTERM or SIGINT.
pub fn shutdown_channel() -> (watch::Sender<bool>, Shutdown) {
    let (tx, rx) = watch::channel(false);
    let tx2 = tx.clone();
    tokio::spawn(async move {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot install SIGTERM handler");
                return;
            }
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("shutdown requested");
        let _ = tx2.send(true);
    });
    (tx, rx)
}

/// Writes `name=addr` lines atomically (temp file + rename) so a launcher never reads half a file.
pub fn write_addr_file(path: &Path, addrs: &[(&str, SocketAddr)]) -> std::io::Result<()> {
    let text: String = addrs.iter().map(|(k, a)| format!("{k}={a}\n")).collect();
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// This machine's host name ("unknown" if it cannot be read).
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer and its length are valid.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if r != 0 {
        return "unknown".into();
    }
    let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..n]).into_owned()
}
