//! The in-process transport: calls to an address served by a [`Router`] of this process are
//! answered by that router directly, through the same codec as over a connection (the request
//! encoded, decoded by the router's handler, its reply encoded and decoded back; file spans read
//! from their files), with no socket between. It lets a client and the services it talks to run
//! in one process, as unit tests of the client's caching and recall logic want; daemons and
//! mounts never use it.
//!
//! Owns the table of in-process routers by address; a [`crate::Pool`] given one
//! ([`crate::Pool::with_local`]) asks it first.

use crate::error::RpcError;
use crate::router::Router;
use odfs_proto::codec::{self, Frame, FRAME_FIXED};
use odfs_proto::{RequestHeader, Rpc};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Routers of this process by the address they answer for.
#[derive(Default)]
pub struct Local {
    routers: Mutex<HashMap<SocketAddr, Arc<Router>>>,
    next_call: AtomicU64,
}

impl Local {
    /// Calls to `addr` are answered by `router` from now on.
    pub fn serve(&self, addr: SocketAddr, router: Router) {
        self.routers.lock().expect("routers lock").insert(addr, Arc::new(router));
    }

    /// The router answering for `addr`, if one of this process does.
    pub(crate) fn router(&self, addr: SocketAddr) -> Option<Arc<Router>> {
        self.routers.lock().expect("routers lock").get(&addr).cloned()
    }

    /// `req` answered by `router`, encoded and decoded as over a connection.
    pub(crate) async fn call<R: Rpc>(
        &self,
        router: &Router,
        header: &RequestHeader,
        req: &R,
    ) -> Result<R::Reply, RpcError> {
        let call_id = self.next_call.fetch_add(1, Ordering::Relaxed) + 1;
        let frame = codec::encode_request(call_id, header, req)?;
        let body = &frame.head[4 + FRAME_FIXED..];
        let reply = router.dispatch(call_id, R::METHOD, body, frame.payload.contiguous()).await;
        let (kind, payload) = (reply.head[4], reply_bytes(&reply)?);
        Ok(codec::decode_reply::<R>(kind, &reply.head[4 + FRAME_FIXED..], payload)?)
    }
}

/// A reply frame's bytes after its body: its payload, then its file spans read from their files.
fn reply_bytes(f: &Frame) -> Result<Vec<u8>, RpcError> {
    let mut out = Vec::with_capacity(f.payload_len());
    for piece in f.payload.pieces() {
        out.extend_from_slice(piece);
    }
    for s in &f.spans {
        let at = out.len();
        out.resize(at + s.len as usize, 0);
        s.file
            .read_exact_at(&mut out[at..], s.offset)
            .map_err(|e| RpcError::Closed(format!("a reply's file span: {e}")))?;
    }
    Ok(out)
}
