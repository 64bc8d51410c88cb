//! Messages of the stage agents: a share of a stage-in or stage-out handed to one node's agent
//! by the coordinator (`odfs stage-in` / `odfs stage-out`), and the agent's progress.
//!
//! Paths in work items are relative to the source and destination roots and already checked
//! to be safe (no `..`, no absolute paths); the agent checks them again before touching
//! anything.

use crate::Timespec;
use serde::{Deserialize, Serialize};

/// Static S3 credentials resolved by the coordinator (from the AWS chain or the site config)
/// and handed to the agents over the job's TLS connections.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct S3Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for S3Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Credentials").field("access_key_id", &self.access_key_id).finish_non_exhaustive()
    }
}

/// How to reach one S3 bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct S3Spec {
    pub bucket: String,
    /// Key prefix, empty or ending in '/'.
    pub prefix: String,
    pub endpoint_url: Option<String>,
    pub region: String,
    pub path_style: bool,
    pub credentials: Option<S3Credentials>,
    /// Attempts per request (first try included), with exponential backoff and jitter.
    pub max_attempts: u32,
    /// Seconds a request to an endpoint that cannot be reached at all (connection refused,
    /// timed out) is tried again, with the same backoff, before it fails: a restart or a short
    /// outage of the store is waited out instead of failing the stage.
    pub unreachable_secs: u32,
}

/// One side of a stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StageEndpoint {
    S3(S3Spec),
    /// A directory of a POSIX filesystem mounted on every node (the site's global PFS).
    Posix(String),
    /// A directory of this job's odfs, by its path inside odfs.
    Odfs(String),
}

/// Per-agent limits (the coordinator divides the job's limits by the number of agents).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StageLimits {
    /// Transfers in flight at once.
    pub concurrency: u32,
    /// Requests per second toward the shared store (S3 or PFS); 0 = unlimited.
    pub requests_per_sec: f64,
    /// Bytes per second toward or from the shared store; 0 = unlimited.
    pub bytes_per_sec: u64,
    /// A drain's share of the node's time while the job is busy (0 < share < 1; anything
    /// else = no share): see the stage crate's `limit::Share`.
    #[serde(default)]
    pub share: f64,
}

/// One piece of work.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WorkItem {
    /// Copy a whole object or file: `rel` under the source root to `rel` under the destination.
    Whole { rel: String, size: u64, mtime: Timespec, mode: Option<u32> },
    /// Copy bytes `offset..offset+len` of `rel` into the destination file, which the
    /// coordinator created with its final size (stage-in of a large object).
    Range { rel: String, offset: u64, len: u64 },
    /// Upload bytes `offset..offset+len` of `rel` as part `part` of multipart upload `upload_id`
    /// (stage-out of a large file).
    Part { rel: String, upload_id: String, part: i32, offset: u64, len: u64 },
    /// Read `rel` back from the destination and report its digests (verifying a file that
    /// several agents wrote in ranges).
    Digest { rel: String, size: u64 },
    /// Report the digests of `rel` at the source, computed with multipart part size
    /// `part_size` (0 = one part): deciding whether a re-run must upload it again.
    SourceDigest { rel: String, size: u64, part_size: u64 },
}

impl WorkItem {
    pub fn rel(&self) -> &str {
        match self {
            WorkItem::Whole { rel, .. }
            | WorkItem::Range { rel, .. }
            | WorkItem::Part { rel, .. }
            | WorkItem::Digest { rel, .. }
            | WorkItem::SourceDigest { rel, .. } => rel,
        }
    }

    /// Bytes this item moves between the shared store and odfs.
    pub fn bytes(&self) -> u64 {
        match self {
            WorkItem::Whole { size, .. } => *size,
            WorkItem::Range { len, .. } | WorkItem::Part { len, .. } => *len,
            WorkItem::Digest { .. } | WorkItem::SourceDigest { .. } => 0,
        }
    }
}

/// What became of one item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ItemResult {
    pub index: u32,
    /// None when done; otherwise why it failed (after retries).
    pub error: Option<String>,
    pub bytes: u64,
    /// MD5 of the bytes moved (whole items, parts, digests).
    pub md5: Option<[u8; 16]>,
    /// CRC32C of the bytes moved.
    pub crc32c: Option<u32>,
    /// The ETag S3 returned for an upload (whole object or part), or the source's ETag.
    pub etag: Option<String>,
    /// Stage-in from S3: the server's checksum of the object, verified against `crc32c` or
    /// `md5` (see `verified`).
    pub verified: Option<String>,
    /// Multipart ETag ("md5-of-part-md5s-N") of a `SourceDigest` item.
    pub multipart_etag: Option<String>,
    /// Stage-in: stored acknowledged writing bytes with exactly `crc32c` (the CRC32C each chunk
    /// write returned, combined), so what odfs holds is what was received.
    pub written_checked: bool,
}

/// Starts a share of a stage on an agent. Replies at once; progress through `StagePoll`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageStart {
    /// Chosen by the coordinator; names the run in polls and logs.
    pub run: u64,
    /// The identity the agent acts with, on odfs and on the POSIX side: the user who asked.
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub src: StageEndpoint,
    pub dst: StageEndpoint,
    pub limits: StageLimits,
    pub items: Vec<WorkItem>,
    /// More items may follow (`StageAdd`) until one marked last: the run is not finished
    /// before. Items are numbered in the order they arrive.
    #[serde(default)]
    pub open: bool,
}

/// More items for an open run (`StageStart::open`); `last` closes it to more.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageAdd {
    pub run: u64,
    pub items: Vec<WorkItem>,
    pub last: bool,
}

/// Asks an agent how a run is going. The agent answers when the run finishes or after
/// `wait_ms` (at most [`MAX_POLL_WAIT_MS`]), whichever comes first, so the coordinator learns
/// of the end at once without asking often.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagePoll {
    pub run: u64,
    #[serde(default)]
    pub wait_ms: u32,
    /// An open run's poll is also answered when no more than this many of its items are left
    /// to finish (0: not), so the coordinator can add more before it runs dry.
    #[serde(default)]
    pub low_water: u32,
    /// How many of the run's results the caller holds: an unfinished run's answer carries the
    /// results after those (each item's, as it ends, so the caller can record progress); a
    /// finished run's carries them all, final.
    #[serde(default)]
    pub have: u32,
}

/// Stops a run: items not started fail as cancelled, those in flight end; the run then
/// finishes as usual (its results recorded, polls answered).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageCancel {
    pub run: u64,
}

/// The longest an agent holds a `StagePoll` before answering.
pub const MAX_POLL_WAIT_MS: u32 = 1000;

/// Counters of one agent for one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct StageCounters {
    pub items_total: u64,
    pub items_done: u64,
    pub bytes: u64,
    pub errors: u64,
    pub retries: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageStatus {
    pub counters: StageCounters,
    /// True once every item is done or failed; `results` is then complete and final (an
    /// unfinished run's are the new ones since `StagePoll::have`, provisional: a share whose
    /// files metad does not take at its end fails them all).
    pub finished: bool,
    pub results: Vec<ItemResult>,
}

/// Starts draining `src` (an odfs directory) to `dst` while the job runs, on the agent that
/// receives it (node 0's): see docs/architecture.md, "Continuous drain". A drain already
/// running for `src` is replaced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrainStart {
    pub src: String,
    pub dst: StageEndpoint,
    /// The identity the drain reads and uploads with: the job's user.
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// Milliseconds a file's attributes must stay unchanged before it is uploaded.
    pub settle_ms: u64,
    /// Keep only the objects of the last `keep` whole checkpoints in `dst` (0 = keep all): a
    /// checkpoint is each entry at the top of `src`, a directory with all below it or a file.
    pub keep: u32,
    /// Limits of the drain's own transfers, per agent.
    pub limits: StageLimits,
    /// Files at least this large are uploaded in multipart parts of `part_size`.
    pub split_threshold: u64,
    pub part_size: u64,
    /// Delete each file from odfs once its upload is verified, unless it changed or is open on
    /// any node (`UnlinkIdle`): for checkpoints, opt-in.
    #[serde(default)]
    pub delete_after_upload: bool,
    /// A checkpoint directory is whole only once it holds a file of this name, which is
    /// uploaded only after the rest of its directory.
    #[serde(default)]
    pub marker: Option<String>,
}

/// Stops the drain of `src` (every drain if None), after the pass in flight; replies with
/// their final state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainStop {
    pub src: Option<String>,
}

/// Asks for the state of every drain of this agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainList {}

/// One drain as its agent sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct DrainState {
    pub src: String,
    /// Where it uploads, as `s3://bucket/prefix` or a path.
    pub dst: String,
    pub running: bool,
    /// Files seen that are not drained in their present state: settling or waiting for a pass.
    pub pending: u64,
    /// Files of the pass in flight.
    pub in_flight: u64,
    /// Files drained (verified in `dst`) and their bytes, since the drain started; and files
    /// uploaded again after a change.
    pub uploaded: u64,
    pub uploaded_bytes: u64,
    pub reuploaded: u64,
    /// Uploads that failed (each is tried again later) and the latest reason.
    pub failed: u64,
    pub last_error: Option<String>,
    /// Objects deleted from `dst` by `keep`, and the checkpoints they made up.
    pub retired: u64,
    #[serde(default)]
    pub retired_checkpoints: u64,
    /// Files deleted from odfs after their upload (`delete_after_upload`), and files whose
    /// deletion waits because they are open somewhere.
    pub deleted: u64,
    pub delete_waiting: u64,
    /// Passes that ran.
    pub passes: u64,
}

crate::rpc! {
    StageStart = 300 => (),
    StagePoll = 301 => StageStatus,
    DrainStart = 302 => (),
    DrainStop = 303 => Vec<DrainState>,
    DrainList = 304 => Vec<DrainState>,
    StageAdd = 305 => (),
    StageCancel = 306 => (),
}
