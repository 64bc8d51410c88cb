//! Recycled payload buffers: the page-aligned buffers that large request payloads (chunk
//! writes, at stored) are read into, kept for the next payload once the last reference to one
//! is dropped.
//!
//! Why: a fresh megabyte is a megabyte of pages the process has not touched, and the copy out
//! of the socket faults each of them in (3.3% of all samples of a sequential write through the
//! mount, in stored; more where the host reclaims freed memory). A recycled buffer's pages are
//! mapped already. Buffers come in power-of-two classes from `MIN` to `MAX` bytes; at most
//! `KEEP` bytes wait idle, the rest are freed.

use crate::conn::PAYLOAD_ALIGN;
use bytes::Bytes;
use std::sync::Mutex;

/// Smallest payload read into a recycled buffer: below it the allocator's own free lists keep
/// memory warm.
const MIN: usize = 64 << 10;
/// Largest payload recycled (`odfs_proto::codec::MAX_IO`, a chunk write's largest).
const MAX: usize = odfs_proto::codec::MAX_IO;
/// Classes: MIN, 2 MIN, ... MAX.
const CLASSES: usize = (MAX / MIN).trailing_zeros() as usize + 1;
/// Most bytes of idle buffers kept per process (32 one-megabyte chunk writes).
const KEEP: usize = 32 << 20;

/// Idle buffers by class, and their bytes.
struct Idle {
    by_class: [Vec<Vec<u8>>; CLASSES],
    bytes: usize,
}

static IDLE: Mutex<Idle> = Mutex::new(Idle { by_class: [const { Vec::new() }; CLASSES], bytes: 0 });

/// A buffer for one payload: its bytes start at `start`, on a [`PAYLOAD_ALIGN`] boundary.
/// Dropped (when the last `Bytes` made of it is), it goes back to the idle buffers of its class.
pub(crate) struct Recycled {
    buf: Vec<u8>,
    start: usize,
    class: Option<usize>,
}

/// The class of a payload of `len` bytes, `None` outside `MIN..=MAX`.
fn class_of(len: usize) -> Option<usize> {
    (MIN..=MAX).contains(&len).then(|| (len.next_power_of_two() / MIN).trailing_zeros() as usize)
}

impl Recycled {
    /// An empty buffer with room for `len` bytes after its aligned start: an idle one of
    /// `len`'s class when there is one, else a new one.
    pub(crate) fn take(len: usize) -> Recycled {
        let class = class_of(len);
        let idle = class.and_then(|c| {
            let mut idle = IDLE.lock().expect("recycled buffers lock");
            let buf = idle.by_class[c].pop()?;
            idle.bytes -= buf.capacity();
            Some(buf)
        });
        let mut buf = idle.unwrap_or_else(|| {
            let room = class.map_or(len, |c| MIN << c);
            Vec::with_capacity(room + PAYLOAD_ALIGN - 1)
        });
        let start = buf.as_ptr().align_offset(PAYLOAD_ALIGN);
        buf.clear();
        buf.resize(start, 0);
        Recycled { buf, start, class }
    }

    /// The buffer to append the payload to (it holds the padding before the start).
    pub(crate) fn vec(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// Bytes appended so far.
    pub(crate) fn len(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The payload, as shared bytes that give the buffer back when the last of them goes.
    pub(crate) fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.buf[self.start..]
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        let Some(class) = self.class else { return };
        let buf = std::mem::take(&mut self.buf);
        let mut idle = IDLE.lock().expect("recycled buffers lock");
        if idle.bytes + buf.capacity() <= KEEP {
            idle.bytes += buf.capacity();
            idle.by_class[class].push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_min_to_max_and_nothing_else() {
        assert_eq!(class_of(MIN - 1), None);
        assert_eq!(class_of(MIN), Some(0));
        assert_eq!(class_of(MIN + 1), Some(1));
        assert_eq!(class_of(1 << 20), Some(4));
        assert_eq!(class_of(MAX), Some(CLASSES - 1));
        assert_eq!(class_of(MAX + 1), None);
    }

    #[test]
    fn a_buffer_is_aligned_holds_its_bytes_and_is_used_again_once_dropped() {
        let len = 300 << 10;
        let mut b = Recycled::take(len);
        assert_eq!(b.vec().as_ptr().wrapping_add(b.start) as usize % PAYLOAD_ALIGN, 0);
        let first = b.vec().as_ptr();
        b.vec().extend(std::iter::repeat_n(7u8, len));
        assert_eq!(b.vec().as_ptr(), first, "the payload fits without a reallocation");
        let bytes = b.freeze();
        assert_eq!(bytes.len(), len);
        assert_eq!(bytes.as_ptr() as usize % PAYLOAD_ALIGN, 0);
        assert!(bytes.iter().all(|&x| x == 7));
        let part = bytes.slice(10..20);
        drop(bytes);
        assert_eq!(&part[..], &[7u8; 10], "a slice keeps the buffer alive");
        drop(part);
        // Tests share the process's idle buffers: the one given back may be taken by another
        // test first, so look for it among a few takes.
        let again: Vec<Recycled> = (0..4).map(|_| Recycled::take(len)).collect();
        assert!(again.iter().any(|b| b.buf.as_ptr() == first), "the dropped buffer is reused");
        assert!(again.iter().all(|b| b.len() == 0), "a reused buffer starts empty");
    }

    #[test]
    fn payloads_outside_the_classes_get_their_own_buffers() {
        for len in [PAYLOAD_ALIGN, MIN - 1, MAX + 1] {
            let mut b = Recycled::take(len);
            assert_eq!(b.class, None);
            b.vec().extend(std::iter::repeat_n(1u8, len));
            assert_eq!(b.freeze().len(), len);
        }
    }
}
