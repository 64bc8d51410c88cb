//! Drop-behind: which pages of a chunk file a sequential reader has left behind, to drop from
//! the page cache once they are sent. Owns only that decision, per chunk file; whoever reads
//! the file makes the call (`fileio::dont_need`): stored for the reads it serves, the client for
//! the chunks of its own node it reads itself.
//!
//! A reader through the mount keeps what it read in its own node's page cache, so the chunk
//! file's cached copy of a chunk read once from start to end is a second one, in memory the job
//! wants, and filling it costs a page allocation per 4 KiB (docs/architecture.md, "Stored drops
//! what a single sequential reader has read"). Only one kind of reader is followed: one stream
//! moving forward. A read well behind the stream's front — a second reader, a re-read, a random
//! reader — marks the file shared, and its pages are left to the kernel from then on: a file
//! read by many nodes (every rank loading the same weights) is read from the disk at most once
//! more than with the cache kept.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

/// How far behind the stream's front a page must be before it is dropped: the bytes sent
/// must have left the socket or pipe (a page still referenced is not dropped, and a failed
/// drop makes the kernel drain every CPU's page lists). Far more than a reader has in flight
/// per target (the mount's read-ahead is 1 MiB windows).
const LAG: u64 = 16 << 20;

/// Ranges are dropped whole folios at a time (a folio partly outside the range stays): the
/// largest page-cache folio (2 MiB, a PMD) bounds their alignment.
const ALIGN: u64 = 2 << 20;

/// Smallest range worth a call: one `fadvise` per this much read, not per read.
const BATCH: u64 = 4 << 20;

/// A read this far behind the front is not the stream's own: the requests of one reader
/// arrive out of order only within what it has in flight.
const SLACK: u64 = 8 << 20;

/// The reads of one open chunk file as seen so far.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stream {
    state: State,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
enum State {
    /// Nothing read yet.
    #[default]
    Fresh,
    /// One reader moving forward: `front` is the end of its furthest read, `dropped` where
    /// dropping has reached (everything before it was asked to go).
    Forward { front: u64, dropped: u64 },
    /// More than one reader, or not a forward one: pages are left to the kernel.
    Shared,
}

impl Stream {
    /// Whether the file has been marked shared: a drop decided earlier but not made yet must
    /// then not be made (the pages it would drop may be another reader's by now).
    pub fn is_shared(&self) -> bool {
        self.state == State::Shared
    }

    /// Notes a read of `len` bytes at `offset`; returns the range to drop now, if any.
    pub fn read(&mut self, offset: u64, len: u64) -> Option<Range<u64>> {
        let end = offset.saturating_add(len);
        let (front, dropped) = match self.state {
            State::Shared => return None,
            State::Fresh => (end, align_down(offset)),
            State::Forward { front, .. } if offset.saturating_add(SLACK) < front => {
                // Behind the front: someone else reads this file, or reads it again.
                self.state = State::Shared;
                return None;
            }
            // A jump ahead (a reader skipping part of the file) drops only what it reads.
            State::Forward { front, dropped } if offset > front.saturating_add(SLACK) => {
                (end, dropped.max(align_down(offset)))
            }
            State::Forward { front, dropped } => (front.max(end), dropped),
        };
        let upto = align_down(front.saturating_sub(LAG));
        let (drop, dropped) = if upto >= dropped + BATCH { (Some(dropped..upto), upto) } else { (None, dropped) };
        self.state = State::Forward { front, dropped };
        drop
    }
}

/// One chunk file's [`Stream`], shared by the reads noted into it and the drops they decide.
/// A read is noted before its bytes are read, and a drop holds the stream while it is made:
/// a second reader noted before the drop calls it off, one noted after waits for it and then
/// reads its pages back, so no drop ever takes pages a later reader has just read.
#[derive(Debug, Default, Clone)]
pub struct Followed(Arc<Mutex<Stream>>);

impl Followed {
    /// [`Stream::read`], for a read about to be made: the drop it decides, if any.
    pub fn read(&self, offset: u64, len: u64) -> Option<Due> {
        let range = self.lock().read(offset, len)?;
        Some(Due { range, stream: self.clone() })
    }

    fn lock(&self) -> MutexGuard<'_, Stream> {
        // A stream is plain data, whole after any panic: a poisoned lock still holds it.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A drop [`Followed::read`] decided: the range of the chunk file to drop from the page cache.
#[must_use = "a drop is made only by `spawn`"]
pub struct Due {
    range: Range<u64>,
    stream: Followed,
}

impl Due {
    /// Makes the drop (`drop(range)`) on the blocking pool, not waited for: advice, which no
    /// read depends on.
    pub fn spawn(self, drop: impl FnOnce(Range<u64>) + Send + 'static) {
        tokio::task::spawn_blocking(move || self.make(drop));
    }

    /// Makes the drop unless the file has been marked shared since, holding the stream meanwhile.
    fn make(self, drop: impl FnOnce(Range<u64>)) {
        let stream = self.stream.lock();
        if !stream.is_shared() {
            drop(self.range.clone());
        }
    }
}

fn align_down(x: u64) -> u64 {
    x - x % ALIGN
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Reads `len`-byte pieces from `from` to `to` in order; the ranges dropped.
    fn forward(s: &mut Stream, from: u64, to: u64, len: u64) -> Vec<Range<u64>> {
        (from..to).step_by(len as usize).filter_map(|o| s.read(o, len)).collect()
    }

    #[test]
    fn a_forward_reader_has_everything_behind_the_lag_dropped_once_in_aligned_batches() {
        let mut s = Stream::default();
        let drops = forward(&mut s, 0, 64 * MIB, MIB);
        // Contiguous from 0, each at least a batch, aligned, and never within LAG of the front.
        assert_eq!(drops.first().map(|r| r.start), Some(0));
        for w in drops.windows(2) {
            assert_eq!(w[0].end, w[1].start, "no page dropped twice, none skipped");
        }
        for r in &drops {
            assert!(r.end - r.start >= BATCH && r.start % ALIGN == 0 && r.end % ALIGN == 0, "{r:?}");
        }
        let reached = drops.last().expect("drops").end;
        assert!(reached <= 64 * MIB - LAG && reached + BATCH + ALIGN > 64 * MIB - LAG, "reached {reached}");
    }

    #[test]
    fn requests_arriving_out_of_order_within_the_slack_are_the_same_reader() {
        let mut s = Stream::default();
        let order = [0, 2, 1, 3, 5, 4, 7, 6].iter().chain(&[9, 8, 10, 11]).map(|i| i * MIB);
        order.for_each(|o| {
            s.read(o, MIB);
        });
        let more = forward(&mut s, 12 * MIB, 40 * MIB, MIB);
        assert!(!more.is_empty(), "still dropping behind: {s:?}");
    }

    #[test]
    fn a_second_reader_or_a_re_read_marks_the_file_shared_for_good() {
        let mut s = Stream::default();
        assert!(!forward(&mut s, 0, 40 * MIB, MIB).is_empty());
        assert!(!s.is_shared());
        // Another reader starts at the beginning: nothing more is dropped, for either, and a
        // drop decided before but not made yet is called off (`is_shared`).
        assert_eq!(s.read(0, MIB), None);
        assert!(s.is_shared());
        assert_eq!(forward(&mut s, 40 * MIB, 200 * MIB, MIB), Vec::<Range<u64>>::new());
        assert_eq!(s.state, State::Shared);
    }

    #[test]
    fn a_drop_is_called_off_by_a_reader_noted_before_it_is_made() {
        let f = Followed::default();
        let decided = (0..40).find_map(|i| f.read(i * MIB, MIB)).expect("a drop");
        let made = std::cell::Cell::new(None);
        decided.make(|r| made.set(Some(r)));
        assert!(made.take().is_some(), "with no other reader the drop is made");
        let again = (40..80).find_map(|i| f.read(i * MIB, MIB)).expect("a later drop");
        assert!(f.read(0, MIB).is_none(), "a re-read from the start");
        again.make(|r| made.set(Some(r)));
        assert!(made.take().is_none() && f.lock().is_shared(), "the drop decided before the re-read is not made");
    }

    #[test]
    fn a_random_reader_drops_nothing() {
        let mut s = Stream::default();
        let offsets = [700, 3, 512, 90, 1000, 44, 800, 260].map(|i| i * MIB);
        let drops: Vec<_> = offsets.iter().filter_map(|&o| s.read(o, MIB)).collect();
        assert!(drops.is_empty(), "{drops:?}");
    }

    #[test]
    fn a_jump_ahead_drops_only_what_is_read_after_it() {
        let mut s = Stream::default();
        forward(&mut s, 0, 8 * MIB, MIB);
        let drops = forward(&mut s, 500 * MIB, 540 * MIB, MIB);
        assert!(!drops.is_empty());
        assert!(drops.iter().all(|r| r.start >= 500 * MIB), "{drops:?}");
    }

    #[test]
    fn a_reader_starting_mid_file_drops_from_where_it_started() {
        let mut s = Stream::default();
        let drops = forward(&mut s, 100 * MIB + 4096, 140 * MIB, MIB);
        assert_eq!(drops.first().map(|r| r.start), Some(100 * MIB));
    }
}
