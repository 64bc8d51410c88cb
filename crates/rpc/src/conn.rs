//! One multiplexed connection: many requests in flight over a single byte stream (a QUIC
//! bidirectional stream or a TCP connection), replies paired to callers by call id.

use crate::recycle::Recycled;
use crate::spans::{self, FrameSink};
use crate::RpcError;
use bytes::{BufMut, Bytes};
use odfs_proto::codec::{self, Frame, FrameHead, FRAME_FIXED, KIND_REQUEST, MAX_FRAME};
use odfs_proto::{RequestHeader, Rpc};
use std::any::Any;
use std::collections::HashMap;
use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, oneshot};

type Waiter = oneshot::Sender<Result<Received, RpcError>>;

struct Inner {
    tx: mpsc::UnboundedSender<Frame>,
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

/// One frame as read: its fixed part, body and payload, each in a buffer of its own. Replies'
/// payloads (chunk data for a reader) are plain vectors; requests' are [`Bytes`] that start on a
/// [`PAYLOAD_ALIGN`] boundary (see [`read_request`]).
pub(crate) struct Received<P = Vec<u8>> {
    pub head: FrameHead,
    pub body: Vec<u8>,
    pub payload: P,
}

/// Where a request's payload of at least this many bytes starts in memory: the page size, so
/// that stored can hand chunk data to an `O_DIRECT` write as it arrived, without copying it
/// into an aligned buffer first.
pub const PAYLOAD_ALIGN: usize = 4096;

/// Buffered reading of a stream: the length prefix, fixed part and body of small frames come
/// in one read system call; a payload larger than the buffer is read straight into its own.
pub(crate) fn buffered<R: AsyncRead>(r: R) -> BufReader<R> {
    BufReader::with_capacity(64 << 10, r)
}

/// Reads one frame, its payload into a vector. `Ok(None)` at a clean end of stream.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Received>, RpcError> {
    let Some((head, body)) = read_head(r).await? else { return Ok(None) };
    let payload = read_vec(r, head.payload as usize).await?;
    Ok(Some(Received { head, body, payload }))
}

/// Reads one request frame, its payload aligned (see [`read_aligned`]). `Ok(None)` at a clean
/// end of stream.
pub(crate) async fn read_request<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Received<Bytes>>, RpcError> {
    let Some((head, body)) = read_head(r).await? else { return Ok(None) };
    let payload = read_aligned(r, head.payload as usize).await?;
    Ok(Some(Received { head, body, payload }))
}

/// Reads a frame's length prefix, fixed part and body. `Ok(None)` at a clean end of stream.
async fn read_head<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<(FrameHead, Vec<u8>)>, RpcError> {
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
    let mut fixed = [0u8; FRAME_FIXED];
    if len < FRAME_FIXED {
        return Err(odfs_proto::ProtoError::Truncated.into());
    }
    r.read_exact(&mut fixed).await?;
    let head = FrameHead::parse(&fixed, len)?;
    let body = read_vec(r, head.body_len(len)).await?;
    Ok(Some((head, body)))
}

/// Reads exactly `len` bytes into a new buffer, filling its spare capacity (zero-filling
/// megabytes of chunk data first would cost a memset).
async fn read_vec<R: AsyncRead + Unpin>(r: &mut R, len: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(len);
    while buf.len() < len {
        // The spare capacity is exactly what remains: the read never takes the next frame's bytes.
        if r.read_buf(&mut buf).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(buf)
}

/// [`read_vec`] into a buffer whose first byte sits on a [`PAYLOAD_ALIGN`] boundary when `len`
/// is at least that, recycled once its last reference is dropped (`crate::recycle`).
async fn read_aligned<R: AsyncRead + Unpin>(r: &mut R, len: usize) -> std::io::Result<Bytes> {
    if len < PAYLOAD_ALIGN {
        return Ok(read_vec(r, len).await?.into());
    }
    let mut buf = Recycled::take(len);
    while buf.len() < len {
        // Limited to what remains: the read never takes the next frame's bytes.
        let want = len - buf.len();
        if r.read_buf(&mut buf.vec().limit(want)).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(buf.freeze())
}

/// Spawns the task that writes frames to `w`, coalescing small frames into one flush; a large
/// payload is written from its own buffer (the buffered writer passes it through), file spans
/// by `spans::send`.
pub(crate) fn spawn_writer<W: FrameSink>(
    w: W,
    on_error: impl FnOnce(String) + Send + 'static,
) -> mpsc::UnboundedSender<Frame> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Frame>();
    tokio::spawn(async move {
        let mut w = BufWriter::with_capacity(256 * 1024, w);
        let result: std::io::Result<()> = async {
            while let Some(frame) = rx.recv().await {
                write_frame(&mut w, &frame).await?;
                while let Ok(more) = rx.try_recv() {
                    write_frame(&mut w, &more).await?;
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

async fn write_frame<W: FrameSink>(w: &mut BufWriter<W>, frame: &Frame) -> std::io::Result<()> {
    write_all_vectored(w, &frame.head, frame.payload.pieces()).await?;
    if !frame.spans.is_empty() {
        w.flush().await?;
        spans::send(w.get_mut(), &frame.spans).await?;
    }
    Ok(())
}

/// Writes `head` and then every piece, in as few vectored writes as the stream takes: a frame
/// smaller than the writer's buffer joins it (small frames leave in one flush); a larger one
/// goes to a TCP socket from the pieces' own buffers (`writev`), with no copy of the sender's.
/// A stream without vectored writes (a QUIC stream) takes the pieces one by one, those smaller
/// than the buffer copied into it.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut BufWriter<W>,
    head: &[u8],
    pieces: &[Bytes],
) -> std::io::Result<()> {
    if pieces.is_empty() {
        // Most frames (metadata): no list of slices to build.
        return w.write_all(head).await;
    }
    let mut slices: Vec<IoSlice<'_>> =
        std::iter::once(head).chain(pieces.iter().map(|p| &p[..])).map(IoSlice::new).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = w.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

impl Conn {
    /// Wraps a stream's halves; spawns its reader and writer tasks.
    pub fn new<R, W>(reader: R, writer: W, label: String) -> Conn
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: FrameSink,
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
            let mut reader = buffered(reader);
            let why = loop {
                let frame = match read_frame(&mut reader).await {
                    Ok(Some(f)) => f,
                    Ok(None) => break "closed by peer".to_string(),
                    Err(e) => break e.to_string(),
                };
                let Some(inner) = weak.upgrade() else { return };
                if frame.head.kind == KIND_REQUEST {
                    break "peer sent a request on a client stream".to_string();
                }
                let waiter = inner.pending.lock().expect("pending lock").remove(&frame.head.call_id);
                if let Some(w) = waiter {
                    let _ = w.send(Ok(frame));
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
        Ok(codec::decode_reply::<R>(reply.head.kind, &reply.body, reply.payload)?)
    }

    /// Closes the connection; pending calls fail.
    pub fn close(&self) {
        self.inner.fail_all("closed locally");
        *self.inner.held.lock().expect("held lock") = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// A stream that takes at most `max` bytes per write, vectored or not, as a full socket
    /// buffer does.
    struct Trickle {
        out: Vec<u8>,
        max: usize,
        vectored: bool,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
            let n = buf.len().min(self.max);
            self.out.extend_from_slice(&buf[..n]);
            Poll::Ready(Ok(n))
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(self.max - n);
                self.out.extend_from_slice(&b[..take]);
                n += take;
                if n == self.max {
                    break;
                }
            }
            Poll::Ready(Ok(n))
        }

        fn is_write_vectored(&self) -> bool {
            self.vectored
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn frames_of_pieces_arrive_whole_and_in_order_through_partial_writes() {
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 13 + i / 7) as u8).collect();
        let whole = Bytes::from(data);
        let cuts = [0, 1, 999, 1000, 4096, 20_000, 20_001, 50_000];
        let pieces: Vec<Bytes> = cuts.windows(2).map(|w| whole.slice(w[0]..w[1])).collect();
        for vectored in [true, false] {
            for (max, cap) in [(7, 64), (1000, 64), (4097, 8192), (1 << 20, 256 << 10)] {
                let mut w = BufWriter::with_capacity(cap, Trickle { out: Vec::new(), max, vectored });
                write_all_vectored(&mut w, b"head-1", &pieces).await.unwrap();
                write_all_vectored(&mut w, b"head-2", &[]).await.unwrap();
                write_all_vectored(&mut w, b"head-3", &pieces[2..4]).await.unwrap();
                w.flush().await.unwrap();
                let mut want = b"head-1".to_vec();
                want.extend_from_slice(&whole);
                want.extend_from_slice(b"head-2head-3");
                want.extend_from_slice(&whole[999..4096]);
                assert!(w.get_ref().out == want, "vectored {vectored}, {max} bytes a write, buffer {cap}");
            }
        }
    }
}
