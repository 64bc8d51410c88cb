//! Server side: a table of typed handlers by method id, and the loop that serves one stream.
//! Every request a router serves is counted (`stats`); every router answers `GetStats`.

use crate::conn::{buffered, read_request, spawn_writer};
use crate::error::RpcError;
use crate::spans::FrameSink;
use crate::stats::{Served, Stats};
use bytes::Bytes;
use futures::future::BoxFuture;
use odfs_proto::codec::{self, Frame, KIND_REQUEST};
use odfs_proto::error::RpcResult;
use odfs_proto::stats::{counts_as_error, GetStats};
use odfs_proto::{ErrorCode, RemoteError, RequestHeader, Rpc};
use std::collections::HashMap;
use std::future::Future;
use std::io::ErrorKind;
use std::sync::Arc;
use std::time::Instant;
use tokio::io::AsyncRead;
use tracing::{debug, warn, Instrument};

/// Decodes a request body, runs the handler and returns the whole reply frame.
type Handler = Arc<dyn Fn(u64, &[u8], Bytes) -> BoxFuture<'static, Frame> + Send + Sync>;

/// Maps method ids to handlers.
pub struct Router {
    handlers: HashMap<u16, (&'static str, Handler)>,
    stats: Arc<Stats>,
}

impl Default for Router {
    fn default() -> Self {
        Router::new()
    }
}

impl Router {
    /// A router that answers `GetStats` (what it has served) and nothing else yet.
    pub fn new() -> Router {
        let mut r = Router { handlers: HashMap::new(), stats: Arc::new(Stats::default()) };
        let stats = r.stats.clone();
        r.add::<GetStats, _, _>(move |_h: RequestHeader, _q: GetStats| {
            let s = stats.snapshot();
            async move { Ok(s) }
        });
        r
    }

    /// The counters of what this router serves.
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Registers the handler of request type `R`.
    pub fn add<R, F, Fut>(&mut self, f: F) -> &mut Self
    where
        R: Rpc,
        F: Fn(RequestHeader, R) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = RpcResult<R::Reply>> + Send + 'static,
    {
        let (f, stats) = (Arc::new(f), self.stats.clone());
        let h: Handler = Arc::new(move |call_id: u64, body: &[u8], payload: Bytes| {
            let (start, bytes_in) = (Instant::now(), payload.len() as u64);
            let decoded = codec::decode_request::<R>(body, payload);
            let (f, stats) = (f.clone(), stats.clone());
            Box::pin(async move {
                let (mut client, mut target) = (0, None);
                let result = match decoded {
                    Ok((header, req)) => {
                        client = header.client_id;
                        target = req.stats_target();
                        let span = tracing::debug_span!(
                            "rpc",
                            method = R::NAME,
                            client = header.client_id,
                            req = header.request_id,
                            uid = header.uid
                        );
                        f(header, req).instrument(span).await
                    }
                    Err(e) => {
                        warn!(method = R::NAME, error = %e, "malformed request");
                        Err(RemoteError::from(e))
                    }
                };
                let error = result.as_ref().is_err_and(|e| counts_as_error(R::NAME, e.code.errno()));
                let frame = codec::encode_reply::<R>(call_id, result);
                stats.record(Served {
                    method: R::METHOD,
                    name: R::NAME,
                    client,
                    target,
                    took: start.elapsed(),
                    error,
                    bytes_in,
                    bytes_out: frame.payload_len() as u64,
                });
                frame
            })
        });
        let prev = self.handlers.insert(R::METHOD, (R::NAME, h));
        assert!(prev.is_none(), "method {} registered twice", R::METHOD);
        self
    }

    pub(crate) fn dispatch(&self, call_id: u64, method: u16, body: &[u8], payload: Bytes) -> BoxFuture<'static, Frame> {
        match self.handlers.get(&method) {
            Some((_, h)) => h(call_id, body, payload),
            None => {
                let e = RemoteError::new(ErrorCode::BadMethod, format!("unknown method {method}"));
                Box::pin(async move { codec::encode_error(call_id, method, &e) })
            }
        }
    }
}

/// Serves requests arriving on one stream until it ends. Malformed frames end the stream; a
/// malformed request body gets an error reply.
pub async fn serve_stream<R, W>(router: Arc<Router>, reader: R, writer: W)
where
    R: AsyncRead + Unpin + Send + 'static,
    W: FrameSink,
{
    let tx = spawn_writer(writer, |why| debug!(error = %why, "reply stream failed"));
    let mut reader = buffered(reader);
    loop {
        let frame = match read_request(&mut reader).await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            // The peer went away between requests (a reset, a QUIC connection closed or lost:
            // what a command-line client's exit looks like): no bad frame.
            Err(RpcError::Io(e)) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::NotConnected) => {
                debug!(error = %e, "stream ended with its connection");
                break;
            }
            Err(e) => {
                warn!(error = %e, "closing stream after a bad frame");
                break;
            }
        };
        if frame.head.kind != KIND_REQUEST {
            warn!("closing stream: peer sent a reply frame");
            break;
        }
        let mut fut = router.dispatch(frame.head.call_id, frame.head.method, &frame.body, frame.payload);
        // A request answered without waiting (a metadata change, a read from the page cache) is
        // answered here: a task of its own would cost a spawn and a wake-up, often of another
        // thread. One that waits (disk, a recall) goes on in a task, so the stream reads on.
        match futures::poll!(&mut fut) {
            std::task::Poll::Ready(reply) => {
                let _ = tx.send(reply);
            }
            std::task::Poll::Pending => {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _ = tx.send(fut.await);
                });
            }
        }
    }
}
