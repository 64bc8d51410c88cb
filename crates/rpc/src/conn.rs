//! One multiplexed connection: many requests in flight over a single byte stream (a QUIC
//! bidirectional stream or a TCP connection), replies paired to callers by call id.

use crate::RpcError;
use odfs_proto::codec::{self, FrameHead, KIND_REQUEST, MAX_FRAME};
use odfs_proto::{RequestHeader, Rpc};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, oneshot};

type Waiter = oneshot::Sender<Result<(u8, Vec<u8>), RpcError>>;

struct Inner {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    pending: Mutex<HashMap<u64, Waiter>>,
    next_call: AtomicU64,
    closed: AtomicBool,
    label: String,
    /// Keeps the underlying connection object (e.g. a quinn::Connection) alive.
    held: Mutex<Option<Box<dyn Any + Send + Sync>>>,
}

impl Inner {
    fn fail_all(&self, why: &str) {
        self.closed.store(true, Ordering::Release);
        let waiters: Vec<Waiter> = self.pending.lock().expect("pending lock").drain().map(|(_, w)| w).collect();
        for w in waiters {
            let _ = w.send(Err(RpcError::Closed(format!("{} ({why})", self.label))));
        }
    }
}

/// The client side of a connection. Cheap to clone; every clone shares the stream.
#[derive(Clone)]
pub struct Conn {
    inner: Arc<Inner>,
}

/// Reads one frame (without its length prefix). `Ok(None)` at a clean end of stream.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Vec<u8>>, RpcError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(odfs_proto::ProtoError::FrameTooLarge(len, MAX_FRAME).into());
    }
    // Read into spare capacity: zero-filling megabytes of chunk data first costs a memset.
    let mut buf = Vec::with_capacity(len);
    let n = (&mut *r).take(len as u64).read_to_end(&mut buf).await?;
    if n < len {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
    }
    Ok(Some(buf))
}

/// Spawns the task that writes frames to `w`, coalescing small frames into one flush.
pub(crate) fn spawn_writer<W: AsyncWrite + Unpin + Send + 'static>(
    w: W,
    on_error: impl FnOnce(String) + Send + 'static,
) -> mpsc::UnboundedSender<Vec<u8>> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    tokio::spawn(async move {
        let mut w = BufWriter::with_capacity(256 * 1024, w);
        let result: std::io::Result<()> = async {
            while let Some(frame) = rx.recv().await {
                w.write_all(&frame).await?;
                while let Ok(more) = rx.try_recv() {
                    w.write_all(&more).await?;
                }
                w.flush().await?;
            }
            w.shutdown().await
        }
        .await;
        if let Err(e) = result {
            on_error(e.to_string());
        }
    });
    tx
}

impl Conn {
    /// Wraps a stream's halves; spawns its reader and writer tasks.
    pub fn new<R, W>(reader: R, writer: W, label: String) -> Conn
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let inner = Arc::new_cyclic(|weak: &std::sync::Weak<Inner>| {
            let w = weak.clone();
            let tx = spawn_writer(writer, move |why| {
                if let Some(i) = w.upgrade() {
                    i.fail_all(&why);
                }
            });
            Inner {
                tx,
                pending: Mutex::new(HashMap::new()),
                next_call: AtomicU64::new(1),
                closed: AtomicBool::new(false),
                label,
                held: Mutex::new(None),
            }
        });
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let mut reader = reader;
            let why = loop {
                let frame = match read_frame(&mut reader).await {
                    Ok(Some(f)) => f,
                    Ok(None) => break "closed by peer".to_string(),
                    Err(e) => break e.to_string(),
                };
                let Some(inner) = weak.upgrade() else { return };
                let (head, body) = match FrameHead::parse(&frame) {
                    Ok(x) => x,
                    Err(e) => break e.to_string(),
                };
                if head.kind == KIND_REQUEST {
                    break "peer sent a request on a client stream".to_string();
                }
                let waiter = inner.pending.lock().expect("pending lock").remove(&head.call_id);
                if let Some(w) = waiter {
                    let _ = w.send(Ok((head.kind, body.to_vec())));
                }
            };
            if let Some(inner) = weak.upgrade() {
                inner.fail_all(&why);
            }
        });
        Conn { inner }
    }

    /// Keeps `obj` alive as long as this connection.
    pub fn hold(&self, obj: impl Any + Send + Sync) {
        *self.inner.held.lock().expect("held lock") = Some(Box::new(obj));
    }

    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    pub fn label(&self) -> &str {
        &self.inner.label
    }

    /// Sends one request and waits for its reply, at most `timeout`.
    pub async fn call<R: Rpc>(&self, header: &RequestHeader, req: &R, timeout: Duration) -> Result<R::Reply, RpcError> {
        if self.is_closed() {
            return Err(RpcError::Closed(self.inner.label.clone()));
        }
        let call_id = self.inner.next_call.fetch_add(1, Ordering::Relaxed);
        let frame = codec::encode_request(call_id, header, req)?;
        let (tx, rx) = oneshot::channel();
        self.inner.pending.lock().expect("pending lock").insert(call_id, tx);
        if self.inner.tx.send(frame).is_err() {
            self.inner.pending.lock().expect("pending lock").remove(&call_id);
            return Err(RpcError::Closed(self.inner.label.clone()));
        }
        let reply = match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r?,
            Ok(Err(_)) => return Err(RpcError::Closed(self.inner.label.clone())),
            Err(_) => {
                self.inner.pending.lock().expect("pending lock").remove(&call_id);
                return Err(RpcError::Timeout {
                    method: R::NAME,
                    addr: self.inner.label.clone(),
                    secs: timeout.as_secs(),
                });
            }
        };
        let (kind, body) = reply;
        Ok(codec::decode_reply::<R::Reply>(kind, &body)?)
    }

    /// Closes the connection; pending calls fail.
    pub fn close(&self) {
        self.inner.fail_all("closed locally");
        *self.inner.held.lock().expect("held lock") = None;
    }
}
