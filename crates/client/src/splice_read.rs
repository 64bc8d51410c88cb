//! Spliced reads: a read's bytes gathered in a pipe with no copy of this process's
//! (docs/decisions/0017-spliced-reads.md).
//!
//! Owns the streams to stored that spliced reads use (one exchange at a time each, kept per
//! address between reads) and the filling of a pipe with a read's segments, in file order: a
//! segment on this node's own target spliced from its chunk file, any other asked of its
//! stored (every request sent before the first reply is taken), the reply's payload spliced
//! from the socket; a hole or a short chunk file as zeros.

use crate::{Client, ClientError, Ctx, Result};
use odfs_proto::layout::{chunk_path, Segment};
use odfs_proto::storage::ReadChunk;
use odfs_proto::InodeId;
use odfs_rpc::splice::{Pipe, SpliceStream};
use odfs_rpc::Transport;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Mutex;

/// Idle streams kept per stored: as many as reads of one mount are in flight at once.
const IDLE_PER_PEER: usize = 64;

/// Streams to stored not in use, by address.
#[derive(Default)]
pub(crate) struct SpliceStreams {
    idle: Mutex<HashMap<SocketAddr, Vec<SpliceStream>>>,
}

/// Where one segment's bytes come from.
enum Source {
    /// This node's target: its chunk file.
    Local(PathBuf),
    /// A stored, asked already: the stream and the call its reply answers.
    Remote(SocketAddr, SpliceStream, u64),
}

impl Client {
    /// Whether this client can splice reads: its chunk data travels over TCP.
    pub fn can_splice(&self) -> bool {
        self.inner.cfg.bulk_transport == Transport::Tcp
    }

    /// Appends the bytes of `segs` (consecutive, of file `ino`) to `pipe`. `Err` leaves the
    /// pipe holding part of them.
    pub(crate) async fn splice_segments(&self, ino: InodeId, segs: Vec<Segment>, pipe: &mut Pipe) -> Result<()> {
        let mut plan = Vec::with_capacity(segs.len());
        for seg in segs {
            let source = match self.inner.local.dir(&self.inner.cluster, seg.target) {
                Some(dir) => {
                    self.inner.local.read_behind(seg.target, ino, &dir, seg.local_offset, seg.len);
                    Source::Local(chunk_path(&dir, ino))
                }
                None => {
                    let (addr, _) = self.inner.cluster.target_addr(seg.target, Transport::Tcp)?;
                    let mut s = self.splice_stream(addr).await?;
                    let req = ReadChunk { target: seg.target, ino, offset: seg.local_offset, len: seg.len as u32 };
                    let call = s.send(&self.header(&Ctx::root()), &req).await?;
                    Source::Remote(addr, s, call)
                }
            };
            plan.push((seg.len as usize, seg.local_offset, source));
        }
        for (len, offset, source) in plan {
            let got = match source {
                Source::Local(path) => pipe.splice_path(path, offset, len).await.map_err(io_error)?,
                Source::Remote(addr, mut s, call) => {
                    let n = s.receive_into::<ReadChunk>(call, pipe).await?;
                    self.keep_splice_stream(addr, s);
                    n
                }
            };
            pipe.write_zeros(len.saturating_sub(got)).map_err(io_error)?;
        }
        Ok(())
    }

    /// An idle stream to `addr`, or a new one.
    async fn splice_stream(&self, addr: SocketAddr) -> Result<SpliceStream> {
        let idle = self.inner.splice.idle.lock().expect("splice streams lock").get_mut(&addr).and_then(Vec::pop);
        match idle {
            Some(s) => Ok(s),
            None => Ok(SpliceStream::connect(self.inner.pool.credential(), addr).await?),
        }
    }

    /// Puts back a stream whose last exchange ended whole.
    fn keep_splice_stream(&self, addr: SocketAddr, s: SpliceStream) {
        let mut idle = self.inner.splice.idle.lock().expect("splice streams lock");
        let list = idle.entry(addr).or_default();
        if list.len() < IDLE_PER_PEER {
            list.push(s);
        }
    }
}

fn io_error(e: std::io::Error) -> ClientError {
    ClientError::new(odfs_proto::ErrorCode::Io, format!("spliced read: {e}"))
}
