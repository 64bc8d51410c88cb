//! The Prometheus endpoint (opt-in: `metrics_listen`): `GET /metrics` answers what every
//! service of the job has served, in Prometheus' text format, asked of the services at each
//! scrape (`odfs_rpc::stats::gather`, as `odfs stats` does). Plain HTTP/1.1, one request per
//! connection: a scraper needs nothing more, and the numbers hold no secret.

use odfs_proto::stats::FsStats;
use std::future::Future;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::debug;

/// Longest request head read, and how long a client may take to send it.
const MAX_HEAD: usize = 8 << 10;
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves scrapes on `listener` until `shutdown` fires; `gather` collects the numbers.
pub async fn serve<G, F>(listener: TcpListener, gather: G, mut shutdown: odfs_rpc::Shutdown)
where
    G: Fn() -> F + Clone + Send + Sync + 'static,
    F: Future<Output = FsStats> + Send,
{
    loop {
        let (stream, peer) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    debug!(error = %e, "metrics accept failed");
                    continue;
                }
            },
            _ = shutdown.changed() => return,
        };
        let gather = gather.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(stream, gather).await {
                debug!(%peer, error = %e, "metrics request failed");
            }
        });
    }
}

/// Reads one request head and answers it.
async fn answer<G, F>(mut s: TcpStream, gather: G) -> std::io::Result<()>
where
    G: Fn() -> F,
    F: Future<Output = FsStats>,
{
    let head = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut s)).await {
        Ok(h) => h?,
        Err(_) => return Ok(()),
    };
    let line = head.lines().next().unwrap_or("");
    let mut words = line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let (status, body, kind) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => ("200 OK", gather().await.prometheus(), "text/plain; version=0.0.4; charset=utf-8"),
        ("GET", _) => ("404 Not Found", "odfs serves /metrics only\n".to_string(), "text/plain"),
        _ => ("405 Method Not Allowed", "GET /metrics\n".to_string(), "text/plain"),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(reply.as_bytes()).await?;
    s.shutdown().await
}

/// The request line and headers, up to the blank line (or `MAX_HEAD` bytes).
async fn read_head(s: &mut TcpStream) -> std::io::Result<String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < MAX_HEAD {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}
