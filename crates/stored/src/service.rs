//! stored's wire adapter and process life: serve chunk requests over QUIC and authenticated TCP,
//! register the targets with mgmtd and report their space at every heartbeat.

use crate::chunk_store::{ChunkStore, IoBackend, StoreOptions, TargetConfig};
use crate::config::StoredConfig;
use crate::StoreError;
use odfs_proto::mgmt::{Register, ServiceKind, TargetOffer};
use odfs_proto::storage::*;
use odfs_proto::RemoteError;
use odfs_rpc::quic::QuicEndpoint;
use odfs_rpc::{Router, Shutdown};
use odfs_service::{announce, Daemon};
use std::sync::Arc;
use std::time::Duration;
use tracing::info;

/// Reads of at least this many bytes are sent from the chunk file (`ChunkStore::read_span`:
/// sendfile on TCP, no copy into and out of a buffer of stored's); smaller ones are read into
/// a buffer, most often from the page cache without waiting (`ChunkStore::read`), which costs
/// less than the hand-off to a thread that a send from the file takes.
pub const SPAN_MIN: u32 = 64 << 10;

/// Maps stored's requests to the chunk store.
pub fn router(store: ChunkStore) -> Router {
    let mut r = Router::new();
    let s = store.clone();
    r.add::<WriteChunk, _, _>(move |_h, q: WriteChunk| {
        let s = s.clone();
        // The payload's own buffer, as the transport received it (aligned for a direct write).
        let data = q.data.contiguous();
        // The CRC of the bytes as they arrived, before they are handed to the disk.
        let crc32c = q.crc.then(|| odfs_proto::crc::checksum(&data));
        async move {
            let len = s.write(q.target, q.ino, q.offset, data, q.sync).await.map_err(RemoteError::from)?;
            Ok(Written { len, crc32c })
        }
    });
    let s = store.clone();
    r.add::<ReadChunk, _, _>(move |_h, q: ReadChunk| {
        let s = s.clone();
        async move {
            if q.len < SPAN_MIN {
                let data = s.read(q.target, q.ino, q.offset, q.len).await.map_err(RemoteError::from)?;
                return Ok(ChunkData { data, ..Default::default() });
            }
            let span = s.read_span(q.target, q.ino, q.offset, q.len).await.map_err(RemoteError::from)?;
            Ok(ChunkData { spans: span.into_iter().collect(), ..Default::default() })
        }
    });
    let s = store.clone();
    r.add::<ReadChunks, _, _>(move |_h, q: ReadChunks| {
        let s = s.clone();
        async move {
            let (lens, spans) = s.read_many(q.target, q.items).await.map_err(RemoteError::from)?;
            Ok(ChunksData { lens, spans, ..Default::default() })
        }
    });
    let s = store.clone();
    r.add::<TruncateChunk, _, _>(move |_h, q: TruncateChunk| {
        let s = s.clone();
        async move { s.truncate(q.target, q.ino, q.len).await.map_err(RemoteError::from) }
    });
    let s = store.clone();
    r.add::<PunchChunk, _, _>(move |_h, q: PunchChunk| {
        let s = s.clone();
        async move { s.punch(q.target, q.ino, q.offset, q.len).await.map_err(RemoteError::from) }
    });
    let s = store.clone();
    r.add::<SyncChunk, _, _>(move |_h, q: SyncChunk| {
        let s = s.clone();
        async move { s.sync(q.target, q.ino).await.map_err(RemoteError::from) }
    });
    let s = store.clone();
    r.add::<RemoveChunk, _, _>(move |_h, q: RemoveChunk| {
        let s = s.clone();
        async move { s.remove(q.target, q.ino).await.map_err(RemoteError::from) }
    });
    let s = store.clone();
    r.add::<StatTarget, _, _>(move |_h, q: StatTarget| {
        let s = s.clone();
        async move { s.space(q.target).map_err(RemoteError::from) }
    });
    let s = store;
    r.add::<StatChunk, _, _>(move |_h, q: StatChunk| {
        let s = s.clone();
        async move { s.stat_chunk(q.target, q.ino).await.map_err(RemoteError::from) }
    });
    r
}

/// The I/O engine a config names.
pub fn backend(name: &str) -> Result<IoBackend, StoreError> {
    Ok(match name {
        "auto" => IoBackend::Auto,
        "uring" | "io_uring" => IoBackend::Uring,
        "syscall" => IoBackend::Syscall,
        o => return Err(StoreError::Config(format!("io_backend {o:?} is unknown: use auto, uring or syscall"))),
    })
}

/// Runs stored until `shutdown` fires.
pub async fn run(cfg: StoredConfig, shutdown: Shutdown) -> Result<(), StoreError> {
    if cfg.targets.is_empty() {
        return Err(StoreError::Config("no targets configured".into()));
    }
    let cred = cfg.job.credential()?;
    let targets: Vec<TargetConfig> =
        cfg.targets.iter().map(|t| TargetConfig { id: t.id, path: t.path.clone() }).collect();
    let opts = StoreOptions {
        backend: backend(&cfg.io_backend)?,
        precreate: cfg.precreate_chunk_files,
        direct_write_min: cfg.direct_write_min_bytes,
        drop_behind: cfg.drop_behind_reads,
        ..StoreOptions::default()
    };
    let store = ChunkStore::open_with(&targets, opts)?;
    info!(backend = store.backend_name(), targets = targets.len(), "chunk store open");
    let endpoint = QuicEndpoint::server(&cred, cfg.listen)?;
    let addr = endpoint.local_addr()?;
    let bulk = match cfg.bulk_listen {
        Some(a) => Some(odfs_rpc::tcp::bind(a).await?),
        None => None,
    };
    let bulk_addr = bulk.as_ref().map(|l| l.local_addr()).transpose().map_err(odfs_rpc::RpcError::Io)?;
    if let Some(p) = &cfg.addr_file {
        let mut v = vec![("stored", addr)];
        if let Some(b) = bulk_addr {
            v.push(("bulk", b));
        }
        odfs_service::write_addr_file(p, &v).map_err(|e| StoreError::io("write", p.clone(), e))?;
    }
    let register_timeout = Duration::from_secs(cfg.register_timeout_secs);
    let daemon = Daemon::new(cred, cfg.mgmtd, register_timeout, Duration::from_secs(2), shutdown)?;
    let servers = daemon.serve(&endpoint, bulk, Arc::new(router(store.clone())));
    let mut offers = Vec::new();
    for t in &cfg.targets {
        let path = Some(t.path.display().to_string());
        offers.push(TargetOffer { id: t.id, pool: t.pool.clone(), space: store.space(t.id)?, path });
    }
    let register = Register { bulk_addr, targets: offers, ..announce(ServiceKind::Storage, cfg.node, addr) };
    let ids: Vec<u32> = cfg.targets.iter().map(|t| t.id).collect();
    let probe = Arc::new(move || ids.iter().filter_map(|&id| store.space(id).ok().map(|s| (id, s))).collect());
    Ok(daemon.run(servers, register, probe).await?)
}
