//! Client side: connections kept per peer and transport, and calls with retry.
//!
//! A retried call reuses its request header, so the server's idempotency table recognises it.
//!
//! **Lanes.** A thread that drives calls on a runtime of its own (odfs-fuse's reader threads,
//! each with a current-thread runtime) takes a lane with [`own_lane`]: its calls then go over
//! connections of that lane only, whose reading and writing run on that thread, so a reply
//! wakes the thread that waits for it and nothing else. Connections of lane 0 (every other
//! thread) are shared as before. A call started in a lane must be finished by that thread:
//! its connection makes progress only while the thread drives its runtime (a QUIC lane
//! connection also needs the endpoint's driver, on the runtime that made the pool).

use crate::quic::QuicEndpoint;
use crate::{Conn, JobCredential, RpcError};
use odfs_proto::{RequestHeader, Rpc};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::debug;

/// Which transport carries a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// QUIC with mutual TLS (every control and metadata call).
    #[default]
    Quic,
    /// TCP authenticated with the job credential (bulk chunk data).
    Tcp,
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "quic" => Ok(Transport::Quic),
            "tcp" => Ok(Transport::Tcp),
            o => Err(format!("unknown transport {o:?}: use quic or tcp")),
        }
    }
}

#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Longest wait for one reply.
    pub call_timeout: Duration,
    /// How long retryable failures are retried before the call fails.
    pub retry_deadline: Duration,
    /// Connections kept per peer and transport; calls rotate over them.
    pub conns_per_peer: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig { call_timeout: Duration::from_secs(60), retry_deadline: Duration::from_secs(30), conns_per_peer: 2 }
    }
}

type Slot = Arc<tokio::sync::Mutex<Option<Conn>>>;

thread_local! {
    /// This thread's lane; 0 = the shared connections.
    static LANE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Gives this thread a lane of its own (see the module doc); returns its number.
pub fn own_lane() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(1);
    LANE.with(|l| {
        if l.get() == 0 {
            l.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        l.get()
    })
}

/// Connections to every peer of one job.
pub struct Pool {
    cred: JobCredential,
    quic: QuicEndpoint,
    slots: Mutex<HashMap<(SocketAddr, Transport, usize, usize), Slot>>,
    next: AtomicUsize,
    cfg: PoolConfig,
    /// Routers of this process that answer calls instead of a connection (`crate::local`).
    local: Option<Arc<crate::Local>>,
}

impl Pool {
    pub fn new(cred: JobCredential, cfg: PoolConfig) -> Result<Pool, RpcError> {
        let quic = QuicEndpoint::client(&cred, "0.0.0.0:0".parse().expect("valid address"))?;
        Ok(Pool::with_endpoint(cred, quic, cfg))
    }

    /// A pool that connects out through an existing endpoint (a daemon's own).
    pub fn with_endpoint(cred: JobCredential, quic: QuicEndpoint, cfg: PoolConfig) -> Pool {
        Pool { cred, quic, slots: Mutex::new(HashMap::new()), next: AtomicUsize::new(0), cfg, local: None }
    }

    /// This pool's calls answered by the routers of `local` instead of connections: the
    /// in-process transport (an address none of them serves is refused, as a stopped
    /// service's would be).
    pub fn with_local(mut self, local: Arc<crate::Local>) -> Pool {
        self.local = Some(local);
        self
    }

    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    /// The job credential its connections prove.
    pub fn credential(&self) -> &JobCredential {
        &self.cred
    }

    /// A live connection to `addr`, made if needed: one of the shared ones, or the calling
    /// thread's own in a lane.
    ///
    /// A slot is made by one connect at a time, in a task of its own: a caller parked
    /// unpolled (one of several calls in a `FuturesUnordered` whose owner awaits another
    /// call) must never hold a slot that another call waits for, or both wait for ever.
    pub async fn conn(&self, addr: SocketAddr, transport: Transport) -> Result<Conn, RpcError> {
        let lane = LANE.with(|l| l.get());
        // One stream per peer is enough for a lane: its thread waits for each call in turn.
        let n = if lane > 0 { 1 } else { self.cfg.conns_per_peer.max(1) };
        let i = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let slot = {
            let mut slots = self.slots.lock().expect("pool lock");
            slots.entry((addr, transport, lane, i)).or_default().clone()
        };
        // The common case, no wait: the slot is free and holds a live connection.
        if let Ok(guard) = slot.try_lock() {
            if let Some(c) = guard.as_ref().filter(|c| !c.is_closed()) {
                return Ok(c.clone());
            }
        }
        let (quic, cred) = (self.quic.clone(), self.cred.clone());
        let task = tokio::spawn(async move {
            let mut guard = slot.lock().await;
            if let Some(c) = guard.as_ref().filter(|c| !c.is_closed()) {
                return Ok(c.clone());
            }
            let c = match transport {
                Transport::Quic => quic.connect(addr).await?,
                Transport::Tcp => crate::tcp::connect(&cred, addr).await?,
            };
            *guard = Some(c.clone());
            Ok(c)
        });
        task.await.map_err(|e| RpcError::Connect { addr, reason: format!("the connect task ended: {e}") })?
    }

    /// Calls `req` on `addr`, retrying transport failures with backoff until the retry deadline.
    pub async fn call<R: Rpc>(
        &self,
        addr: SocketAddr,
        transport: Transport,
        header: &RequestHeader,
        req: &R,
    ) -> Result<R::Reply, RpcError> {
        self.call_within(addr, transport, header, req, self.cfg.retry_deadline).await
    }

    /// [`Self::call`], retrying transport failures only until `retry_deadline` (a caller that
    /// looks elsewhere between tries: whether mgmtd still counts the peer online).
    pub async fn call_within<R: Rpc>(
        &self,
        addr: SocketAddr,
        transport: Transport,
        header: &RequestHeader,
        req: &R,
        retry_deadline: Duration,
    ) -> Result<R::Reply, RpcError> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(20);
        loop {
            let result = match &self.local {
                Some(local) => match local.router(addr) {
                    Some(router) => local.call(&router, header, req).await,
                    None => Err(RpcError::Connect { addr, reason: "no service of this process answers there".into() }),
                },
                None => match self.conn(addr, transport).await {
                    Ok(c) => c.call(header, req, self.cfg.call_timeout).await,
                    Err(e) => Err(e),
                },
            };
            match result {
                Err(e) if e.retryable() && start.elapsed() + backoff < retry_deadline => {
                    debug!(method = R::NAME, %addr, error = %e, "retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                other => return other,
            }
        }
    }

    /// Drops every connection.
    pub fn close_all(&self) {
        let slots: Vec<Slot> = self.slots.lock().expect("pool lock").drain().map(|(_, s)| s).collect();
        for s in slots {
            if let Ok(g) = s.try_lock() {
                if let Some(c) = g.as_ref() {
                    c.close();
                }
            }
        }
        self.quic.close();
    }
}
