//! `MetaStore`: the namespace made durable and idempotent.
//!
//! Owns the store directory (`snapshot` + `wal`), the sequence of logged mutations, the table
//! of recent replies that makes retries idempotent; it asks `placement` for new files' targets
//! and `sessions` for leases, recalls and locks. A mutation is applied in memory, then logged as one record carrying everything a
//! replay needs (caller, time, the new inode id, the chosen layout), then acknowledged.
//! Recovery loads the snapshot and re-applies the log records that follow it.

use crate::inode::IdHasher;
use crate::namespace::{wrong_reply, Changes, Choice, Intent, IntentKind, Namespace};

pub use crate::namespace::{Found, MetaOp, MetaReply, Mutation};
mod leases;

use crate::permission;
use crate::placement::Placement;
pub use crate::placement::{TargetChoice, NO_ONLINE_TARGETS};
use crate::sessions::{Sessions, Wait};
use crate::wal::{self, Wal, LOG_FILE};
use crate::{snapshot, MetaError};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::locks::Request as LockRequest;
use odfs_proto::meta::*;
use odfs_proto::{DirLayout, InodeId, Layout, RequestHeader, Timespec};
use serde::ser::SerializeSeq;
use serde::{Deserialize, Serialize, Serializer};
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::path::{Path, PathBuf};
use tracing::{info, warn};

/// Most supplementary groups a request may carry (Linux `NGROUPS_MAX`); bounds log records.
const MAX_GROUPS: usize = 65536;
/// Replies waiting for recalls, at most (more means requests whose handler never asked).
const MAX_PENDING: usize = 65536;
/// Inode total reported by statfs: ids are plentiful, memory is the real limit.
const STATFS_INODES: u64 = 1 << 32;
/// Block size reported by statfs.
const STATFS_BLOCK: u32 = 4096;

/// How a [`MetaStore`] behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// The shard whose namespace this is: the high 16 bits of new inode ids.
    pub shard: u16,
    /// fdatasync the log after every record (survives power loss, not only process death).
    pub sync_wal: bool,
    /// Write a snapshot and start a new log once the log grows past this many bytes.
    pub snapshot_every_bytes: u64,
    /// Replies remembered for retried requests.
    pub dedup_capacity: usize,
    /// Only root may set directory and file layouts (a site's choice; owners may by default).
    pub root_only_layouts: bool,
    /// A client silent this long has lost its session (what it held open is released).
    pub lease: std::time::Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            shard: 0,
            sync_wal: false,
            snapshot_every_bytes: 64 << 20,
            dedup_capacity: 262_144,
            root_only_layouts: false,
            lease: std::time::Duration::from_secs(30),
        }
    }
}

type DedupKey = (u64, u64);

/// Replies of recent mutations by `(client_id, request_id)`, oldest evicted first.
struct Dedup {
    capacity: usize,
    order: VecDeque<DedupKey>,
    replies: HashMap<DedupKey, MetaReply, BuildHasherDefault<IdHasher>>,
}

impl Dedup {
    fn new(capacity: usize) -> Dedup {
        Dedup { capacity, order: VecDeque::new(), replies: HashMap::default() }
    }

    fn get(&self, key: DedupKey) -> Option<&MetaReply> {
        self.replies.get(&key)
    }

    fn insert(&mut self, key: DedupKey, reply: MetaReply) {
        if self.capacity == 0 {
            return;
        }
        if self.replies.insert(key, reply).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.replies.remove(&old);
            }
        }
    }
}

/// The dedup table in a snapshot: `(client_id, request_id, reply)`, oldest first.
struct DedupImage<'a>(&'a Dedup);

impl Serialize for DedupImage<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.order.len()))?;
        for key in &self.0.order {
            if let Some(reply) = self.0.replies.get(key) {
                seq.serialize_element(&(key.0, key.1, reply))?;
            }
        }
        seq.end()
    }
}

/// What a snapshot holds (writing side; `State` reads it back — same field order).
#[derive(Serialize)]
struct StateRef<'a> {
    seq: u64,
    ns: &'a Namespace,
    dedup: DedupImage<'a>,
}

#[derive(Deserialize)]
struct State {
    seq: u64,
    ns: Namespace,
    dedup: Vec<(u64, u64, MetaReply)>,
}

/// A log record as written; `Record` reads it back (same shape, owned).
#[derive(Serialize)]
struct RecordRef<'a> {
    seq: u64,
    header: &'a RequestHeader,
    /// The time the mutation used as "now".
    now: Timespec,
    op: OpRef<'a>,
    /// Inode id given to a new inode.
    ino: Option<InodeId>,
    /// Layout chosen for a new file.
    layout: Option<&'a Layout>,
    /// Inodes kept as orphans (held open when their last link went).
    kept: &'a [InodeId],
}

#[derive(Serialize)]
enum OpRef<'a> {
    Meta(&'a MetaOp),
    CreateRoot(&'a DirLayout),
}

#[derive(Deserialize)]
struct Record {
    seq: u64,
    header: RequestHeader,
    now: Timespec,
    op: LoggedOp,
    ino: Option<InodeId>,
    layout: Option<Layout>,
    kept: Vec<InodeId>,
}

#[derive(Deserialize)]
enum LoggedOp {
    Meta(MetaOp),
    CreateRoot(DirLayout),
}

/// The choices a live mutation made, read from its reply, for its log record.
fn resolved<'a>(op: &MetaOp, reply: &'a MetaReply) -> (Option<InodeId>, Option<&'a Layout>) {
    match (op, reply) {
        (MetaOp::Create(_), MetaReply::Create(r)) if r.created => (Some(r.attr.ino), r.attr.layout.as_ref()),
        (MetaOp::Mkdir(_) | MetaOp::Symlink(_) | MetaOp::Mknod(_), MetaReply::Attr(a)) => (Some(a.ino), None),
        (MetaOp::SetFileLayout(_), MetaReply::Attr(a)) => (None, a.layout.as_ref()),
        _ => (None, None),
    }
}

/// A lock request of the caller's client, its range checked.
fn lock_request(
    h: &RequestHeader,
    owner: u64,
    pid: u32,
    kind: LockKind,
    start: u64,
    end: u64,
) -> RpcResult<LockRequest> {
    if start > end {
        return Err(RemoteError::new(ErrorCode::Invalid, format!("lock range {start}..={end} is empty")));
    }
    Ok(LockRequest { client: h.client_id, owner, pid, kind, start, end })
}

/// A store shared by the service's handlers, under one lock.
pub type Shared = std::sync::Arc<std::sync::Mutex<MetaStore>>;

/// The namespace of one shard with its write-ahead log and dedup table.
///
/// Not internally synchronized: reads take `&self`, mutations `&mut self`.
pub struct MetaStore {
    dir: PathBuf,
    opts: StoreOptions,
    ns: Namespace,
    placement: Placement,
    wal: Wal,
    /// Sequence number of the last logged mutation.
    seq: u64,
    dedup: Dedup,
    /// Log size at which the next automatic snapshot is due.
    snapshot_at: u64,
    /// Why mutations are refused, after a failure that left memory ahead of the log.
    failed: Option<String>,
    /// The root directory was created by this open (a new filesystem).
    root_created: bool,
    /// Which clients hold which inodes open, and their leases (not logged).
    sessions: Sessions,
    /// What the replies to changes wait for (shared with the service: every request asks).
    pending: PendingReplies,
}

/// What the replies to changes wait for, by request (client id, request id). Its own lock, so
/// that a request asking after itself needs no store lock.
pub(crate) type PendingReplies = std::sync::Arc<std::sync::Mutex<HashMap<(u64, u64), Pending>>>;

/// What a change's reply waits for before it goes out.
#[derive(Default)]
pub(crate) struct Pending {
    /// Acknowledgements of the recalls the change caused.
    pub waits: Vec<Wait>,
    /// The end of a restarted shard's grace: clients may cache what the shard leased before.
    pub grace: Option<std::time::Instant>,
}

impl MetaStore {
    /// Opens the store in `dir`, creating it if needed: loads the snapshot, replays the log
    /// after it (a torn tail is discarded) and, on first open, creates the root directory
    /// (mode 0755, owner 0:0) with `root_default` as its default layout.
    pub fn open(dir: &Path, opts: StoreOptions, root_default: DirLayout) -> Result<MetaStore, MetaError> {
        let lease = opts.lease;
        root_default.validate().map_err(MetaError::InvalidRootLayout)?;
        std::fs::create_dir_all(dir).map_err(|e| MetaError::io("create directory", dir, e))?;
        snapshot::remove_leftovers(dir);
        wal::remove_leftovers(dir);
        let (mut seq, mut ns, mut dedup) = match snapshot::read::<State>(dir)? {
            Some(st) => {
                if st.ns.shard() != opts.shard {
                    return Err(MetaError::ShardMismatch {
                        path: dir.to_owned(),
                        found: st.ns.shard(),
                        expected: opts.shard,
                    });
                }
                let mut dedup = Dedup::new(opts.dedup_capacity);
                for (c, r, reply) in st.dedup {
                    dedup.insert((c, r), reply);
                }
                let mut ns = st.ns;
                ns.recount();
                (st.seq, ns, dedup)
            }
            None => (0, Namespace::new(opts.shard), Dedup::new(opts.dedup_capacity)),
        };
        let snapshot_seq = seq;
        let log = dir.join(LOG_FILE);
        let has_log = log.try_exists().map_err(|e| MetaError::io("stat", &log, e))?;
        let wal = if has_log {
            let scan = wal::scan(&log, |offset, payload| {
                let rec: Record = postcard::from_bytes(payload).map_err(|e| MetaError::CorruptLog {
                    path: log.clone(),
                    offset,
                    reason: format!("undecodable record: {e}"),
                })?;
                replay(&mut ns, &mut dedup, &mut seq, rec, &log, offset)
            })?;
            if scan.discarded > 0 {
                warn!(
                    path = %log.display(),
                    bytes = scan.discarded,
                    "discarded a torn or damaged tail of the write-ahead log"
                );
            }
            info!(snapshot_seq, records = scan.records, replayed = seq - snapshot_seq, "replayed the write-ahead log");
            if scan.valid_len == 0 {
                Wal::create(dir, opts.sync_wal)?
            } else {
                Wal::open(&log, scan.valid_len, opts.sync_wal)?
            }
        } else {
            Wal::create(dir, opts.sync_wal)?
        };
        let mut store = MetaStore {
            dir: dir.to_owned(),
            snapshot_at: opts.snapshot_every_bytes,
            opts,
            ns,
            placement: Placement::new(),
            wal,
            seq,
            dedup,
            failed: None,
            root_created: false,
            sessions: Sessions::new(lease),
            pending: PendingReplies::default(),
        };
        if !store.ns.has_root() {
            store.create_root(root_default)?;
            store.root_created = true;
        } else {
            store.sessions.start_grace();
        }
        info!(
            dir = %store.dir.display(),
            shard = store.opts.shard,
            inodes = store.ns.inode_count(),
            seq = store.seq,
            "metadata store open"
        );
        Ok(store)
    }

    fn create_root(&mut self, layout: DirLayout) -> Result<(), MetaError> {
        let now = Timespec::now();
        self.ns.create_root(now, layout.clone()).map_err(|e| MetaError::Failed(e.to_string()))?;
        self.seq += 1;
        let header = RequestHeader::default();
        self.wal.append(&RecordRef {
            seq: self.seq,
            header: &header,
            now,
            op: OpRef::CreateRoot(&layout),
            ino: None,
            layout: None,
            kept: &[],
        })
    }

    /// Replaces the targets new files are placed on (not logged: it comes from mgmtd).
    pub fn set_targets(&mut self, targets: Vec<TargetChoice>) {
        self.placement.set(targets);
    }

    // ---- operations spanning shards, coordinated here ----

    /// Logs the intent of an operation spanning shards; returns its id. `Busy` while the same
    /// request runs already (a client's retry).
    pub(crate) fn begin_intent(
        &mut self,
        h: &RequestHeader,
        kind: IntentKind,
        steps: Vec<(u16, StepChange)>,
    ) -> RpcResult<u64> {
        let request = (h.client_id, h.request_id);
        if h.request_id != 0 {
            self.refuse_running(request)?;
        }
        let id = ((self.opts.shard as u64) << 48) | (self.seq + 1);
        let intent = Intent { request, caller: (h.uid, h.gid, h.groups.clone()), steps, decided: false, kind };
        self.mutate(&RequestHeader::default(), MetaOp::BeginIntent { id, intent })?;
        Ok(id)
    }

    /// `Busy` while an intent carries out `request` already. A retry must not run it again:
    /// its first steps may have committed (the source name gone, so a rename would answer
    /// "no such name") while its reply is not recorded yet.
    fn refuse_running(&self, request: DedupKey) -> RpcResult<()> {
        if self.ns.intents.values().any(|i| i.request == request) {
            return Err(RemoteError::new(ErrorCode::Busy, "this request is being carried out; try again"));
        }
        Ok(())
    }

    /// Logs the decision to commit an intent.
    pub(crate) fn decide_intent(&mut self, id: u64) -> RpcResult<()> {
        self.mutate(&RequestHeader::default(), MetaOp::DecideIntent { id }).map(drop)
    }

    /// Whether the intent `id` is open and decided (it must be committed to its end).
    pub(crate) fn intent_decided(&self, id: u64) -> bool {
        self.ns.intents.get(&id).is_some_and(|i| i.decided)
    }

    /// Logs an intent's end; a reply becomes the answer to its client's retries.
    pub(crate) fn end_intent(&mut self, id: u64, reply: Option<MetaReply>) -> RpcResult<()> {
        let Some(i) = self.ns.intents.get(&id) else { return Ok(()) };
        let h = match reply {
            Some(_) => RequestHeader { client_id: i.request.0, request_id: i.request.1, ..RequestHeader::default() },
            None => RequestHeader::default(),
        };
        self.mutate(&h, MetaOp::EndIntent { id, reply: reply.map(Box::new) }).map(drop)
    }

    /// The intents not yet ended.
    pub(crate) fn intents(&self) -> Vec<(u64, Intent)> {
        self.ns.intents.iter().map(|(k, v)| (*k, v.clone())).collect()
    }

    /// The parent of a directory held here.
    pub fn parent_of(&self, _h: &RequestHeader, req: &ParentOf) -> RpcResult<InodeId> {
        self.ns.parent_of(req.ino)
    }

    /// How many metadata shards the filesystem has (from mgmtd).
    pub fn set_shards_total(&mut self, n: u16) {
        self.ns.shards_total = n;
    }

    /// The shard this store serves.
    pub fn shard(&self) -> u16 {
        self.opts.shard
    }

    /// Sequence number of the last logged mutation.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Number of inodes, the root included.
    pub fn inode_count(&self) -> u64 {
        self.ns.inode_count()
    }

    /// Bytes in the current log.
    pub fn log_len(&self) -> u64 {
        self.wal.len()
    }

    /// Why the store refuses mutations, if it does (after a failed log write).
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    // ---- reads ----

    /// Looks up `name` in a directory (needs search permission on it): what it names, here or
    /// on another shard.
    pub fn resolve_name(&self, h: &RequestHeader, req: &Lookup) -> RpcResult<Found> {
        self.ns.lookup(h, req)
    }

    /// The attributes of what `name` names in a directory, when that inode is this shard's
    /// (`SpansShards` otherwise).
    pub fn lookup(&self, h: &RequestHeader, req: &Lookup) -> RpcResult<Attr> {
        match self.ns.lookup(h, req)? {
            Found::Here(a) => Ok(a),
            Found::Remote(ino) => Err(crate::namespace::spans_shards(ino)),
        }
    }

    /// The attributes of an inode.
    pub fn getattr(&self, _h: &RequestHeader, req: &GetAttr) -> RpcResult<Attr> {
        self.ns.getattr(req.ino)
    }

    /// Checks the caller's access to an inode, as access(2).
    pub fn access(&self, h: &RequestHeader, req: &Access) -> RpcResult<()> {
        self.ns.access(h, req)
    }

    /// Checks that the caller may open the inode for reading and/or writing (the `Open`
    /// request; `open` is taken by the constructor). The service registers the open
    /// (`register_open`) when asked.
    pub fn open_file(&self, h: &RequestHeader, req: &Open) -> RpcResult<Attr> {
        self.ns.open(h, req)
    }

    /// Ends the sessions of silent clients and removes every orphan nobody holds open any more;
    /// returns the removed orphans (their chunks are the caller's to remove).
    pub fn collect_orphans(&mut self) -> Vec<Attr> {
        self.sessions.expire();
        let unheld: Vec<InodeId> = self.ns.orphans.iter().copied().filter(|&i| !self.sessions.held(i)).collect();
        let mut removed = Vec::new();
        for ino in unheld {
            match self.drop_orphan(ino) {
                Ok(a) => removed.extend(a),
                Err(e) => warn!(%ino, error = %e, "cannot remove an orphan"),
            }
        }
        removed
    }

    fn drop_orphan(&mut self, ino: InodeId) -> RpcResult<Option<Attr>> {
        match self.mutate(&RequestHeader::default(), MetaOp::DropOrphan { ino })? {
            MetaReply::Orphan(a) => Ok(a),
            other => Err(wrong_reply("DropOrphan", &other)),
        }
    }

    /// Lists a directory after `req.cookie` (needs read permission on it); "." and ".." are not
    /// included.
    pub fn readdir(&self, h: &RequestHeader, req: &ReadDir) -> RpcResult<ReadDirReply> {
        self.ns.readdir(h, req)
    }

    /// The target of a symbolic link.
    pub fn readlink(&self, _h: &RequestHeader, req: &Readlink) -> RpcResult<Vec<u8>> {
        self.ns.readlink(req.ino)
    }

    /// One extended attribute (needs read permission).
    pub fn getxattr(&self, h: &RequestHeader, req: &GetXattr) -> RpcResult<Vec<u8>> {
        self.ns.getxattr(h, req)
    }

    /// The names of an inode's extended attributes, sorted.
    pub fn listxattr(&self, _h: &RequestHeader, req: &ListXattr) -> RpcResult<Vec<Vec<u8>>> {
        self.ns.listxattr(req)
    }

    /// Space of the online targets and inode usage of this shard.
    pub fn statfs(&self, _h: &RequestHeader, _req: &StatFs) -> RpcResult<StatFsReply> {
        let (total, free) = self.placement.space();
        let used = self.ns.inode_count();
        let total_inodes = STATFS_INODES.max(used);
        Ok(StatFsReply {
            total_bytes: total,
            free_bytes: free,
            total_inodes,
            free_inodes: total_inodes - used,
            used_inodes: used,
            block_size: STATFS_BLOCK,
        })
    }

    /// The default layout a directory gives new children.
    pub fn get_dir_layout(&self, _h: &RequestHeader, req: &GetDirLayout) -> RpcResult<DirLayout> {
        self.ns.get_dir_layout(req.ino)
    }

    /// Entries of the part of a directory held by this shard.
    pub fn count_entries(&self, _h: &RequestHeader, req: &CountEntries) -> RpcResult<u64> {
        self.ns.count_entries(req.ino)
    }

    /// A directory's attributes, parent, default layout and entry count (for its parts on
    /// other shards).
    pub fn dir_info(&self, ino: InodeId) -> RpcResult<(Attr, InodeId, DirLayout, usize)> {
        self.ns.dir_info(ino)
    }

    // ---- mutations ----

    /// Applies one mutation and makes it durable before returning `Ok`.
    ///
    /// A request already answered (same `client_id` and non-zero `request_id`) gets its
    /// recorded reply without being applied again; one still being carried out as an operation
    /// spanning shards (a retry after this metad restarted mid-way, its intent not yet
    /// redriven to its end) gets `Busy`, so the client asks again until that reply is recorded.
    /// A failed mutation changes nothing.
    /// The reply is typed by the mutation (`Mutation::Reply`).
    pub fn mutate<M: Mutation>(&mut self, h: &RequestHeader, m: M) -> RpcResult<M::Reply> {
        let reply = self.mutate_as(h, m.into_op(), Choice::default(), Timespec::now())?;
        M::reply(reply)
    }

    /// `mutate` with choices made already and the time given: a client's deferred change,
    /// made under a create delegation (see `apply_deferred`).
    fn mutate_as(&mut self, h: &RequestHeader, op: MetaOp, mut choice: Choice, now: Timespec) -> RpcResult<MetaReply> {
        let key = (h.client_id, h.request_id);
        if h.request_id != 0 {
            if let Some(reply) = self.dedup.get(key) {
                return Ok(reply.clone());
            }
            // (An intent's end is logged under its request, to record the reply.)
            if !matches!(op, MetaOp::EndIntent { .. }) {
                self.refuse_running(key)?;
            }
        }
        if let Some(why) = &self.failed {
            return Err(RemoteError::new(ErrorCode::Io, format!("the metadata store refuses changes: {why}")));
        }
        if h.groups.len() > MAX_GROUPS {
            return Err(RemoteError::new(
                ErrorCode::Invalid,
                format!("request carries {} groups; the limit is {MAX_GROUPS}", h.groups.len()),
            ));
        }
        match &op {
            MetaOp::SetDirLayout(SetDirLayout { layout, .. }) | MetaOp::SetFileLayout(SetFileLayout { layout, .. }) => {
                if self.opts.root_only_layouts && !h.is_root() {
                    return Err(RemoteError::new(ErrorCode::Perm, "this site lets only root change layouts"));
                }
                self.placement.check(layout)?;
            }
            _ => {}
        }
        let placement = &mut self.placement;
        let sessions = &self.sessions;
        // A step of an operation spanning shards is the asking client's change, not the
        // coordinator's. A file leased to another client may be open there (opens answered
        // from its cache): it stays an orphan until that client's answer to the recall says.
        let requester = match &op {
            MetaOp::Step(s) if s.client != 0 => s.client,
            _ => h.client_id,
        };
        let held = |i| sessions.held(i) || sessions.leased_by_other(i, requester);
        let applied = self.ns.apply(h, now, &op, &mut choice, &mut |dl, node| placement.choose(dl, node), &held)?;
        if !applied.changed {
            return Ok(applied.reply);
        }
        let (ino, layout) = resolved(&op, &applied.reply);
        let record =
            RecordRef { seq: self.seq + 1, header: h, now, op: OpRef::Meta(&op), ino, layout, kept: &applied.kept };
        if let Err(e) = self.wal.append(&record) {
            return Err(self.log_failed(e));
        }
        self.seq += 1;
        if h.request_id != 0 {
            self.dedup.insert(key, applied.reply.clone());
        }
        self.recall(h, requester, &applied.changes);
        if self.wal.len() >= self.snapshot_at {
            if let Err(e) = self.snapshot() {
                warn!(error = %e, "automatic snapshot failed");
                self.snapshot_at = self.wal.len() + self.opts.snapshot_every_bytes;
            }
        }
        Ok(applied.reply)
    }

    /// Grants the caller's client a create delegation on `q.dir` (see `DelegateCreates`): ids
    /// reserved (logged) and a layout chosen for each. `InUse` when another client caches the
    /// directory; the client then creates as usual.
    pub fn delegate_creates(&mut self, h: &RequestHeader, q: &DelegateCreates) -> RpcResult<CreateDelegation> {
        const MAX_DELEGATED: u32 = 4096;
        let busy = |why: &str| Err(RemoteError::new(ErrorCode::InUse, why.to_string()));
        if !self.sessions.may_delegate(h.client_id, q.dir) {
            return busy("another client caches this directory, or this client has no caching session");
        }
        let (node, dir) = self.ns.dir_node(q.dir)?;
        if node.sealed {
            return Err(RemoteError::new(ErrorCode::ReadOnly, format!("directory {} is sealed", q.dir)));
        }
        if dir.stripes.len() > 1 || dir.closing {
            return busy("the directory is striped over metadata shards");
        }
        permission::require(h, node, q.dir, permission::MAY_WRITE | permission::MAY_EXEC)?;
        let (parent, dir_layout, attr) = (dir.parent, dir.layout.clone(), node.attr(q.dir));
        let count = q.count.clamp(1, MAX_DELEGATED);
        let layouts = (0..count).map(|_| self.placement.choose(&dir_layout, q.node)).collect::<RpcResult<Vec<_>>>()?;
        let first = match self.mutate(h, MetaOp::ReserveInodes { count })? {
            MetaReply::Reserved(first) => first,
            other => return Err(wrong_reply("ReserveInodes", &other)),
        };
        self.sessions.delegate(h.client_id, q.dir, parent);
        let inos = layouts
            .into_iter()
            .enumerate()
            .map(|(i, l)| (InodeId::new(first.shard(), first.local() + i as u64), l))
            .collect();
        Ok(CreateDelegation { inos, dir: attr })
    }

    /// Applies one deferred change of a client's `CreateBatch` as its own request: a create
    /// with the id and layout the client took from its reservation, at the client's time, a
    /// size published at close, or an unlink of a file made under the delegation. Its header
    /// is the entry's caller with the batch's client; returned with the change's reply.
    pub fn apply_deferred(&mut self, batch: &RequestHeader, e: &Deferred) -> RpcResult<(RequestHeader, MetaReply)> {
        let h = match e {
            Deferred::Create { caller, .. } | Deferred::Unlink { caller, .. } => {
                RequestHeader { client_id: batch.client_id, ..caller.clone() }
            }
            Deferred::Size { request_id, .. } => {
                RequestHeader { client_id: batch.client_id, request_id: *request_id, ..RequestHeader::default() }
            }
        };
        // Applied already (the batch was sent again after its answer was lost): the reply
        // recorded then.
        if let Some(reply) = self.dedup.get((h.client_id, h.request_id)) {
            return Ok((h, reply.clone()));
        }
        let (op, choice, now) = match e {
            Deferred::Create { parent, name, mode, ino, layout, now, .. } => {
                if !self.ns.allocated(*ino) || self.ns.node(*ino).is_ok() {
                    return Err(RemoteError::new(
                        ErrorCode::Invalid,
                        format!("inode {ino} of \"{}\" is not an unused reserved id", String::from_utf8_lossy(name)),
                    ));
                }
                let create = Create {
                    parent: *parent,
                    name: name.clone(),
                    mode: *mode,
                    exclusive: true,
                    layout: None,
                    register: false,
                    node: None,
                };
                let choice = Choice { ino: Some(*ino), layout: Some(layout.clone()) };
                (MetaOp::Create(create), choice, *now)
            }
            Deferred::Size { ino, size, mtime, .. } => {
                (MetaOp::ExtendSize(ExtendSize { ino: *ino, size: *size, mtime: *mtime }), Choice::default(), *mtime)
            }
            Deferred::Unlink { parent, name, ino, ctime, now, .. } => {
                let shown = String::from_utf8_lossy(name);
                let named = self.ns.dir_node(*parent).ok().and_then(|(_, d)| d.get(name));
                if named != Some(*ino) {
                    return Err(RemoteError::new(
                        ErrorCode::NotFound,
                        format!("\"{shown}\" no longer names inode {ino}"),
                    ));
                }
                // As a create that conflicts is refused: the file changed since the client saw
                // it (another client wrote, chmod'ed or linked it while this one was cut off).
                if self.ns.node(*ino).is_ok_and(|n| n.ctime != *ctime || n.nlink != 1) {
                    return Err(RemoteError::new(
                        ErrorCode::InUse,
                        format!("\"{shown}\" changed since it was unlinked"),
                    ));
                }
                let unlink = Unlink { parent: *parent, name: name.clone() };
                (MetaOp::Unlink(unlink), Choice::default(), *now)
            }
        };
        let reply = self.mutate_as(&h, op, choice, now)?;
        Ok((h, reply))
    }

    /// Starts writing log records as one group (see `Wal::begin_group`): for a batch of
    /// deferred changes, whose answer goes out after `end_log_group`.
    pub fn begin_log_group(&mut self) {
        self.wal.begin_group();
    }

    /// Writes the group's log records. On failure memory is ahead of the log: changes are
    /// refused from now on, as after any failed append.
    pub fn end_log_group(&mut self) -> RpcResult<()> {
        self.wal.end_group().map_err(|e| self.log_failed(e))
    }

    /// A log write failed: memory is now ahead of the log, so further changes are refused
    /// until a restart recovers from the log. Returns the error to answer with.
    fn log_failed(&mut self, e: MetaError) -> RemoteError {
        let why = e.to_string();
        tracing::error!(error = %why, "write-ahead log append failed; refusing changes");
        self.failed = Some(why.clone());
        RemoteError::new(ErrorCode::Io, why)
    }

    /// `UnlinkIdle`, once `recall_inode` has been answered: removes the name if it still names
    /// `q.ino`, unchanged (one link, same size and mtime), held open by no client and cached by
    /// no other; `InUse` otherwise. Checked and done under one lock, so no open comes between.
    pub fn unlink_idle(&mut self, h: &RequestHeader, q: &UnlinkIdle) -> RpcResult<UnlinkReply> {
        // A request sent again (its answer was lost) gets the answer it had.
        if h.request_id != 0 {
            if let Some(reply) = self.dedup.get((h.client_id, h.request_id)) {
                return Unlink::reply(reply.clone());
            }
        }
        let busy = |why: &str| Err(RemoteError::new(ErrorCode::InUse, why.to_string()));
        let (ino, victim) = self.ns.check_delete(h, q.parent, &q.name).map_err(|e| match e.code {
            ErrorCode::SpansShards => {
                RemoteError::new(ErrorCode::Unsupported, "the file lives on another metadata shard; it is kept")
            }
            _ => e,
        })?;
        let a = victim.attr(ino);
        if ino != q.ino || a.nlink != 1 || a.size != q.size || a.mtime != q.mtime {
            return busy("the file changed since it was uploaded");
        }
        if self.sessions.held(ino) || self.sessions.leased_by_other(ino, h.client_id) {
            return busy("the file is open (or was looked up again) on a node");
        }
        self.mutate(h, Unlink { parent: q.parent, name: q.name.clone() })
    }

    /// Recalls what a logged change broke from other clients' caches and leases the change's
    /// inodes to the client that made it (it caches what its reply told it). Its reply then
    /// waits for the recalls (see `pending_replies`).
    fn recall(&mut self, h: &RequestHeader, requester: u64, changes: &Changes) {
        let waits = self.sessions.recall(requester, &changes.inos, &changes.names);
        for &ino in &changes.inos {
            match self.ns.node(ino) {
                Ok(n) if n.is_dir() => {
                    self.sessions.grant(requester, [ino]);
                    self.sessions.grant_names(requester, ino);
                    if let Some(d) = n.dir() {
                        // Its holder may have moved a delegated directory.
                        self.sessions.delegated_moved(ino, d.parent);
                    }
                }
                Ok(n) if n.nlink > 0 => self.sessions.grant(requester, [ino]),
                // Gone, or an orphan: nothing to cache (nor to create in).
                _ => {
                    self.sessions.end_lease(requester, ino);
                    self.sessions.end_delegations_of(requester, &[ino]);
                }
            }
        }
        let grace = self.sessions.grace_end();
        if h.client_id == 0 || (waits.is_empty() && grace.is_none()) {
            return;
        }
        let mut pending = self.pending.lock().expect("pending lock");
        if pending.len() > MAX_PENDING {
            // Requests whose handler never asked (internal changes): their recalls stay queued,
            // nobody waits for them.
            pending.clear();
        }
        let p = pending.entry((h.client_id, h.request_id)).or_default();
        p.waits.extend(waits);
        p.grace = grace;
    }

    /// True when this open created the root directory (a new, empty filesystem).
    pub fn root_created(&self) -> bool {
        self.root_created
    }

    /// Sets the root directory's owner, group and mode (logged; no permission check).
    pub fn set_root_owner(&mut self, uid: u32, gid: u32, mode: u32) -> RpcResult<Attr> {
        match self.mutate(&RequestHeader::default(), MetaOp::SetRootOwner { uid, gid, mode })? {
            MetaReply::Attr(a) => Ok(a),
            other => Err(wrong_reply("SetRootOwner", &other)),
        }
    }

    /// Writes a snapshot of the whole state and starts a new, empty log. Called automatically
    /// as the log grows, and at clean shutdown so the next start replays nothing.
    pub fn snapshot(&mut self) -> Result<(), MetaError> {
        if let Some(why) = &self.failed {
            return Err(MetaError::Failed(why.clone()));
        }
        let started = std::time::Instant::now();
        let bytes =
            snapshot::write(&self.dir, &StateRef { seq: self.seq, ns: &self.ns, dedup: DedupImage(&self.dedup) })?;
        // The snapshot is durable; the old log's records are all at or below its sequence
        // number, so replacing the log loses nothing even if we crash midway.
        match Wal::create(&self.dir, self.opts.sync_wal) {
            Ok(w) => self.wal = w,
            Err(e) => {
                self.failed = Some(format!("cannot start a new log after a snapshot: {e}"));
                return Err(e);
            }
        }
        self.snapshot_at = self.opts.snapshot_every_bytes;
        info!(
            seq = self.seq,
            inodes = self.ns.inode_count(),
            bytes,
            ms = started.elapsed().as_millis() as u64,
            path = %self.wal.path().display(),
            "snapshot written"
        );
        Ok(())
    }
}

/// Re-applies one log record during recovery.
fn replay(
    ns: &mut Namespace,
    dedup: &mut Dedup,
    seq: &mut u64,
    rec: Record,
    path: &Path,
    offset: u64,
) -> Result<(), MetaError> {
    if rec.seq <= *seq {
        // Already in the snapshot (a crash between writing it and starting a new log).
        return Ok(());
    }
    if rec.seq != *seq + 1 {
        return Err(MetaError::CorruptLog {
            path: path.to_owned(),
            offset,
            reason: format!("record {} follows record {}", rec.seq, *seq),
        });
    }
    let failed = |e: RemoteError| MetaError::Replay { path: path.to_owned(), seq: rec.seq, reason: e.to_string() };
    match &rec.op {
        LoggedOp::Meta(op) => {
            let mut choice = Choice { ino: rec.ino, layout: rec.layout };
            let kept = rec.kept;
            let mut no_layout = |_: &DirLayout, _| {
                Err(RemoteError::new(ErrorCode::Internal, "the log record lacks the layout chosen for the new file"))
            };
            let applied = ns
                .apply(&rec.header, rec.now, op, &mut choice, &mut no_layout, &|i| kept.contains(&i))
                .map_err(failed)?;
            if rec.header.request_id != 0 {
                dedup.insert((rec.header.client_id, rec.header.request_id), applied.reply);
            }
        }
        LoggedOp::CreateRoot(layout) => {
            ns.create_root(rec.now, layout.clone()).map_err(failed)?;
        }
    }
    *seq = rec.seq;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_encodings_agree() {
        let h = RequestHeader { request_id: 7, client_id: 9, uid: 1, gid: 2, groups: vec![3, 4] };
        let op = MetaOp::Mkdir(Mkdir { parent: InodeId::ROOT, name: b"d".to_vec(), mode: 0o755 });
        let layout = Layout { chunk_size: 1 << 20, pool: "p".into(), targets: vec![1, 2] };
        let bytes = postcard::to_stdvec(&RecordRef {
            seq: 5,
            header: &h,
            now: Timespec { sec: 1, nsec: 2 },
            op: OpRef::Meta(&op),
            ino: Some(InodeId(77)),
            layout: Some(&layout),
            kept: &[InodeId(5)],
        })
        .unwrap();
        let rec: Record = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(rec.seq, 5);
        assert_eq!(rec.header, h);
        assert!(matches!(rec.op, LoggedOp::Meta(o) if o == op));
        assert_eq!(rec.ino, Some(InodeId(77)));
        assert_eq!(rec.layout, Some(layout));
        assert_eq!(rec.kept, vec![InodeId(5)]);
    }

    #[test]
    fn a_retry_of_a_request_whose_intent_is_open_waits_for_its_recorded_reply() {
        let dir = tempfile::tempdir().unwrap();
        let mut st = MetaStore::open(dir.path(), StoreOptions::default(), DirLayout::default()).unwrap();
        let root = RequestHeader::default();
        let mk = |name: &[u8]| MetaOp::Mkdir(Mkdir { parent: InodeId::ROOT, name: name.to_vec(), mode: 0o755 });
        st.mutate(&root, mk(b"a")).unwrap();
        // A client's rmdir of "a", carried out as an intent that a restart interrupted.
        let h = RequestHeader { client_id: 5, request_id: 9, ..RequestHeader::default() };
        let id = st.begin_intent(&h, IntentKind::Rmdir, Vec::new()).unwrap();
        let rmdir = || MetaOp::Rmdir(Rmdir { parent: InodeId::ROOT, name: b"a".to_vec() });
        let busy = st.mutate(&h, rmdir()).unwrap_err();
        assert_eq!(busy.code, ErrorCode::Busy, "{busy}");
        assert_eq!(st.begin_intent(&h, IntentKind::Rmdir, Vec::new()).unwrap_err().code, ErrorCode::Busy);
        let lookup = Lookup { parent: InodeId::ROOT, name: b"a".to_vec() };
        assert!(st.resolve_name(&root, &lookup).is_ok(), "the retry ran the request a second time");
        // Other requests of the same client go on.
        let other = RequestHeader { request_id: 10, ..h.clone() };
        st.mutate(&other, mk(b"b")).unwrap();
        // Once the intent ends with a reply, the retry gets that reply and changes nothing.
        st.end_intent(id, Some(MetaReply::Unit)).unwrap();
        assert_eq!(st.mutate(&h, rmdir()).unwrap(), MetaReply::Unit);
        assert!(st.resolve_name(&root, &lookup).is_ok());
    }

    #[test]
    fn dedup_evicts_oldest() {
        let mut d = Dedup::new(2);
        d.insert((1, 1), MetaReply::Unit);
        d.insert((1, 2), MetaReply::Unit);
        d.insert((1, 3), MetaReply::Unit);
        assert!(d.get((1, 1)).is_none());
        assert!(d.get((1, 2)).is_some() && d.get((1, 3)).is_some());
    }
}
